"""Which ranks are still alive when a collective fails: one heartbeat counter per rank in the job's TCP store.

A failed gloo collective never says which rank is missing: ``Timed out waiting 1800000ms for recv operation``,
``Application timeout caused pair closure``, ``Connection closed by peer [127.0.0.1]:53386``. So every rank runs a
:class:`Heartbeat`, a daemon thread that adds 1 to its own counter (``pdist/heartbeat/{rank}``) every ``period``
seconds, over a store connection of its own (one per process and store, shared by its heartbeats). When a
collective fails, :func:`silent_ranks` reads every counter twice, ``wait`` seconds apart: a rank whose counter
did not move is stopped (SIGSTOP, a debugger), dead, or cut off from the store. Counters, not timestamps, so no
clocks are compared across hosts. A rank whose main thread hangs (a deadlock, an endless loop) still beats and is not
named; :func:`describe_silent_ranks` says so.

The store is the job's rendezvous store (``MASTER_ADDR:MASTER_PORT``; under Lightning's launchers global rank 0
hosts it). If it does not answer, the rank that hosts it is the one to look at, and the description says that.

Never imports Lightning.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import torch.distributed as dist

__all__ = ["Heartbeat", "default_store_address", "describe_silent_ranks", "looks_like_a_lost_peer", "silent_ranks"]

_PREFIX = "pdist/heartbeat/"
_LOST_PEER = ("Timed out waiting", "timeout caused pair closure", "Connection closed by peer", "Connection reset by peer",
              "Read error", "Socket Timeout", "Broken pipe")  # what gloo and the TCP store say  # fmt: skip


def default_store_address() -> tuple[str, int] | None:
    """``(host, port)`` of the TCP store behind torch's default group, or ``None`` (no group, or not a TCP store)."""
    try:
        store = dist.distributed_c10d._get_default_store()  # the store the group rendezvoused on, wherever it is
    except (RuntimeError, ValueError, AttributeError):
        return None
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return (store.host, store.port) if isinstance(store, dist.TCPStore) else None


def _client(host: str, port: int, timeout: float) -> dist.Store:
    store = dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=timeout), wait_for_workers=False)
    return dist.PrefixStore(_PREFIX, store)


#: This process's heartbeat connection to each store, reused by every :class:`Heartbeat` (one per strategy setup: a
#: script or test with many Trainers starts many). Each new TCP store connection costs both ends a reverse DNS lookup of
#: the peer (torch names it in its logs), and a slow resolver turns that into seconds: on the build machine every 25th
#: lookup of 127.0.0.1 waited out the resolver's 5 s timeout, 15 of a 19 s conformance column. Keyed by process id:
#: a forked child never shares its parent's socket. TCP store clients serialize their own requests across threads.
_SHARED: dict[tuple[int, str, int], dist.Store] = {}


def _shared_client(host: str, port: int, rank: int, timeout: float) -> dist.Store:
    """The shared connection to ``host:port``, after adding 1 to ``rank``'s counter through it; a connection whose
    store has gone (a job before, on the same address) is replaced by a new one."""
    key = (os.getpid(), host, port)
    store = _SHARED.get(key)
    if store is not None:
        try:
            store.add(str(rank), 1)
            return store
        except Exception:  # noqa: BLE001  (that store is gone: connect again below)
            _SHARED.pop(key, None)
    store = _client(host, port, timeout)  # raises if the store cannot be reached now
    store.add(str(rank), 1)
    _SHARED[key] = store
    return store


class Heartbeat:
    """A daemon thread adding 1 to ``pdist/heartbeat/{rank}`` in the store at ``host:port`` every ``period`` s.

    It stops at :meth:`stop`, or silently at the first store error (the store's host has gone: the job is ending).
    """

    def __init__(self, host: str, port: int, rank: int, period: float = 2.0, timeout: float = 10.0) -> None:
        self.host, self.port, self.rank, self.period = host, port, rank, period
        self._store = self.store_connection = _shared_client(host, port, rank, timeout)  # raises if unreachable now
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"pdist-heartbeat-{rank}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self._store.add(str(self.rank), 1)
            except Exception:  # noqa: BLE001  (the store is gone: the job is ending; nothing to report from here)
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.period + 1.0)
        self._store = None


def silent_ranks(host: str, port: int, world_size: int, wait: float = 5.0, timeout: float = 5.0) -> list[int]:
    """Ranks whose heartbeat did not move in ``wait`` seconds (``wait`` should exceed two heartbeat periods).

    Raises:
        RuntimeError: the store at ``host:port`` does not answer within ``timeout`` seconds.
    """
    store = _client(host, port, timeout)
    before = [store.add(str(r), 0) for r in range(world_size)]
    time.sleep(wait)
    after = [store.add(str(r), 0) for r in range(world_size)]
    return [r for r in range(world_size) if after[r] == before[r]]


def describe_silent_ranks(host: str, port: int, world_size: int, rank: int, wait: float = 5.0, timeout: float = 5.0) -> str:
    """One sentence naming the ranks that stopped beating (or saying that the store or every rank is alive)."""
    try:
        silent = [r for r in silent_ranks(host, port, world_size, wait, timeout) if r != rank]
    except Exception as err:  # noqa: BLE001  (a probe on the failure path never raises)
        return (f"the job's store at {host}:{port} does not answer ({type(err).__name__}: {str(err)[:120]}); the "
                "process that hosts it (global rank 0 under Lightning's launchers) is stopped, dead or unreachable")  # fmt: skip
    if not silent:
        return (f"every rank's heartbeat still advances (checked for {wait:g} s from rank {rank}): no rank is stopped "
                "or dead; one is hung in its own code (a deadlock, a long step, a different code path) or slow")  # fmt: skip
    listed = ", ".join(map(str, silent))
    verb = "has" if len(silent) == 1 else "have"
    return (f"rank{'s' if len(silent) > 1 else ''} {listed} {verb} sent no heartbeat for {wait:g} s (checked from "
            f"rank {rank}): stopped, dead, or cut off from {host}:{port}")  # fmt: skip


def looks_like_a_lost_peer(error: BaseException) -> bool:
    """Whether ``error`` is a collective that failed because another rank timed out or went away."""
    text = str(error)
    return isinstance(error, RuntimeError) and any(marker in text for marker in _LOST_PEER)
