"""One multi-rank harness for the tests: ``run_ranks(fn, world_size, tmp_path, *args)``.

Each rank is a real forked process in a real gloo process group, which meets on a ``file://`` rendezvous in
``tmp_path`` (a fresh file per call: no TCP port is picked free and released, so nothing else can take it in
between). The first rank that fails, or the timeout, kills every rank; the failing rank's exception is re-raised
in the test with that rank's traceback attached as a note.
"""

from __future__ import annotations

import os
import pickle
import time
import traceback
import uuid
from multiprocessing import get_context
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

__all__ = ["run_ranks"]


def _entry(rank: int, world_size: int, init: str, errors: Path, fn: Callable[..., Any], args: tuple) -> None:
    code = 0
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
        fn(rank, world_size, *args)
        # No destroy_process_group(): freeing the group here can deadlock in torch (~ProcessGroupGloo joins the
        # group's work thread holding the GIL while that thread waits for the GIL to free the last collective's
        # tensors; see lightning_pdist/bench/sign_worker.py). os._exit below ends the process without destructors.
    except BaseException as err:  # noqa: BLE001  (reported to the test, whatever it is)
        code = 1
        try:
            raised = pickle.dumps(err)
            pickle.loads(raised)
        except Exception:  # noqa: BLE001  (an exception that does not pickle travels as its text)
            raised = pickle.dumps(RuntimeError(f"{type(err).__name__}: {err}"))
        (errors / f"rank{rank}").write_bytes(pickle.dumps((raised, traceback.format_exc())))
    os._exit(code)  # no atexit handlers, no flushing of the parent's inherited buffers


def run_ranks(fn: Callable[..., Any], world_size: int, tmp_path: Path | str, *args: Any, timeout: float = 120.0) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked ranks inside a gloo process group.

    Returns when every rank returned. Raises the first failing rank's exception (its traceback in a note), or
    ``TimeoutError`` naming the ranks still running after ``timeout`` seconds; either way every rank is killed first.
    """
    run = Path(tmp_path) / f"ranks-{uuid.uuid4().hex[:8]}"
    run.mkdir(parents=True)
    init = f"file://{run / 'rendezvous'}"
    context = get_context("fork")
    procs = [context.Process(target=_entry, args=(r, world_size, init, run, fn, args)) for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        while any(p.exitcode is None for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            left = deadline - time.monotonic()
            if left <= 0:
                running = [r for r, p in enumerate(procs) if p.exitcode is None]
                raise TimeoutError(f"run_ranks: ranks {running} of {world_size} still running after {timeout} s; killed")
            wait([p.sentinel for p in procs if p.exitcode is None], timeout=min(left, 1.0))
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
            p.join()
    failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
    reported = sorted((r for r in failed if (run / f"rank{r}").exists()), key=lambda r: (run / f"rank{r}").stat().st_mtime_ns)
    if reported:
        raised, trace = pickle.loads((run / f"rank{reported[0]}").read_bytes())
        err = pickle.loads(raised)
        err.add_note(f"raised on rank {reported[0]} of {world_size}:\n{trace}")
        raise err
    if failed:
        raise RuntimeError(f"run_ranks: rank {failed[0]} of {world_size} died with exit code {procs[failed[0]].exitcode}")
