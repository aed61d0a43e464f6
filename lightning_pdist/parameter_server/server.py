"""Parameter-server processes: each holds one shard of the flat parameter vector and runs the optimizer on it.

A server is generic until rank 0 sends ``INIT`` (its shard, the optimizer's class name and param-group
hyperparameters, the mode); then it serves ``PUSH``/``PULL`` requests from every worker over the
framed-TCP protocol of :mod:`lightning_pdist.parameter_server.wire`. What the server *does* with gradients is
the pure rules of :mod:`lightning_pdist.parameter_server.rules`:

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
element-wise ones) are :class:`~lightning_pdist.parameter_server.shard.ParameterShard`. A push names the optimizer
that stepped and carries only the gradients its worker had (``present``); a sync step closes with the mean
over all ``N - b`` contributors (a missing gradient counts as zero) and leaves the pieces no contributor had
a gradient for out of the step (``grad = None``), as DDP with ``find_unused_parameters=True`` does. All
workers must step the same optimizers in the same order: a sync step opened by one optimizer refuses
another optimizer's gradient.

Hostile and broken peers (``docs/algorithms/parameter_server.md``): the loop is single-threaded over non-blocking
sockets with the standard library's ``selectors``; each connection is a small state machine (a bounded
:class:`~lightning_pdist.parameter_server.wire.FrameReader`, one request in flight, a queue of unsent reply bytes) under
the deadlines of :class:`ServerLimits` (a whole request, a whole reply, the first request), and the number of
connections is bounded. A server given a shared secret (``start_server(secret=...)``, ``--secret-file``) first
authenticates every connection with :mod:`~lightning_pdist.parameter_server.auth`'s challenge: until the peer has
proven it holds the secret, its reader takes nothing but a 32-byte ``AUTH`` (any other header is refused before
its metadata is read), and a wrong proof or any other message closes the connection, logged. Requests are
checked field by field before they touch any state (:class:`RequestRefused` names the field, the value and the
rule), and any exception while serving one connection closes that connection and is logged. Why ``selectors`` and not pyzmq or asyncio: requests must be
applied one at a time in arrival order, which one thread gives without locks; the loop must see each peer's
own connection (its EOF is how a dead worker is named at once) and bound each message by its kind and by this
server's shard *before* allocating, while ZeroMQ hands over whole messages after buffering them (its only
bound, ``ZMQ_MAXMSGSIZE``, is one size for all kinds) and reports disconnects only through a monitor socket;
and it adds a compiled dependency for what about 300 lines of standard library do. ``asyncio`` would serve as
well, but the optimizer steps are synchronous compute in the loop either way, so it would add a framework
and nothing else.

Lifetime: the server exits when the worker that started it (a node's local rank 0) sends ``SHUTDOWN``; when no connection is left and at least one
worker had said ``HELLO`` (all workers gone); when its lifeline pipe to the process that started it reaches EOF (that process died,
however); or after ``idle_timeout`` seconds without any connection and no worker yet. It ignores ``SIGINT`` (Ctrl-C reaches
the whole process group; the workers' teardown or the lifeline ends the server in order).
"""

from __future__ import annotations

import copy
import ctypes
import math
import os
import selectors
import signal
import socket
import sys
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_pdist.parameter_server.rules import (
    BackupWorkerAggregator,
    DelayCompensation,
    SSPClock,
    StalenessTracker,
)
from lightning_pdist.core.forking import fork_process
from lightning_pdist.parameter_server.auth import (
    CLIENT_LABEL,
    NONCE_BYTES,
    PROOF_BYTES,
    SERVER_LABEL,
    check_secret,
    new_nonce,
    proof,
    read_secret_file,
    verify,
)
from lightning_pdist.parameter_server.shard import ELEMENTWISE_OPTIMIZERS, ParameterShard, parse_present
from lightning_pdist.parameter_server.wire import (
    FrameError,
    FrameReader,
    Kind,
    PeerClosed,
    address_allowed,
    bytes_to_tensor,
    dumps_state,
    encode_message,
    loads_state,
    parse_networks,
    tensor_bytes,
)

__all__ = [
    "ELEMENTWISE_OPTIMIZERS",
    "MODES",
    "STALENESS_BUCKETS",
    "ParameterShard",
    "RequestRefused",
    "ServerLimits",
    "ServerProcess",
    "ShardServer",
    "start_server",
]

MODES = ("sync", "async", "ssp")
STALENESS_BUCKETS = 16  # histogram bins 0..15, the last one also counts everything staler
DTYPES = ("torch.float32", "torch.float64", "torch.float16", "torch.bfloat16")
MAX_WORKERS = 1 << 16  # per-worker bookkeeping is allocated from INIT's num_workers: bound it
MAX_PATIENCE = 1e7  # seconds a waiting request may ask the server to wait before naming the workers it waits for
MAX_HOST_CHARS = 255  # a HELLO's host name (DNS names are at most 253 characters)
_MISSING = object()


