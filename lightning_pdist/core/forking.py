"""Forking a process that may hold gloo process groups, without inheriting their threads' absence.

A gloo process group owns threads; ``fork()`` copies the group's memory into the child but not its threads. In the
child, a collective on the inherited group waits forever, and so does the garbage collector freeing one
(``ProcessGroupGloo::~ProcessGroupGloo`` joins its threads): a finished DDP wrap leaves its Reducer and group in
reference cycles, freed whenever the collector next runs, in whichever process that is. So every fork here freezes
what the child inherits (``gc.freeze``: every object alive at the fork moves to the permanent generation, which no
collection examines): the child never frees an inherited object, garbage group or not; the parent frees its own
garbage later, where the threads exist. Nothing is collected before the fork: a full collection costs 0.25-0.4 s
in a process that imported Lightning and ``transformers`` (450k objects), on every launch and every server start, and
the freeze alone keeps the child from ever running an inherited destructor. A live default group is refused where a
fork would start ranks (:func:`refuse_live_process_group`).

A process that inherited frozen objects (a forked rank) never unfreezes them, not even after forking a child of its
own (a parameter server): what it holds at that fork stays frozen too (memory it shares with the child anyway). The
objects the package's own import froze (:mod:`lightning_pdist.core.startup`) are not inherited ones: the process that
froze them unfreezes them with the rest after its fork.
"""

from __future__ import annotations

import contextlib
import gc
import os
from typing import Iterator

import torch.distributed as dist

from lightning_pdist.core.startup import froze_at_import

__all__ = ["fork_process", "frozen_for_fork", "refuse_live_process_group"]


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
def frozen_for_fork() -> Iterator[None]:
    """Around code that forks (a ``torch.multiprocessing`` launch): the children inherit every object alive here
    frozen, so their collector never frees one (a garbage gloo group among them would join threads they lack).

    The parent's objects are unfrozen again afterwards, unless the parent itself runs on frozen inherited objects (it
    is a forked child): those stay frozen for good. The children must leave with ``os._exit`` (as
    ``torch.multiprocessing`` and :func:`fork_process` children do), never through this block's end.
    """
    global _forking
    inherited, _forking = _inherited(), True  # the children see True: they run on inherited frozen objects
    gc.freeze()
    try:
        yield
    finally:
        _forking = inherited
        if not inherited:
            gc.unfreeze()


def fork_process() -> int:
    """``os.fork()`` for a process that may hold gloo groups (:func:`frozen_for_fork`); returns the child's pid.

    The child stays frozen: what it inherited is never collected there; what it allocates itself is.
    """
    global _forking
    inherited, _forking = _inherited(), True
    gc.freeze()
    pid = os.fork()
    if pid != 0:
        _forking = inherited
        if not inherited:
            gc.unfreeze()
    return pid


#: True in a process forked by :func:`frozen_for_fork` or :func:`fork_process` (set in the parent around the fork, so
#: the child's copy says so), and in a parent that is itself such a child. It spares the count below, which walks the
#: whole permanent generation: ~80 ms with Lightning imported, once per parameter-server start in a forked rank.
_forking = False


def _inherited() -> bool:
    """Whether this process holds frozen objects it inherited from a fork (never to be unfrozen here)."""
    return _forking or (not froze_at_import() and gc.get_freeze_count() > 0)
