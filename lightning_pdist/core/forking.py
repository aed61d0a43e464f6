"""Forking a process that may hold gloo process groups, without inheriting their threads' absence.

A gloo process group owns threads; ``fork()`` copies the group's memory into the child but not its threads. In the
child, a collective on the inherited group waits forever, and so does the garbage collector freeing one
(``ProcessGroupGloo::~ProcessGroupGloo`` joins its threads): a finished DDP wrap leaves its Reducer and group in
reference cycles, freed whenever the collector next runs, in whichever process that is. So every fork here collects
garbage first (in the parent, where the threads exist) and freezes what the child inherits (``gc.freeze``: moved to
the permanent generation, never collected there); a live default group is refused where a fork would start ranks.
"""

from __future__ import annotations

import contextlib
import gc
import os
from typing import Iterator

import torch.distributed as dist

__all__ = ["collect_before_fork", "fork_process", "refuse_live_process_group"]


def refuse_live_process_group(owner: str) -> None:
    """Raise if this process holds a live default process group, which a ``fork`` launch would copy into every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    raise RuntimeError(
        f"{owner}(start_method='fork'): this process holds a live torch.distributed process group (backend "
        f"{dist.get_backend()!r}, world size {dist.get_world_size()}), e.g. left by an earlier fit whose rank 0 ran "
        "here (Lightning keeps it until the process exits). Forked ranks would inherit it without its threads and "
        "hang in their first collective. Call torch.distributed.destroy_process_group() before this fit, or use the "
        "default start method ('popen') or the '_spawn' variant of the strategy name."
    )


@contextlib.contextmanager
def collect_before_fork() -> Iterator[None]:
    """Around a ``fork``: collect garbage here, and freeze what the children inherit so they never collect it.

    Garbage process groups (in reference cycles with a finished DDP Reducer) are freed here, where their threads
    exist; every object alive at the fork is moved to the collector's permanent generation, which the children
    inherit, so a child's collector never runs a destructor that would join threads it does not have.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def fork_process() -> int:
    """``os.fork()`` for a process that may hold gloo groups (:func:`collect_before_fork`); returns the child's pid.

    The child stays frozen: what it inherited is never collected there; what it allocates itself is.
    """
    gc.collect()
    gc.freeze()
    pid = os.fork()
    if pid != 0:
        gc.unfreeze()
    return pid