@dataclass(frozen=True)
class ServerLimits:
    """What one peer may cost a server (``docs/algorithms/parameter_server.md``, hostile and broken peers).

    Args:
        max_connections: connections held at once (at least ``2 * num_workers + 8`` once INIT said how many
            workers there are). At the limit the oldest connection that has not yet completed a request is
            dropped for the newcomer; if there is none, the newcomer is closed at once. Both are logged.
        message_timeout: seconds a request may take to arrive whole, from its first byte (not per byte).
        reply_timeout: seconds a peer may take to read a whole reply; a peer that stops reading is dropped.
        handshake_timeout: seconds a connection may stay open without completing one request (INIT,
            HELLO, ...); a silent or half-open connection is dropped after it.
        max_init_bytes: the largest shard an ``INIT`` may carry. Buffers grow with the bytes that arrive,
            so a declared size costs nothing until it is sent.
    """

    max_connections: int = 512
    message_timeout: float = 300.0
    reply_timeout: float = 300.0
    handshake_timeout: float = 300.0
    max_init_bytes: int = 1 << 36

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_init_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ServerLimits({name}={value!r}): {name} must be an int >= 1")
        for name in ("message_timeout", "reply_timeout", "handshake_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"ServerLimits({name}={value!r}): {name} must be a finite number of seconds > 0")

    @classmethod
    def from_io_timeout(cls, io_timeout: float, **overrides: Any) -> ServerLimits:
        """Every deadline equal to ``io_timeout`` (what ``server_timeout`` means for a worker), then ``overrides``."""
        return cls(**{"message_timeout": io_timeout, "reply_timeout": io_timeout, "handshake_timeout": io_timeout, **overrides})


class RequestRefused(ValueError):
    """A request's values break a rule; the reply names the field, the value and the rule. Nothing changed."""


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _secs(seconds: float) -> str:
    return f"{seconds:.1f}" if seconds < 10 else f"{seconds:.0f}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _field(meta: dict, name: str, kind: str, rule: str, check: Any, default: Any = _MISSING) -> Any:
    """``meta[name]`` if ``check(value)``; otherwise refuse, naming the field, the value and the rule."""
    if name not in meta and default is not _MISSING:
        return default
    value = meta.get(name, _MISSING)
    if value is _MISSING:
        raise RequestRefused(f"{kind}: field {name!r} is missing; {name} must be {rule}")
    if not check(value):
        raise RequestRefused(f"{kind}: {name}={_show(value)}: {name} must be {rule}")
    return value


def _check_group_values(where: str, group: Any) -> None:
    """INIT param groups: a JSON object whose numbers are finite (torch checks the rest when it builds the optimizer)."""
    if not isinstance(group, dict):
        raise RequestRefused(f"INIT: {where}={_show(group)}: a param group must be an object of hyperparameters")
    for key, value in group.items():
        if key == "params":
            raise RequestRefused(f"INIT: {where}['params']: param groups carry hyperparameters only")
        numbers = value if isinstance(value, list) else [value]
        if any(isinstance(v, (int, float)) and not isinstance(v, bool) and not _is_finite_number(v) for v in numbers):
            raise RequestRefused(f"INIT: {where}[{key!r}]={_show(value)}: numbers must be finite")
        if key == "lr" and not _is_finite_number(value):
            raise RequestRefused(f"INIT: {where}['lr']={_show(value)}: lr must be a finite number")


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    peer: str
    opened: float
    reader: FrameReader
    worker: int | None = None
    nonce: bytes | None = None  # the challenge sent; None once authenticated (or on a server without a secret)
    known: bool = False  # completed a request: no handshake deadline, not evicted at the connection limit
    inbox: deque = field(default_factory=deque)  # complete requests not yet handled (at most one)
    out: deque = field(default_factory=deque)  # memoryviews of reply bytes not yet sent
    pending: bool = False  # a PULL/PUSHPULL waits for its version
    message_deadline: float | None = None
    reply_deadline: float | None = None
    closing: bool = False  # close once the replies are out (after a protocol error)
    drain_deadline: float | None = None  # closing: our side is shut, discard what the peer still sends
    events: int = 0
    closed: bool = False

    @property
    def busy(self) -> bool:
        return self.pending or bool(self.out) or self.closing

    def name(self) -> str:
        return f"{self.peer}{f' (worker {self.worker})' if self.worker is not None else ''}"


@dataclass
class _Pending:
    conn: _Conn
    worker: int
    wait_version: int | None
    record: bool
    ack: dict
    since: float = 0.0  # when the request started waiting (monotonic)
    patience: float | None = None  # the worker's own timeout: answer by then, naming the workers we wait for


class ShardServer:
    """The request loop of one server process (single-threaded: requests are applied in arrival order).

    Every connection is a non-blocking socket with its own :class:`~lightning_pdist.parameter_server.wire.FrameReader`
    and output queue, so no peer can hold the loop: a partial message waits in its reader, an unread reply
    in its queue, each under a deadline of :class:`ServerLimits`. An exception while serving one connection
    closes that connection and is logged; a request with bad values gets an ``ERROR`` reply and changes nothing.
    """

    def __init__(
        self,
        index: int,
        listener: socket.socket,
        lifeline: int | None = None,
        allowed_networks: str = "127.0.0.0/8",
        idle_timeout: float = 300.0,
        io_timeout: float = 300.0,
        limits: ServerLimits | None = None,
        secret: bytes | None = None,
    ) -> None:
        self.index = index
        self.secret = check_secret(secret, f"ShardServer(index={index})")
        self.listener = listener
        self.lifeline = lifeline
        self.networks = parse_networks(allowed_networks)
        self.idle_timeout = idle_timeout
        self.limits = limits if limits is not None else ServerLimits.from_io_timeout(io_timeout)
        self.selector = selectors.DefaultSelector()
        self.conns: dict[int, _Conn] = {}
        self.live: dict[int, int] = {}  # worker -> open connections that said HELLO as it
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
        self.aggregator: BackupWorkerAggregator | None = None
        self.clock: SSPClock | None = None
        self.dc: DelayCompensation | None = None
        self.open_step: tuple[int, list[bool]] | None = None  # sync: (optimizer, present) of the open step
        self._revisit: list[_Conn] = []  # connections whose queued request may now be handled
        self.peers: dict[int, str] = {}  # worker -> "pid P on host H, connected from A" (its last HELLO)
        self.last_heard: dict[int, float] = {}  # worker -> when its last push or pull arrived (monotonic)
        self._log_times: dict[str, tuple[float, int]] = {}  # rate limit per kind of log line

    # ------------------------------------------------------------------ logging
    def _log(self, message: str, key: str | None = None) -> None:
        """One line on stderr; lines with a ``key`` at most once per 5 s (the rest counted)."""
        if key is not None:
            now = time.monotonic()
            last, suppressed = self._log_times.get(key, (-math.inf, 0))
            if now - last < 5.0:
                self._log_times[key] = (last, suppressed + 1)
                return
            self._log_times[key] = (now, 0)
            if suppressed:
                message += f" ({suppressed} more like this in the last {now - last:.0f} s)"
        try:  # fd 2 itself: sys.stderr may wrap a descriptor the fork closed; logging must never raise
            os.write(2, f"pdist parameter server {self.index}: {message}\n".encode(errors="replace"))
        except OSError:
            pass

    # ------------------------------------------------------------------ loop
    def serve(self) -> None:
        self.listener.setblocking(False)
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        if self.lifeline is not None:
            self.selector.register(self.lifeline, selectors.EVENT_READ, "lifeline")
        idle_since: float | None = time.monotonic()
        try:
            while not self.stopping:
                for key, mask in self.selector.select(timeout=self._next_timeout()):
                    if key.data == "accept":
                        self._survive(self._accept)
                    elif key.data == "lifeline":
                        return  # the process that started us is gone (or closed the pipe)
                    elif not key.data.closed:
                        self._guard(key.data, self._on_event, key.data, mask)
                    self._handle_revisits()
                    if self.stopping:
                        break
                self._survive(self._expire, time.monotonic())
                if self.conns:
                    idle_since = None
                elif self.registered:
                    return  # every worker that said HELLO has gone
                else:
                    idle_since = idle_since or time.monotonic()
                    if time.monotonic() - idle_since > self.idle_timeout:
                        return  # nobody came (or only admin connections, long gone)
        finally:
            self._flush_before_exit()

    def _guard(self, conn: _Conn, fn: Any, *args: Any) -> None:
        """Run ``fn``; any exception closes ``conn`` (logged), never the server."""
        try:
            fn(*args)
        except Exception as err:  # noqa: BLE001  (one bad peer never takes the server down)
            self._log(f"closing the connection from {conn.name()} after {type(err).__name__}: {str(err)[:300]}",
                      key=f"exception:{type(err).__name__}")  # fmt: skip
            try:
                self._close(conn)
            except Exception as close_err:  # noqa: BLE001
                self._log(f"closing {conn.name()} failed too ({type(close_err).__name__}: {close_err})")

    def _survive(self, fn: Any, *args: Any) -> None:
        """Run loop bookkeeping (accept, deadlines); an exception there is logged, never fatal."""
        try:
            fn(*args)
        except Exception as err:  # noqa: BLE001
            self._log(f"{fn.__name__} failed ({type(err).__name__}: {str(err)[:300]})", key=f"survive:{fn.__name__}")

    def _handle_revisits(self) -> None:
        while self._revisit:
            conn = self._revisit.pop()
            if not conn.closed:
                self._guard(conn, self._process, conn)

    def _next_timeout(self) -> float:
        now = time.monotonic()
        soonest = now_plus = now + 1.0
        for conn in self.conns.values():
            for deadline in (conn.message_deadline, conn.reply_deadline, conn.drain_deadline):
                if deadline is not None and deadline < soonest:
                    soonest = deadline
            if not conn.known and conn.opened + self.limits.handshake_timeout < soonest:
                soonest = conn.opened + self.limits.handshake_timeout
        for pending in self.pending:
            if pending.patience is not None and pending.since + pending.patience < soonest:
                soonest = pending.since + pending.patience
        return max(0.0, min(soonest, now_plus) - now)

    def _expire(self, now: float) -> None:
        limits = self.limits
        for conn in list(self.conns.values()):
            if conn.drain_deadline is not None and now >= conn.drain_deadline:
                self._close(conn)
            elif conn.message_deadline is not None and now >= conn.message_deadline:
                self._close(conn, f"a request did not arrive whole within message_timeout={limits.message_timeout:g} s")
            elif conn.reply_deadline is not None and now >= conn.reply_deadline:
                self._close(conn, f"did not read its reply within reply_timeout={limits.reply_timeout:g} s")
            elif not conn.known and not conn.busy and now >= conn.opened + limits.handshake_timeout:
                self._close(conn, f"completed no request within handshake_timeout={limits.handshake_timeout:g} s")
        for pending in list(self.pending):
            if pending.patience is not None and now >= pending.since + pending.patience and not pending.conn.closed:
                self._answer_stalled(pending, now)

    def _max_connections(self) -> int:
        num_workers = int(self.config.get("num_workers", 0))
        return max(self.limits.max_connections, 2 * num_workers + 8)

    def _accept(self) -> None:
        for _ in range(64):  # drain the backlog, a bounded batch at a time
            try:
                sock, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:  # EMFILE and the like: this connection, not the server
                self._log(f"accept failed ({err})", key="accept")
                return
            if not address_allowed(addr[0], self.networks):
                self._log(f"refused a connection from {addr[0]} (outside {', '.join(map(str, self.networks))})", key="network")
                sock.close()
                continue
            if len(self.conns) >= self._max_connections() and not self._evict_one():
                self._log(f"refused a connection from {addr[0]}:{addr[1]}: max_connections={self._max_connections()} "
                          "reached and every connection has completed a request", key="limit")  # fmt: skip
                sock.close()
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, f"{addr[0]}:{addr[1]}", time.monotonic(), FrameReader(self._payload_limit))
            self.conns[sock.fileno()] = conn
            if self.secret is not None:
                conn.nonce = new_nonce()
                conn.reader.payload_limit = self._auth_payload_limit
                self._reply(conn, Kind.CHALLENGE, {}, conn.nonce, count=False)
            self._set_events(conn)

    def _evict_one(self) -> bool:
        """At the connection limit: drop the oldest connection that has not completed a request."""
        strangers = [c for c in self.conns.values() if not c.known]
        if not strangers:
            return False
        oldest = min(strangers, key=lambda c: c.opened)
        self._close(oldest, f"dropped: max_connections={self._max_connections()} reached, and it is the oldest "
                            f"connection that has completed no request ({time.monotonic() - oldest.opened:.1f} s old)")  # fmt: skip
        return True

    def _auth_payload_limit(self, kind: Kind) -> int:
        """Before authentication: an ``AUTH`` proof and nothing else (refused on the header, before its metadata)."""
        if kind != Kind.AUTH:
            raise FrameError(f"{kind.name} before authenticating; the first message on a connection must be AUTH")
        return PROOF_BYTES

    def _authenticate(self, conn: _Conn, kind: Kind, meta: dict, payload: bytearray) -> None:
        """Check the peer's proof; answer with this server's proof of the peer's nonce, or close the connection."""
        nonce = meta.get("nonce")
        try:
            client_nonce = bytes.fromhex(nonce) if isinstance(nonce, str) else b""
        except ValueError:
            client_nonce = b""
        if kind != Kind.AUTH or len(client_nonce) != NONCE_BYTES or not verify(self.secret, conn.nonce, CLIENT_LABEL, payload):
            self._log(f"refused the connection from {conn.peer}: authentication failed (wrong secret, or not a "
                      "lightning_pdist worker)", key="auth")  # fmt: skip
            self._reply(conn, Kind.ERROR, {"message": f"parameter server {self.index}: authentication failed; the "
                                           "workers and the servers must share the same secret"}, count=False)  # fmt: skip
            self._shut(conn)
            return
        conn.nonce = None
        conn.reader.payload_limit = self._payload_limit
        self._reply(conn, Kind.REPLY, {"proof": proof(self.secret, client_nonce, SERVER_LABEL).hex()}, count=False)

    def _payload_limit(self, kind: Kind) -> int:
        """The most payload bytes a message of ``kind`` can legitimately carry to this server now."""
        if kind == Kind.INIT:
            return self.limits.max_init_bytes
        if self.shard is None:
            return 0
        shard_bytes = self.shard.flat.numel() * self.shard.flat.element_size()
        if kind in (Kind.PUSH, Kind.PUSHPULL):
            return shard_bytes
        if kind == Kind.SET_STATE:  # values, up to 3 optimizer moments, one DC backup per worker, and overhead
            return (int(self.config["num_workers"]) + 6) * shard_bytes + (64 << 20)
        return 0

    def _set_events(self, conn: _Conn) -> None:
        """Read unless a request is already queued (one in flight per connection); write while replies wait."""
        events = 0 if conn.inbox or (conn.closing and conn.drain_deadline is None) else selectors.EVENT_READ
        if conn.out:
            events |= selectors.EVENT_WRITE
        if events == conn.events:
            return
        if conn.events and events:
            self.selector.modify(conn.sock, events, conn)
        elif events:
            self.selector.register(conn.sock, events, conn)
        else:
            self.selector.unregister(conn.sock)
        conn.events = events

    def _close(self, conn: _Conn, reason: str | None = None) -> None:
        if conn.closed:
            return
        conn.closed = True
        if reason is not None:
            self._log(f"closing the connection from {conn.name()}: {reason}", key=f"close:{reason[:20]}")
        if conn.events:
            self.selector.unregister(conn.sock)
            conn.events = 0
        self.conns.pop(conn.sock.fileno(), None)
        conn.sock.close()
        conn.out.clear()
        conn.inbox.clear()
        self.pending = [p for p in self.pending if p.conn is not conn]
        if conn.worker is not None:
            self.live[conn.worker] -= 1
            if not self.live[conn.worker]:  # another connection that said HELLO as this worker is still up
                self._worker_gone(conn.worker, "disconnected")

    def _on_event(self, conn: _Conn, mask: int) -> None:
        if mask & selectors.EVENT_WRITE:
            self._flush(conn)
        if mask & selectors.EVENT_READ and not conn.closed:
            self._read(conn)

    def _read(self, conn: _Conn) -> None:
        if conn.drain_deadline is not None:  # closing: discard until EOF or the deadline
            try:
                if not conn.sock.recv(1 << 16):
                    self._close(conn)
            except BlockingIOError:
                pass
            except OSError:
                self._close(conn)
            return
        try:
            message = conn.reader.read(conn.sock)
        except BlockingIOError:
            return
        except (PeerClosed, ConnectionError):
            self._close(conn)
            return
        except FrameError as err:
            before_init = " (nothing but INIT is accepted before INIT)" if self.shard is None and conn.nonce is None else ""
            self._log(f"refused a message from {conn.name()}: {err}{before_init}", key="frame")
            self._reply(conn, Kind.ERROR, {"message": f"parameter server {self.index}: {err}{before_init}; closing the connection"},
                        count=conn.nonce is None)  # a stranger's refusals are not training traffic  # fmt: skip
            self._shut(conn)
            return
        if message is None:
            if conn.reader.started and conn.message_deadline is None:
                conn.message_deadline = time.monotonic() + self.limits.message_timeout
            return
        conn.message_deadline = None
        if conn.nonce is not None:  # not yet authenticated: nothing reaches the request handlers
            self._authenticate(conn, *message[:3])
            if not conn.closed:
                self._set_events(conn)
            return
        self.bytes_in += message[3]
        conn.inbox.append(message)
        self._process(conn)

    def _process(self, conn: _Conn) -> None:
        while conn.inbox and not conn.busy and not conn.closed:
            kind, meta, payload, _ = conn.inbox.popleft()
            try:
                self._handle(conn, kind, meta, payload)
                conn.known = True
            except Exception as err:  # noqa: BLE001  (a bad request fails that request, not the server)
                if not isinstance(err, RequestRefused):
                    self._log(f"refused {kind.name} from {conn.name()}: {type(err).__name__}: {str(err)[:300]}", key="refused")
                self._reply(conn, Kind.ERROR, {"message": f"{type(err).__name__}: {err}"})
            self._serve_pending()
        if not conn.closed:
            self._set_events(conn)

    def _shut(self, conn: _Conn) -> None:
        """Close after a protocol error, once the error reply is out (lingering so the peer can read it)."""
        conn.closing = True
        conn.inbox.clear()
        if not conn.out:
            self._start_drain(conn)
        self._set_events(conn)

    def _start_drain(self, conn: _Conn) -> None:
        # Closing a socket with unread input resets it, which can destroy the error reply in flight: shut our
        # side, then discard what the peer still sends, for 5 s at most.
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._close(conn)
            return
        conn.drain_deadline = time.monotonic() + 5.0

    def _reply(self, conn: _Conn, kind: Kind, meta: dict, payload: Any = None, count: bool = True) -> None:
        """Queue a message and send what the socket takes; ``count=False``: a handshake, not training traffic."""
        if conn.closed:
            return
        head, body = encode_message(kind, meta, payload)
        if count:
            self.bytes_out += len(head) + body.nbytes
        conn.out.append(memoryview(head))
        if body.nbytes:
            conn.out.append(body)
        if conn.reply_deadline is None:
            conn.reply_deadline = time.monotonic() + self.limits.reply_timeout
        self._flush(conn)
        if conn.out and not conn.closed:  # what is left must not change with the shard: copy it
            conn.out = deque(v if v.readonly else memoryview(bytes(v)) for v in conn.out)

    def _flush(self, conn: _Conn) -> None:
        while conn.out:
            view = conn.out[0]
            try:
                sent = conn.sock.send(view)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._close(conn)
                return
            if sent < view.nbytes:
                conn.out[0] = view[sent:]
                break
            conn.out.popleft()
        if not conn.out:
            conn.reply_deadline = None
            if conn.closing:
                if conn.drain_deadline is None:
                    self._start_drain(conn)
            else:
                self._revisit.append(conn)
        if not conn.closed:
            self._set_events(conn)

    def _flush_before_exit(self) -> None:
        """Best effort, at most 2 s: the replies already queued (SHUTDOWN's) reach their peers."""
        deadline = time.monotonic() + 2.0
        for conn in list(self.conns.values()):
            if conn.out and not conn.closed:
                try:
                    conn.sock.setblocking(True)
                    for view in conn.out:
                        conn.sock.settimeout(max(0.01, deadline - time.monotonic()))
                        conn.sock.sendall(view)
                except OSError:
                    pass

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
        elif kind in (Kind.REPLY, Kind.ERROR):
            raise RequestRefused(f"{kind.name} is not a request")
        elif self.shard is None:
            raise RuntimeError(f"parameter server {self.index} got {kind.name} before INIT")
        elif kind == Kind.HELLO:
            n = self.config["num_workers"]
            worker = _field(meta, "worker", "HELLO", f"an int in [0, {n})", lambda v: _is_int(v) and 0 <= v < n)
            if conn.worker is not None and conn.worker != worker:
                raise RequestRefused(f"HELLO: worker={worker}: this connection already said HELLO as worker {conn.worker}")
            pid = _field(meta, "pid", "HELLO", "an int >= 1", lambda v: _is_int(v) and 1 <= v < 1 << 31, None)
            host = _field(meta, "host", "HELLO", f"a printable ASCII host name of 1 to {MAX_HOST_CHARS} characters",
                          lambda v: isinstance(v, str) and 0 < len(v) <= MAX_HOST_CHARS and v.isascii() and v.isprintable(),
                          None)  # fmt: skip
            if conn.worker is None:
                conn.worker = worker
                self.live[worker] = self.live.get(worker, 0) + 1
            self.registered.add(worker)
            who = [f"pid {pid}" if pid is not None else "", f"on host {host}" if host is not None else ""]
            self.peers[worker] = " ".join(w for w in who if w) + f"{', ' if pid or host else ''}connected from {conn.peer}"
            self.last_heard[worker] = time.monotonic()
            self._reply(conn, Kind.REPLY, {"version": self.version, **self._stats()})
        elif kind == Kind.GET_STATE:
            self._reply(conn, Kind.REPLY, {}, dumps_state(self.state_dict()))
        elif kind == Kind.SET_STATE:
            self.load_state_dict(loads_state(payload))
            self._reply(conn, Kind.REPLY, {"version": self.version})
        elif kind in (Kind.PUSH, Kind.PUSHPULL, Kind.PULL):
            worker = self._worker_of(conn, kind, meta)
            wait = _field(meta, "wait_version", kind.name, "null or an int >= 0", lambda v: v is None or (_is_int(v) and v >= 0), None)
            record = _field(meta, "record", kind.name, "true or false", lambda v: isinstance(v, bool), True)
            patience = _field(meta, "patience", kind.name, f"null or a number of seconds in (0, {MAX_PATIENCE:g}]",
                              lambda v: v is None or (_is_finite_number(v) and 0 < v <= MAX_PATIENCE), None)  # fmt: skip
            if kind == Kind.PULL and payload:
                raise RequestRefused(f"PULL: payload of {len(payload)} bytes: a PULL carries none")
            self.last_heard[worker] = time.monotonic()
            ack = self._push(worker, kind, meta, payload) if kind != Kind.PULL else {}
            if kind == Kind.PUSH:
                self._reply(conn, Kind.REPLY, {**ack, **self._stats()})
            else:
                if kind == Kind.PUSHPULL and self.config["mode"] == "sync" and wait is None:
                    wait = int(meta["version"]) + 1  # answered once the step this gradient belongs to closed
                conn.pending = True
                self.pending.append(_Pending(conn, worker, wait, record, ack, time.monotonic(), patience))
        else:
            raise RequestRefused(f"unexpected message kind {kind.name}")

    def _worker_of(self, conn: _Conn, kind: Kind, meta: dict) -> int:
        if conn.worker is None:
            raise RuntimeError("send HELLO before PUSH/PULL")
        if "worker" in meta and meta["worker"] != conn.worker:
            raise RequestRefused(f"{kind.name}: worker={_show(meta['worker'])}: this connection said HELLO as worker {conn.worker}")
        return conn.worker

    def _init(self, meta: dict, payload: bytearray) -> None:
        """Check every field, build everything, and only then replace the current state (a refused INIT changes nothing)."""
        mode = _field(meta, "mode", "INIT", f"one of {MODES}", lambda v: v in MODES)
        num_workers = _field(meta, "num_workers", "INIT", f"an int in [1, {MAX_WORKERS}]",
                             lambda v: _is_int(v) and 1 <= v <= MAX_WORKERS)  # fmt: skip
        dtype = _field(meta, "dtype", "INIT", f"one of {DTYPES}", lambda v: v in DTYPES)
        segments = _field(meta, "segments", "INIT", "a list of [optimizer, group, numel] (or [group, numel]) ints, numel >= 0",
                          lambda v: isinstance(v, list) and all(isinstance(s, list) and len(s) in (2, 3)
                                                                and all(_is_int(x) for x in s) and s[-1] >= 0 for s in v))  # fmt: skip
        if "optimizers" in meta:
            optimizers = _field(meta, "optimizers", "INIT", "a non-empty list of {'name': str, 'param_groups': [object, ...]}",
                                lambda v: isinstance(v, list) and v and all(
                                    isinstance(o, dict) and isinstance(o.get("name"), str)
                                    and isinstance(o.get("param_groups"), list) and o["param_groups"] for o in v))  # fmt: skip
        else:
            name = _field(meta, "optimizer", "INIT", "an optimizer class name", lambda v: isinstance(v, str))
            groups = _field(meta, "param_groups", "INIT", "a non-empty list of objects", lambda v: isinstance(v, list) and v)
            optimizers = [{"name": name, "param_groups": groups}]
        for k, optimizer in enumerate(optimizers):
            for g, group in enumerate(optimizer["param_groups"]):
                _check_group_values(f"optimizers[{k}].param_groups[{g}]", group)
        backup = _field(meta, "backup_workers", "INIT", "an int >= 0", lambda v: _is_int(v) and v >= 0, 0)
        staleness = _field(meta, "staleness", "INIT", "an int >= 0", lambda v: _is_int(v) and v >= 0, 0)
        lam = _field(meta, "delay_compensation", "INIT", "a finite number >= 0", lambda v: _is_finite_number(v) and v >= 0, 0.0)
        numel = sum(s[-1] for s in segments)
        itemsize = torch.empty(0, dtype=getattr(torch, dtype.removeprefix("torch."))).element_size()
        if len(payload) != numel * itemsize:
            raise RequestRefused(f"INIT: payload of {len(payload)} bytes; segments hold {numel} elements of {dtype}, "
                                 f"{numel * itemsize} bytes")  # fmt: skip
        values = bytes_to_tensor(payload, dtype).clone()
        if not torch.isfinite(values).all():
            raise RequestRefused("INIT: the initial shard holds non-finite values; they must be finite")
        shard = ParameterShard(values, segments, optimizers)
        aggregator = BackupWorkerAggregator(num_workers, backup) if mode == "sync" else None
        clock = SSPClock(num_workers, staleness) if mode == "ssp" else None
        tracker = StalenessTracker(num_workers)
        dc = DelayCompensation.starting_from(shard.flat, num_workers, float(lam)) if lam > 0 else None
        self.shard, self.aggregator, self.clock, self.tracker, self.dc = shard, aggregator, clock, tracker, dc
        self.open_step = None
        self.config = dict(meta)
        self.version = 0
        self.failed, self.steps_closed = None, False

    def _check_push(self, worker: int, kind: Kind, meta: dict, payload: bytearray) -> tuple[int, list[bool], Tensor, Any, int | None]:
        """``(optimizer, present, shard-sized gradient, hparams, version)`` of a push; refuses before anything changes."""
        name = kind.name
        count = len(self.shard.optimizers)
        k = _field(meta, "optimizer", name, f"an int in [0, {count})", lambda v: _is_int(v) and 0 <= v < count, 0)
        if self.aggregator is not None:
            version = _field(meta, "version", name, "an int >= 0", lambda v: _is_int(v) and v >= 0)
        else:
            version = _field(meta, "version", name, "an int >= 0", lambda v: _is_int(v) and v >= 0, None)
        dtype = self.config["dtype"]
        _field(meta, "dtype", name, f"{dtype!r}, the shard's dtype", lambda v: v == dtype, dtype)
        try:
            present = parse_present(meta.get("present"), len(self.shard.pieces[k]))
            grad = self.shard.expand(bytes_to_tensor(payload, dtype), k, present)
            hparams = meta.get("hparams")
            self.shard.check_hparams(hparams, k)
        except ValueError as err:
            raise RequestRefused(f"{name}: {err}") from None
        return k, present, grad, hparams, version

    def _push(self, worker: int, kind: Kind, meta: dict, payload: bytearray) -> dict:
        if self.failed:
            raise RuntimeError(self.failed)
        k, present, grad, hparams, version = self._check_push(worker, kind, meta, payload)
        if self.aggregator is not None and self.steps_closed:  # the others finished: nobody can close a step
            self.aggregator.num_dropped += 1
            return {"accepted": False, "staleness": 0, "contributors": []}
        if self.aggregator is not None:  # sync (with or without backup workers)
            if version == self.aggregator.step and self.open_step is not None and self.open_step[0] != k:
                # The step cannot close: fail its waiters with the reason, not with the disconnect that follows.
                self.failed = (
                    f"parameter server {self.index}: worker {worker} pushed a gradient of optimizer {k} for step "
                    f"{version}, which optimizer {self.open_step[0]} opened; every worker must step the same "
                    f"optimizers in the same order"
                )
                raise ValueError(self.failed)
            dropped_before = self.aggregator.num_dropped
            mean = self.aggregator.push(worker, version, grad)
            self.aggregator.drain_dropped()  # nobody reads the records; num_dropped keeps the count
            self.shard.set_hparams(hparams, k)
            accepted = self.aggregator.num_dropped == dropped_before
            if accepted:  # a piece takes part in the step if any contributor had a gradient for it
                seen = self.open_step[1] if self.open_step is not None else [False] * len(present)
                self.open_step = (k, [a or b for a, b in zip(seen, present)])
            if mean is not None:
                try:
                    self.shard.apply_(mean, k, self.open_step[1])
                except Exception as err:
                    # The step is consumed: fail every waiter at once rather than leave them to their timeouts.
                    self.failed = (f"parameter server {self.index}: applying step {version} failed "
                                   f"({type(err).__name__}: {err}); mode='sync' cannot continue")  # fmt: skip
                    raise
                self.open_step = None
                self.version += 1
                # Every reply of the previous step went out before this step's last push could arrive, and
                # no reply of this step has: the counters now differ from the last close by exactly one step.
                self.closed_bytes = (self.bytes_in, self.bytes_out)
            return {"accepted": accepted, "staleness": 0, "contributors": list(self.aggregator.last_contributors)}
        if self.clock is not None and worker in self.clock.retired:
            raise RuntimeError(f"worker {worker} has retired (said BYE or disconnected); it cannot push again")
        self.shard.set_hparams(hparams, k)
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
        for pending in list(self.pending):
            if pending.conn.closed:
                self.pending.remove(pending)
                continue
            if self.failed and not self._ready(pending):
                self.pending.remove(pending)
                pending.conn.pending = False
                self._reply(pending.conn, Kind.ERROR, {"message": self.failed})
                continue
            if not self._ready(pending):
                continue
            self.pending.remove(pending)
            pending.conn.pending = False
            if pending.record:
                self.tracker.record_pull(pending.worker)
                if self.dc is not None:
                    self.dc.record_pull(pending.worker, self.shard.flat)
            meta = {**pending.ack, "version": self.version, "dtype": self.config["dtype"], **self._stats()}
            self._reply(pending.conn, Kind.REPLY, meta, tensor_bytes(self.shard.flat))

    def _answer_stalled(self, pending: _Pending, now: float) -> None:
        """A request waited its worker's whole ``patience`` for other workers: answer, naming them (we are alive)."""
        self.pending.remove(pending)
        pending.conn.pending = False
        waited = now - pending.since
        stalled, what, why = self._holding_back(pending.worker)
        if stalled:
            names = [f"worker {w} ({self._describe(w, now)})" for w in stalled[:8]]
            more = f" and {len(stalled) - 8} more" if len(stalled) > 8 else ""
            verb = "has" if len(stalled) == 1 else "have"
            pronoun = "it is" if len(stalled) == 1 else "they are"
            message = (f"{', '.join(names)}{more} {verb} not {what} for {_secs(waited)} s: {pronoun} stopped, hung or "
                       f"dead; parameter server {self.index} is alive ({why})")  # fmt: skip
        else:
            message = (f"parameter server {self.index} is alive but could not answer worker {pending.worker}'s request "
                       f"within {_secs(waited)} s ({why})")  # fmt: skip
        self._log(f"answered worker {pending.worker}'s waiting request after {waited:.1f} s: {message}", key="stalled")
        self._reply(pending.conn, Kind.ERROR, {"message": message, "stalled": stalled[:64]})

    def _holding_back(self, worker: int) -> tuple[list[int], str, str]:
        """``(workers, what they have not done, the rule)`` that keep ``worker``'s waiting request from an answer."""
        n = self.config.get("num_workers", 0)
        if self.aggregator is not None:
            step, arrived = self.aggregator.step, set(self.aggregator.arrived)
            quorum = self.aggregator.quorum
            rule = (f"a sync step needs the gradients of all {n} workers" if quorum == n else
                    f"a sync step needs {quorum} of {n} workers' gradients (backup_workers={n - quorum}); "
                    f"{len(arrived)} arrived")  # fmt: skip
            return [w for w in range(n) if w not in arrived], f"pushed step {step}", rule
        if self.clock is not None and worker not in self.clock.retired:
            clock = self.clock.clocks[worker]
            behind = list(self.clock.waiting_for(worker))
            what = f"reached clock {clock - self.clock.staleness} (worker {worker} is at clock {clock})"
            rule = f"mode='ssp' holds a worker until no worker is more than staleness={self.clock.staleness} clocks behind"
            return behind, what, rule
        return [], "answered", f"mode={self.config.get('mode')!r}"

    def _describe(self, worker: int, now: float) -> str:
        peer = self.peers.get(worker, "never said HELLO")
        if worker in self.gone:
            return f"{peer}; disconnected"
        heard = self.last_heard.get(worker)
        return f"{peer}; last heard from {_secs(now - heard)} s ago" if heard is not None else peer

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
        if self.aggregator is not None and how == "disconnected" and self.failed is None:
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
        """Restore a :meth:`state_dict`; if any part of ``state`` is refused, the server keeps the state it had."""
        if not isinstance(state, dict):
            raise RequestRefused(f"SET_STATE: the payload holds a {type(state).__name__}; it must be a server state dict")
        backup = copy.deepcopy(self.state_dict())
        try:
            self._load_state_dict(state)
        except Exception:
            self._load_state_dict(backup)
            raise

    def _load_state_dict(self, state: dict) -> None:
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
    limits: ServerLimits | None = None,
    secret: bytes | None = None,
) -> ServerProcess:
    """Fork a server process bound to ``host:port`` (``port=0``: any free port) and return its handle.

    ``limits`` bound what one peer may cost the server (default: every deadline ``io_timeout``). ``secret``
    (at least 32 bytes, handed over in memory): every connection must prove it holds it before its first request;
    ``None``: no authentication.

    The socket is bound here, before the fork, so a bad address fails in the caller and the port is
    known (and accepting) before this returns. Call it before creating other sockets if possible; the
    child closes every inherited descriptor except its own anyway.
    """
    parse_networks(allowed_networks)  # fail here, not in the child
    secret = check_secret(secret, f"start_server(index={index})")
    limits = limits if limits is not None else ServerLimits.from_io_timeout(io_timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, port), family=family, backlog=128)
    bound_host, bound_port = listener.getsockname()[:2]
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = fork_process()  # garbage gloo groups collected here; the child never collects what it inherits
    if pid == 0:  # child
        code = 1
        try:
            os.close(write_end)
            _close_inherited_fds({listener.fileno(), read_end})
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            _set_process_name(f"pdist-ps{index}")
            torch.set_num_threads(1)
            ShardServer(index, listener, read_end, allowed_networks, idle_timeout, limits=limits, secret=secret).serve()
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

    ``python -m lightning_pdist.parameter_server.server --index 0 --host 0.0.0.0 --port 29600 --allowed-networks 10.1.0.0/16
    --secret-file ~/.pdist/secret`` (the same file, mode 600, as the strategy's ``server_secret_file``)
    """
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--allowed-networks", default="127.0.0.0/8")
    parser.add_argument("--idle-timeout", type=float, default=300.0)
    parser.add_argument("--secret-file", default=None, help="file holding the shared secret (mode 600, >= 32 bytes); "
                        "without it the server is unauthenticated")  # fmt: skip
    defaults = ServerLimits()
    parser.add_argument("--max-connections", type=int, default=defaults.max_connections)
    parser.add_argument("--message-timeout", type=float, default=defaults.message_timeout)
    parser.add_argument("--reply-timeout", type=float, default=defaults.reply_timeout)
    parser.add_argument("--handshake-timeout", type=float, default=defaults.handshake_timeout)
    parser.add_argument("--max-init-bytes", type=int, default=defaults.max_init_bytes)
    args = parser.parse_args(argv)
    parse_networks(args.allowed_networks)
    secret = None
    if args.secret_file is not None:
        try:
            secret = read_secret_file(args.secret_file)
        except ValueError as err:
            parser.error(f"--secret-file {err}")
    limits = ServerLimits(args.max_connections, args.message_timeout, args.reply_timeout, args.handshake_timeout,
                          args.max_init_bytes)  # fmt: skip
    listener = socket.create_server((args.host, args.port), backlog=128)
    print(f"pdist parameter server {args.index} listening on {listener.getsockname()[0]}:{listener.getsockname()[1]}", flush=True)
    torch.set_num_threads(1)
    server = ShardServer(args.index, listener, None, args.allowed_networks, args.idle_timeout, limits=limits, secret=secret)
    if secret is None:
        server._log(f"WARNING: unauthenticated (no --secret-file): any process that can reach this port from "
                    f"{args.allowed_networks}, of any user, can push gradients, read parameters or shut the server down")  # fmt: skip
    server.serve()


if __name__ == "__main__":
    main()
