"""Parameter-server processes: each holds one shard of the flat parameter vector and runs the optimizer on it.

A server is generic until rank 0 sends ``INIT`` (its shard, the optimizer's class name and param-group
hyperparameters, the mode); then it serves ``PUSH``/``PULL`` requests from every worker over the
framed-TCP protocol of :mod:`lightning_pdist.comm.ps_wire`. What the server *does* with gradients is
the pure rules of :mod:`lightning_pdist.algorithms.ps_rules`:

``sync``   :class:`BackupWorkerAggregator`: the mean of the first ``N - b`` gradients tagged with the open
           step is applied once (``b = 0``: all ``N``, plain synchronous SGD); late gradients are dropped by
           step id. A pull that waits for step ``t`` is answered once step ``t`` closed.
``async``  each push is one optimizer step on ``g / N`` on arrival (Downpour); pulls are answered at once.
``ssp``    as ``async``, but a worker's pull is answered only when :class:`SSPClock` lets it start its
           next clock (no active worker more than ``staleness`` clocks behind).

``g / N`` makes a learning rate mean the same per-sample step in every mode: ``N`` pushes of ``g_m / N``
move plain SGD exactly as far as one synchronous step on the mean (so ``ssp`` with ``staleness=0`` equals
``sync`` for SGD). ``delay_compensation = λ > 0`` (async/ssp) first turns ``g`` into DC-ASGD's
``g + λ·g⊙g⊙(w - w_bak(m))`` with the backup taken at worker ``m``'s last pull (:class:`DelayCompensation`).

The shard and its optimizers (one per user optimizer, rebuilt from class names and param groups; only
element-wise ones) are :class:`~lightning_pdist.comm.ps_shard.ParameterShard`. A push names the optimizer
that stepped and carries only the gradients its worker had (``present``); a sync step closes with the mean
over all ``N - b`` contributors (a missing gradient counts as zero) and leaves the pieces no contributor had
a gradient for out of the step (``grad = None``), as DDP with ``find_unused_parameters=True`` does. All
workers must step the same optimizers in the same order: a sync step opened by one optimizer refuses
another optimizer's gradient.

Lifetime: the server exits when rank 0 sends ``SHUTDOWN``; when no connection is left and at least one
worker had said ``HELLO`` (all workers gone); when its lifeline pipe to the process that started it reaches EOF (that process died,
however); or after ``idle_timeout`` seconds without any connection and no worker yet. It ignores ``SIGINT`` (Ctrl-C reaches
the whole process group; the workers' teardown or the lifeline ends the server in order).
"""

from __future__ import annotations

import ctypes
import os
import selectors
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from lightning_pdist.algorithms.ps_rules import (
    BackupWorkerAggregator,
    DelayCompensation,
    SSPClock,
    StalenessTracker,
)
from lightning_pdist.comm.ps_shard import ELEMENTWISE_OPTIMIZERS, ParameterShard, parse_present
from lightning_pdist.comm.ps_wire import (
    Kind,
    PeerClosed,
    address_allowed,
    bytes_to_tensor,
    dumps_state,
    loads_state,
    parse_networks,
    recv_message,
    send_message,
    tensor_bytes,
)

__all__ = [
    "ELEMENTWISE_OPTIMIZERS",
    "MODES",
    "STALENESS_BUCKETS",
    "ParameterShard",
    "ServerProcess",
    "ShardServer",
    "start_server",
]

MODES = ("sync", "async", "ssp")
STALENESS_BUCKETS = 16  # histogram bins 0..15, the last one also counts everything staler


@dataclass
class _Conn:
    sock: socket.socket
    peer: str
    worker: int | None = None


@dataclass
class _Pending:
    conn: _Conn
    worker: int
    wait_version: int | None
    record: bool
    ack: dict


