"""The tests' one multi-rank harness: ranks meet through a file, or through a port this process holds.

* ``run_ranks(fn, world_size, tmp_path, *args)`` runs ``fn(rank, world_size, *args)`` on forked ranks. They meet in a
  gloo group on a ``file://`` rendezvous in ``tmp_path`` (a fresh file per call), or, with ``group=False``, in no group
  at all: the code under test then meets on ``MASTER_PORT`` itself (a ``ControlGroup``, Lightning's external-launch
  path), as a torchrun job's ranks would. The first rank that fails, or the timeout, kills every rank; the failing
  rank's exception is re-raised in the test with that rank's traceback attached as a note.
* ``held_port()``: a TCP port that stays this process's until the block ends, for the launchers that read
  ``MASTER_PORT`` (Lightning's fork/popen launchers, Fabric's, ``pdist fit``, torchrun-style jobs). conftest.py's
  autouse ``master_port`` fixture exports one per test.

Why a held port and not a port picked free and released: another process can take a released port before rank 0
binds it (xdist workers run side by side). Why not a store the test process hosts (``TCPStore`` on port 0, ranks
joining with ``TORCHELASTIC_USE_AGENT_STORE``): an earlier attempt did that and hung twice in gloo's rendezvous in a
full run under load 12, both times in a 4-rank test, while 10 repeats alone and beside 6 busy processes passed. The
likely reason (not shown): the store serves from a native thread in the test process, and the ranks are forked from
that process while the thread runs (accepting the first ranks' connections, naming each peer with a reverse DNS
query); a thread caught inside a lock or a one-time initialisation at ``fork()`` leaves the child that lock taken for
good, and a 4-rank launch forks the most ranks after the first one connected. A held port keeps the test process free
of threads, and the ranks use the path users get (rank 0 binds ``MASTER_PORT``), not torchrun's agent-store path.
"""

from __future__ import annotations

import errno
import os
import pickle
import socket
import time
import traceback
import uuid
from contextlib import contextmanager
from multiprocessing import get_context
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Callable, Iterator

import torch.distributed as dist

from lightning_pdist.core import forking

__all__ = ["held_master_port", "held_port", "run_ranks"]


@contextmanager
def held_port(count: int = 1) -> Iterator[int]:
    """The first of ``count`` consecutive TCP ports that no other process can take until the block ends.

    Each port is held by a socket bound with ``SO_REUSEADDR`` on the IPv4 and IPv6 wildcard addresses and never
    listening. Linux then lets a socket that also sets ``SO_REUSEADDR`` and listens bind it (torch's store on rank 0,
    ``socket.create_server``, ``ControlGroup``'s listener: what the ranks do), refuses any bind without the option,
    and never hands a held port to another ``bind(port 0)`` or outgoing connection (``test_ranks.py`` checks all
    three). The first port is the kernel's choice (``bind`` to port 0); the next ones must be free after it.
    """
    for _ in range(50):
        socks: list[socket.socket] = []
        try:
            first = _hold(socks, 0)
            if first + count - 1 > 65535:
                raise OSError(f"{count} ports from {first} pass 65535")
            for port in range(first + 1, first + count):
                _hold(socks, port)
        except OSError:
            for sock in socks:
                sock.close()
            continue
        try:
            yield first
        finally:
            for sock in socks:
                sock.close()
        return
    raise RuntimeError(f"held_port: no {count} consecutive free ports in 50 tries")


@contextmanager
def held_master_port() -> Iterator[int]:
    """``MASTER_PORT`` set to a port held for the block (:func:`held_port`); its previous value is back afterwards.

    For one launch that must not meet an earlier one's store: a 1-rank run in this process keeps its default group, and
    the store on its port, until the test ends (conftest.py), so a later launch on the test's own port would find the
    port taken.
    """
    before = os.environ.get("MASTER_PORT")
    with held_port() as port:
        os.environ["MASTER_PORT"] = str(port)
        try:
            yield port
        finally:
            if before is None:
                os.environ.pop("MASTER_PORT", None)
            else:
                os.environ["MASTER_PORT"] = before


def _hold(socks: list[socket.socket], port: int) -> int:
    """Bind ``port`` (0: the kernel's choice) on 0.0.0.0, then on :: (IPv6 only) where the host has IPv6."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    socks.append(sock)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("0.0.0.0", port))
    port = sock.getsockname()[1]
    if socket.has_ipv6:
        try:
            six = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        except OSError:  # no IPv6 in this kernel
            return port
        socks.append(six)
        six.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        six.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            six.bind(("::", port))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise
            # IPv6 unusable here (disabled, no wildcard): nothing can listen on it either
    return port


def _entry(rank: int, world_size: int, init: str | None, errors: Path, fn: Callable[..., Any], args: tuple) -> None:
    # conftest.py froze everything this rank inherited (gc.freeze at every fork), so it never collects a garbage process
    # group of the parent's; marked as such, a fork of its own (a parameter server's) leaves that frozen too. (Not
    # frozen_for_fork() in the parent: it unfreezes the parent afterwards, whose full collections then walk every
    # object importing Lightning made; core/forking.py measured 0.25-0.4 s each.)
    forking._forking = True
    code = 0
    try:
        if init is not None:
            dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
            # Every rank through one collective before fn: a rank whose fn returns at once (os._exit below) closed its
            # sockets while another was still connecting gloo's mesh ("connectFullMesh failed ... Connection closed by
            # peer": tests/test_ranks.py's hung-rank test, fresh-clone run O).
            dist.barrier()
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


def run_ranks(fn: Callable[..., Any], world_size: int, tmp_path: Path | str, *args: Any, timeout: float = 120.0,
              group: bool = True) -> None:  # fmt: skip
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked ranks inside a gloo process group (``group=False``:
    none; the ranks inherit this process's environment, ``MASTER_PORT`` included).

    Returns when every rank returned. Raises the first failing rank's exception (its traceback in a note), or
    ``TimeoutError`` naming the ranks still running after ``timeout`` seconds; either way every rank is killed first.
    """
    run = Path(tmp_path) / f"ranks-{uuid.uuid4().hex[:8]}"
    run.mkdir(parents=True)
    init = f"file://{run / 'rendezvous'}" if group else None
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