class ShardServer:
    """The request loop of one server process (single-threaded: requests are applied in arrival order)."""

    def __init__(
        self,
        index: int,
        listener: socket.socket,
        lifeline: int | None = None,
        allowed_networks: str = "127.0.0.0/8",
        idle_timeout: float = 300.0,
        io_timeout: float = 300.0,
    ) -> None:
        self.index = index
        self.listener = listener
        self.lifeline = lifeline
        self.networks = parse_networks(allowed_networks)
        self.idle_timeout = idle_timeout
        self.io_timeout = io_timeout
        self.selector = selectors.DefaultSelector()
        self.conns: dict[int, _Conn] = {}
        self.registered: set[int] = set()  # workers that said HELLO
        self.stopping = False
        self.shard: ParameterShard | None = None
        self.config: dict[str, Any] = {}
        self.version = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.closed_bytes = (0, 0)  # sync: (bytes_in, bytes_out) when the last step closed
        self.histogram = [0] * STALENESS_BUCKETS
        self.pending: list[_Pending] = []
        self.gone: set[int] = set()  # workers whose connection closed (or said BYE)
        self.failed: str | None = None  # why sync training cannot continue
        self.steps_closed = False  # sync: the workers left can never close another step

    # ------------------------------------------------------------------ loop
    def serve(self) -> None:
        self.listener.setblocking(False)
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        if self.lifeline is not None:
            self.selector.register(self.lifeline, selectors.EVENT_READ, "lifeline")
        idle_since: float | None = time.monotonic()
        while not self.stopping:
            for key, _ in self.selector.select(timeout=1.0):
                if key.data == "accept":
                    self._accept()
                elif key.data == "lifeline":
                    return  # the process that started us is gone (or closed the pipe)
                else:
                    self._readable(key.data)
                if self.stopping:
                    break
            if self.conns:
                idle_since = None
            elif self.registered:
                return  # every worker that said HELLO has gone
            else:
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since > self.idle_timeout:
                    return  # nobody came (or only admin connections, long gone)

    def _accept(self) -> None:
        try:
            sock, addr = self.listener.accept()
        except BlockingIOError:
            return
        if not address_allowed(addr[0], self.networks):
            print(f"pdist parameter server {self.index}: refused a connection from {addr[0]} (outside "
                  f"{', '.join(map(str, self.networks))})", file=sys.stderr, flush=True)  # fmt: skip
            sock.close()
            return
        sock.setblocking(True)
        sock.settimeout(self.io_timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Conn(sock, f"{addr[0]}:{addr[1]}")
        self.conns[sock.fileno()] = conn
        self.selector.register(sock, selectors.EVENT_READ, conn)

    def _close(self, conn: _Conn) -> None:
        fd = conn.sock.fileno()
        if fd in self.conns:
            self.selector.unregister(conn.sock)
            del self.conns[fd]
        conn.sock.close()
        self.pending = [p for p in self.pending if p.conn is not conn]
        if conn.worker is not None:
            self._worker_gone(conn.worker, "disconnected")

    def _readable(self, conn: _Conn) -> None:
        try:
            kind, meta, payload, nbytes = recv_message(conn.sock)
        except (PeerClosed, OSError, ValueError):
            self._close(conn)
            return
        self.bytes_in += nbytes
        try:
            self._handle(conn, kind, meta, payload)
        except Exception as err:  # a bad request fails that request, not the server
            self._reply(conn, Kind.ERROR, {"message": f"{type(err).__name__}: {err}"})
        self._serve_pending()

    def _reply(self, conn: _Conn, kind: Kind, meta: dict, payload: Any = None) -> None:
        try:
            self.bytes_out += send_message(conn.sock, kind, meta, payload)
        except OSError:
            self._close(conn)

    # ------------------------------------------------------------------ requests
    def _handle(self, conn: _Conn, kind: Kind, meta: dict, payload: bytearray) -> None:
        if kind == Kind.INIT:
            self._init(meta, payload)
            self._reply(conn, Kind.REPLY, {"server": self.index, "numel": self.shard.flat.numel()})
        elif kind == Kind.SHUTDOWN:
            self._reply(conn, Kind.REPLY, {})
            self.stopping = True
        elif kind == Kind.BYE:
            if conn.worker is not None:
                self._worker_gone(conn.worker, "finished")
        elif self.shard is None:
            raise RuntimeError(f"parameter server {self.index} got {kind.name} before INIT")
        elif kind == Kind.HELLO:
            worker = int(meta["worker"])
            if not 0 <= worker < self.config["num_workers"]:
                raise ValueError(f"worker {worker} outside [0, {self.config['num_workers']})")
            conn.worker = worker
            self.registered.add(worker)
            self._reply(conn, Kind.REPLY, {"version": self.version, **self._stats()})
        elif kind == Kind.GET_STATE:
            self._reply(conn, Kind.REPLY, {}, dumps_state(self.state_dict()))
        elif kind == Kind.SET_STATE:
            self.load_state_dict(loads_state(payload))
            self._reply(conn, Kind.REPLY, {"version": self.version})
        elif kind in (Kind.PUSH, Kind.PUSHPULL, Kind.PULL):
            worker = self._worker_of(conn, meta)
            ack = self._push(worker, meta, payload) if kind != Kind.PULL else {}
            if kind == Kind.PUSH:
                self._reply(conn, Kind.REPLY, {**ack, **self._stats()})
            else:
                wait = meta.get("wait_version")
                if kind == Kind.PUSHPULL and self.config["mode"] == "sync" and wait is None:
                    wait = int(meta["version"]) + 1  # answered once the step this gradient belongs to closed
                self.pending.append(_Pending(conn, worker, wait, bool(meta.get("record", True)), ack))
        else:
            raise ValueError(f"unexpected message kind {kind.name}")

    def _worker_of(self, conn: _Conn, meta: dict) -> int:
        if conn.worker is None:
            raise RuntimeError("send HELLO before PUSH/PULL")
        return conn.worker

    def _init(self, meta: dict, payload: bytearray) -> None:
        mode = meta["mode"]
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} must be one of {MODES}")
        num_workers = int(meta["num_workers"])
        values = bytes_to_tensor(payload, meta["dtype"]).clone()
        optimizers = meta.get("optimizers") or [{"name": meta["optimizer"], "param_groups": meta["param_groups"]}]
        self.shard = ParameterShard(values, meta["segments"], optimizers)
        self.open_step: tuple[int, list[bool]] | None = None  # sync: (optimizer, present) of the open step
        self.config = dict(meta)
        self.version = 0
        self.aggregator = BackupWorkerAggregator(num_workers, int(meta.get("backup_workers", 0))) if mode == "sync" else None
        self.clock = SSPClock(num_workers, int(meta.get("staleness", 0))) if mode == "ssp" else None
        self.tracker = StalenessTracker(num_workers)
        lam = float(meta.get("delay_compensation", 0.0))
        self.dc = DelayCompensation.starting_from(self.shard.flat, num_workers, lam) if lam > 0 else None

    def _push(self, worker: int, meta: dict, payload: bytearray) -> dict:
        if self.failed:
            raise RuntimeError(self.failed)
        k = int(meta.get("optimizer", 0))
        present = parse_present(meta.get("present"), len(self.shard.pieces[k]) if 0 <= k < len(self.shard.pieces) else 0)
        grad = self.shard.expand(bytes_to_tensor(payload, self.config["dtype"]), k, present)
        self.shard.set_hparams(meta.get("hparams"), k)
        if self.aggregator is not None and self.steps_closed:  # the others finished: nobody can close a step
            self.aggregator.num_dropped += 1
            return {"accepted": False, "staleness": 0, "contributors": []}
        if self.aggregator is not None:  # sync (with or without backup workers)
            version = int(meta["version"])
            if version == self.aggregator.step and self.open_step is not None and self.open_step[0] != k:
                raise ValueError(
                    f"worker {worker} pushed a gradient of optimizer {k} for step {version}, which optimizer "
                    f"{self.open_step[0]} opened; every worker must step the same optimizers in the same order"
                )
            dropped_before = self.aggregator.num_dropped
            mean = self.aggregator.push(worker, version, grad)
            accepted = self.aggregator.num_dropped == dropped_before
            if accepted:  # a piece takes part in the step if any contributor had a gradient for it
                seen = self.open_step[1] if self.open_step is not None else [False] * len(present)
                self.open_step = (k, [a or b for a, b in zip(seen, present)])
            if mean is not None:
                self.shard.apply_(mean, k, self.open_step[1])
                self.open_step = None
                self.version += 1
                # Every reply of the previous step went out before this step's last push could arrive, and
                # no reply of this step has: the counters now differ from the last close by exactly one step.
                self.closed_bytes = (self.bytes_in, self.bytes_out)
            return {"accepted": accepted, "staleness": 0, "contributors": list(self.aggregator.last_contributors)}
        if self.dc is not None:
            grad = self.dc.compensate(worker, grad, self.shard.flat)
        tau = self.tracker.record_apply(worker)
        self.histogram[min(tau, STALENESS_BUCKETS - 1)] += 1
        self.shard.apply_(grad / self.config["num_workers"], k, present)
        self.version += 1
        if self.clock is not None:
            self.clock.advance(worker)
        return {"accepted": True, "staleness": tau}

    def _ready(self, pending: _Pending) -> bool:
        if self.clock is not None:
            return pending.worker in self.clock.retired or self.clock.may_start(pending.worker)
        if self.steps_closed:
            return True
        return pending.wait_version is None or self.version >= pending.wait_version

    def _serve_pending(self) -> None:
        progress = True
        while progress:  # answering can change nothing, but a failure below answers everyone
            progress = False
            for pending in list(self.pending):
                if self.failed and not self._ready(pending):
                    self.pending.remove(pending)
                    self._reply(pending.conn, Kind.ERROR, {"message": self.failed})
                    continue
                if not self._ready(pending):
                    continue
                self.pending.remove(pending)
                if pending.record:
                    self.tracker.record_pull(pending.worker)
                    if self.dc is not None:
                        self.dc.record_pull(pending.worker, self.shard.flat)
                meta = {**pending.ack, "version": self.version, "dtype": self.config["dtype"], **self._stats()}
                self._reply(pending.conn, Kind.REPLY, meta, tensor_bytes(self.shard.flat))

    def _stats(self) -> dict:
        stats = {"bytes_in": self.bytes_in, "bytes_out": self.bytes_out}
        if self.config.get("mode") == "sync":
            stats["step_bytes_in"], stats["step_bytes_out"] = self.closed_bytes
        else:
            stats["histogram"] = list(self.histogram)
        return stats

    def _worker_gone(self, worker: int, how: str) -> None:
        if worker in self.gone or self.shard is None:
            return
        self.gone.add(worker)
        if self.clock is not None and worker not in self.clock.retired:
            self.clock.retire(worker)
        if self.aggregator is not None and how == "finished":
            # Backup workers: a straggler's last gradient may open a step the finished workers will never
            # complete. Once nobody left can reach the quorum, drop that step's gradients and answer its pulls.
            unfinished = {w for w in range(self.config["num_workers"]) if w not in self.gone}
            if len(set(self.aggregator.arrived) | unfinished) < self.aggregator.quorum:
                dropped = self.aggregator.num_dropped + len(self.aggregator.arrived)
                self.aggregator.load_state_dict({"step": self.aggregator.step, "num_dropped": dropped})
                self.steps_closed = True
        if self.aggregator is not None and how == "disconnected":
            live = self.config["num_workers"] - len(self.gone)
            if live < self.aggregator.quorum:
                self.failed = (
                    f"parameter server {self.index}: worker {worker} {how} and mode='sync' needs "
                    f"{self.aggregator.quorum} of {self.config['num_workers']} workers per step "
                    f"(backup_workers={self.aggregator.backup_workers}); {live} remain"
                )
        self._serve_pending()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {
            "server": self.index,
            "version": self.version,
            "shard": self.shard.state_dict(),
            "aggregator": self.aggregator.state_dict() if self.aggregator is not None else None,
            "clock": self.clock.state_dict() if self.clock is not None else None,
            "tracker": self.tracker.state_dict(),
            "dc": self.dc.state_dict() if self.dc is not None else None,
            "histogram": list(self.histogram),
        }

    def load_state_dict(self, state: dict) -> None:
        self.shard.load_state_dict(state["shard"])
        self.version = int(state["version"])
        self.open_step = None
        if self.aggregator is not None and state.get("aggregator") is not None:
            self.aggregator.load_state_dict(state["aggregator"])
        if self.clock is not None and state.get("clock") is not None:
            clock = state["clock"]
            # every worker of the resumed run is live again, at the clock it had
            self.clock.load_state_dict({**clock, "retired": []})
        self.tracker.load_state_dict(state["tracker"])
        if self.dc is not None and state.get("dc") is not None:
            self.dc.load_state_dict(state["dc"])
        self.histogram = [int(c) for c in state.get("histogram", self.histogram)]


# ---------------------------------------------------------------------- processes


@dataclass
class ServerProcess:
    """A forked server process, seen from the process that started it."""

    index: int
    pid: int
    host: str
    port: int
    lifeline: int  # write end of the pipe whose EOF tells the server its parent is gone

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def poll(self) -> int | None:
        """The exit status if the process has exited (and reap it), else ``None``."""
        if self.pid <= 0:
            return 0
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            return 0
        if pid == 0:
            return None
        self.pid = -self.pid
        return os.waitstatus_to_exitcode(status)

    def join(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while True:
            code = self.poll()
            if code is not None or time.monotonic() >= deadline:
                return code
            time.sleep(0.02)

    def close_lifeline(self) -> None:
        if self.lifeline >= 0:
            os.close(self.lifeline)
            self.lifeline = -1

    def stop(self, timeout: float = 10.0) -> int:
        """Close the lifeline, wait up to ``timeout`` s, then SIGKILL; always reaps the process."""
        self.close_lifeline()
        code = self.join(timeout)
        if code is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            code = self.join(timeout)
        return code if code is not None else -signal.SIGKILL


def _set_process_name(name: str) -> None:
    try:  # /proc/<pid>/comm shows it; tests look for leftover "pdist-ps*" processes
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except Exception:
        pass


def _close_inherited_fds(keep: set[int]) -> None:
    # A forked server must not hold copies of its parent's sockets (gloo, the TCP store, the launcher's
    # pipes): while it did, a dead parent's peers would never see EOF.
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        fds = list(range(3, 1024))
    for fd in fds:
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def start_server(
    index: int,
    host: str = "127.0.0.1",
    port: int = 0,
    allowed_networks: str = "127.0.0.0/8",
    idle_timeout: float = 300.0,
    io_timeout: float = 300.0,
) -> ServerProcess:
    """Fork a server process bound to ``host:port`` (``port=0``: any free port) and return its handle.

    The socket is bound here, before the fork, so a bad address fails in the caller and the port is
    known (and accepting) before this returns. Call it before creating other sockets if possible; the
    child closes every inherited descriptor except its own anyway.
    """
    parse_networks(allowed_networks)  # fail here, not in the child
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, port), family=family, backlog=128)
    bound_host, bound_port = listener.getsockname()[:2]
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:
            os.close(write_end)
            _close_inherited_fds({listener.fileno(), read_end})
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            _set_process_name(f"pdist-ps{index}")
            torch.set_num_threads(1)
            ShardServer(index, listener, read_end, allowed_networks, idle_timeout, io_timeout).serve()
            code = 0
        except BaseException:  # noqa: BLE001  (report anything, then leave without running the parent's atexit)
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(read_end)
    listener.close()
    return ServerProcess(index=index, pid=pid, host=bound_host, port=bound_port, lifeline=write_end)


def main(argv: list[str] | None = None) -> None:
    """Run one server in the foreground (multi-node: start one per server host, pass their addresses).

    ``python -m lightning_pdist.comm.ps_server --index 0 --host 0.0.0.0 --port 29600 --allowed-networks 10.1.0.0/16``
    """
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--allowed-networks", default="127.0.0.0/8")
    parser.add_argument("--idle-timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    parse_networks(args.allowed_networks)
    listener = socket.create_server((args.host, args.port), backlog=128)
    print(f"pdist parameter server {args.index} listening on {listener.getsockname()[0]}:{listener.getsockname()[1]}", flush=True)
    torch.set_num_threads(1)
    ShardServer(args.index, listener, None, args.allowed_networks, args.idle_timeout).serve()


if __name__ == "__main__":
    main()
