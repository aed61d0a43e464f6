"""The connection loop of a parameter server: single-threaded over non-blocking sockets (``selectors``).

Each connection is a small state machine (:class:`Connection`): a bounded
:class:`~lightning_pdist.core.ps_wire.FrameReader`, one request in flight, a queue of unsent reply bytes,
under the deadlines of :class:`ServerLimits` (a whole request, a whole reply, the first request); the number of
connections is bounded. Given a shared secret, every connection first answers
:mod:`~lightning_pdist.core.ps_auth`'s challenge: until then its reader takes nothing but a 32-byte ``AUTH``
(any other header is refused before its metadata is read), and a wrong proof closes the connection, logged. Any
exception while serving one connection closes that connection and is logged; it never ends the loop.

What a request *means* is the :class:`Handler`'s (:class:`~lightning_pdist.parameter_server.server.ShardServer`);
the loop only moves bytes, enforces the limits and tells the handler when a connection closes. It ends when the
handler says ``SHUTDOWN`` (:meth:`ConnectionLoop.stop`), when no connection is left and
:meth:`Handler.finished_when_idle`, when its lifeline pipe reaches EOF, or after ``idle_timeout`` seconds without
any connection.
"""

from __future__ import annotations

import math
import os
import selectors
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from lightning_pdist.core.ps_auth import (
    CLIENT_LABEL,
    NONCE_BYTES,
    PROOF_BYTES,
    SERVER_LABEL,
    check_secret,
    new_nonce,
    proof,
    verify,
)
from lightning_pdist.core.ps_wire import (
    FrameError,
    FrameReader,
    Kind,
    PeerClosed,
    address_allowed,
    encode_message,
    parse_networks,
)

__all__ = ["Connection", "ConnectionLoop", "Handler", "RequestRefused", "ServerLimits"]


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

@dataclass(eq=False)
class Connection:
    """One peer's connection: a small state machine over a non-blocking socket."""

    sock: socket.socket
    peer: str
    opened: float
    reader: FrameReader
    worker: int | None = None  # set by the handler (HELLO); the loop only names it in logs
    nonce: bytes | None = None  # the challenge sent; None once authenticated (or on a server without a secret)
    known: bool = False  # completed a request: no handshake deadline, not evicted at the connection limit
    inbox: deque = field(default_factory=deque)  # complete requests not yet handled (at most one)
    out: deque = field(default_factory=deque)  # memoryviews of reply bytes not yet sent
    pending: bool = False  # the handler holds the reply back (a waiting PULL/PUSHPULL)
    message_deadline: float | None = None
    reply_deadline: float | None = None
    sent_at: float = 0.0  # when its socket last took reply bytes (or a reply was queued): monotonic
    closing: bool = False  # close once the replies are out (after a protocol error)
    drain_deadline: float | None = None  # closing: our side is shut, discard what the peer still sends
    events: int = 0
    closed: bool = False

    @property
    def busy(self) -> bool:
        return self.pending or bool(self.out) or self.closing

    def name(self) -> str:
        return f"{self.peer}{f' (worker {self.worker})' if self.worker is not None else ''}"


class Handler(Protocol):
    """What a request means: the loop hands it every complete request of an authenticated connection."""

    def handle(self, conn: Connection, kind: Kind, meta: dict, payload: bytearray) -> None:
        """Apply one request and reply (:meth:`ConnectionLoop.reply`), or set ``conn.pending`` to answer later.

        An exception refuses the request: the peer gets an ``ERROR`` reply naming it (logged unless it is a
        :class:`RequestRefused`), and the connection stays open.
        """

    def serve_pending(self) -> None:
        """Answer the held-back requests that can now be answered (called after every request)."""

    def closed(self, conn: Connection) -> None:
        """``conn`` closed: forget its held-back requests (and its worker, if it was the last connection)."""

    def payload_limit(self, kind: Kind) -> int:
        """The most payload bytes a message of ``kind`` may carry now (checked on the header, before allocating)."""

    def connections_needed(self) -> int:
        """The fewest connections the job needs at once: ``max_connections`` is raised to it."""

    def next_deadline(self) -> float | None:
        """The soonest monotonic time at which :meth:`expire` has something to do (``None``: nothing)."""

    def expire(self, now: float) -> None:
        """Answer the held-back requests whose own deadline passed."""

    def replies_sent(self, conn: Connection) -> None:
        """Every reply queued on ``conn`` is now in its socket (the handler may queue the next worker's)."""

    def finished_when_idle(self) -> bool:
        """Whether the loop ends once no connection is left (the workers came, and have all gone)."""

    def frame_error_note(self) -> str:
        """A note appended to a refused frame's error (``""``: none)."""


class ConnectionLoop:
    """Serve ``listener``'s connections for ``handler`` until it stops (single-threaded: requests in arrival order).

    Args:
        handler: what requests mean (:class:`Handler`).
        index: the server's index, named in logs and error replies.
        listener: a bound, listening socket.
        lifeline: read end of a pipe whose EOF ends the loop (``None``: no lifeline).
        allowed_networks: comma-separated CIDR networks whose connections are accepted.
        idle_timeout: seconds without any connection (and no worker yet) after which the loop ends.
        limits: what one peer may cost (:class:`ServerLimits`).
        secret: the shared secret every connection must prove it holds (``None``: no authentication).
    """

    def __init__(
        self,
        handler: Handler,
        index: int,
        listener: socket.socket,
        lifeline: int | None,
        allowed_networks: str,
        idle_timeout: float,
        limits: ServerLimits,
        secret: bytes | None,
    ) -> None:
        self.handler = handler
        self.index = index
        self.secret = check_secret(secret, f"ShardServer(index={index})")
        self.listener = listener
        self.lifeline = lifeline
        self.networks = parse_networks(allowed_networks)
        self.idle_timeout = idle_timeout
        self.limits = limits
        self.selector = selectors.DefaultSelector()
        self.conns: dict[int, Connection] = {}
        self.stopping = False
        self.bytes_in = 0
        self.bytes_out = 0
        self._revisit: list[Connection] = []  # connections whose queued request may now be handled
        self._log_times: dict[str, tuple[float, int]] = {}  # rate limit per kind of log line

    def stop(self) -> None:
        """End the loop once the current request is handled (the replies already queued still go out)."""
        self.stopping = True

    def log(self, message: str, key: str | None = None) -> None:
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
                elif self.handler.finished_when_idle():
                    return  # every worker that said HELLO has gone
                else:
                    idle_since = idle_since or time.monotonic()
                    if time.monotonic() - idle_since > self.idle_timeout:
                        return  # nobody came (or only admin connections, long gone)
        finally:
            self._flush_before_exit()

    def _guard(self, conn: Connection, fn: Any, *args: Any) -> None:
        """Run ``fn``; any exception closes ``conn`` (logged), never the server."""
        try:
            fn(*args)
        except Exception as err:  # noqa: BLE001  (one bad peer never takes the server down)
            self.log(f"closing the connection from {conn.name()} after {type(err).__name__}: {str(err)[:300]}",
                      key=f"exception:{type(err).__name__}")  # fmt: skip
            try:
                self._close(conn)
            except Exception as close_err:  # noqa: BLE001
                self.log(f"closing {conn.name()} failed too ({type(close_err).__name__}: {close_err})")

    def _survive(self, fn: Any, *args: Any) -> None:
        """Run loop bookkeeping (accept, deadlines); an exception there is logged, never fatal."""
        try:
            fn(*args)
        except Exception as err:  # noqa: BLE001
            self.log(f"{fn.__name__} failed ({type(err).__name__}: {str(err)[:300]})", key=f"survive:{fn.__name__}")

    def _handle_revisits(self) -> None:
        while self._revisit:
            conn = self._revisit.pop()
            if not conn.closed:
                self._guard(conn, self._process, conn)
            if not conn.closed and not conn.out:
                self._survive(self.handler.replies_sent, conn)

    def _next_timeout(self) -> float:
        now = time.monotonic()
        soonest = now_plus = now + 1.0
        for conn in self.conns.values():
            for deadline in (conn.message_deadline, conn.reply_deadline, conn.drain_deadline):
                if deadline is not None and deadline < soonest:
                    soonest = deadline
            if not conn.known and conn.opened + self.limits.handshake_timeout < soonest:
                soonest = conn.opened + self.limits.handshake_timeout
        waiting = self.handler.next_deadline()
        if waiting is not None and waiting < soonest:
            soonest = waiting
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
        self.handler.expire(now)

    def _max_connections(self) -> int:
        return max(self.limits.max_connections, self.handler.connections_needed())

    def _accept(self) -> None:
        for _ in range(64):  # drain the backlog, a bounded batch at a time
            try:
                sock, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:  # EMFILE and the like: this connection, not the server
                self.log(f"accept failed ({err})", key="accept")
                return
            if not address_allowed(addr[0], self.networks):
                self.log(f"refused a connection from {addr[0]} (outside {', '.join(map(str, self.networks))})", key="network")
                _tell_and_close(sock, f"this server refuses connections from {addr[0]}: the address is outside its "
                                      "allowed_networks")  # fmt: skip
                continue
            if len(self.conns) >= self._max_connections() and not self._evict_one():
                self.log(f"refused a connection from {addr[0]}:{addr[1]}: max_connections={self._max_connections()} "
                          "reached and every connection has completed a request", key="limit")  # fmt: skip
                sock.close()
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = Connection(sock, f"{addr[0]}:{addr[1]}", time.monotonic(), FrameReader(self.handler.payload_limit))
            self.conns[sock.fileno()] = conn
            if self.secret is not None:
                conn.nonce = new_nonce()
                conn.reader.payload_limit = self._auth_payload_limit
                self.reply(conn, Kind.CHALLENGE, {}, conn.nonce, count=False)
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

    def _authenticate(self, conn: Connection, kind: Kind, meta: dict, payload: bytearray) -> None:
        """Check the peer's proof; answer with this server's proof of the peer's nonce, or close the connection."""
        nonce = meta.get("nonce")
        try:
            client_nonce = bytes.fromhex(nonce) if isinstance(nonce, str) else b""
        except ValueError:
            client_nonce = b""
        if kind != Kind.AUTH or len(client_nonce) != NONCE_BYTES or not verify(self.secret, conn.nonce, CLIENT_LABEL, payload):
            self.log(f"refused the connection from {conn.peer}: authentication failed (wrong secret, or not a "
                      "lightning_pdist worker)", key="auth")  # fmt: skip
            self.reply(conn, Kind.ERROR, {"message": f"parameter server {self.index}: authentication failed; the "
                                           "workers and the servers must share the same secret"}, count=False)  # fmt: skip
            self._shut(conn)
            return
        conn.nonce = None
        conn.reader.payload_limit = self.handler.payload_limit
        self.reply(conn, Kind.REPLY, {"proof": proof(self.secret, client_nonce, SERVER_LABEL).hex()}, count=False)

    def _set_events(self, conn: Connection) -> None:
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

    def _close(self, conn: Connection, reason: str | None = None) -> None:
        if conn.closed:
            return
        conn.closed = True
        if reason is not None:
            self.log(f"closing the connection from {conn.name()}: {reason}", key=f"close:{reason[:20]}")
        if conn.events:
            self.selector.unregister(conn.sock)
            conn.events = 0
        self.conns.pop(conn.sock.fileno(), None)
        conn.sock.close()
        conn.out.clear()
        conn.inbox.clear()
        self.handler.closed(conn)

    def _on_event(self, conn: Connection, mask: int) -> None:
        if mask & selectors.EVENT_WRITE:
            self._flush(conn)
        if mask & selectors.EVENT_READ and not conn.closed:
            self._read(conn)

    def _read(self, conn: Connection) -> None:
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
            before_init = self.handler.frame_error_note() if conn.nonce is None else ""
            self.log(f"refused a message from {conn.name()}: {err}{before_init}", key="frame")
            self.reply(conn, Kind.ERROR, {"message": f"parameter server {self.index}: {err}{before_init}; closing the connection"},
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

    def _process(self, conn: Connection) -> None:
        while conn.inbox and not conn.busy and not conn.closed:
            kind, meta, payload, _ = conn.inbox.popleft()
            try:
                self.handler.handle(conn, kind, meta, payload)
                conn.known = True
            except Exception as err:  # noqa: BLE001  (a bad request fails that request, not the server)
                if not isinstance(err, RequestRefused):
                    self.log(f"refused {kind.name} from {conn.name()}: {type(err).__name__}: {str(err)[:300]}", key="refused")
                self.reply(conn, Kind.ERROR, {"message": f"{type(err).__name__}: {err}"})
            self.handler.serve_pending()
        if not conn.closed:
            self._set_events(conn)

    def _shut(self, conn: Connection) -> None:
        """Close after a protocol error, once the error reply is out (lingering so the peer can read it)."""
        conn.closing = True
        conn.inbox.clear()
        if not conn.out:
            self._start_drain(conn)
        self._set_events(conn)

    def _start_drain(self, conn: Connection) -> None:
        # Closing a socket with unread input resets it, which can destroy the error reply in flight: shut our
        # side, then discard what the peer still sends, for 5 s at most.
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._close(conn)
            return
        conn.drain_deadline = time.monotonic() + 5.0

    def reply(self, conn: Connection, kind: Kind, meta: dict, payload: Any = None, count: bool = True) -> None:
        """Queue a message and send what the socket takes; ``count=False``: a handshake, not training traffic."""
        if conn.closed:
            return
        head, body = encode_message(kind, meta, payload)
        if count:
            self.bytes_out += len(head) + body.nbytes
        conn.out.append(memoryview(head))
        if body.nbytes:
            conn.out.append(body)
        conn.sent_at = time.monotonic()
        if conn.reply_deadline is None:
            conn.reply_deadline = conn.sent_at + self.limits.reply_timeout
        self._flush(conn)
        if conn.out and not conn.closed:  # what is left must not change with the shard: copy it
            conn.out = deque(v if v.readonly else memoryview(bytes(v)) for v in conn.out)

    def _flush(self, conn: Connection) -> None:
        while conn.out:
            view = conn.out[0]
            try:
                sent = conn.sock.send(view)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._close(conn)
                return
            if sent:
                conn.sent_at = time.monotonic()
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


def _tell_and_close(sock: socket.socket, message: str) -> None:
    """One small ``ERROR`` frame, sent only if the socket takes it at once (a refused peer never makes the server
    wait), then close. It names the peer's own address, never the server's networks."""
    head, body = encode_message(Kind.ERROR, {"message": message})
    try:
        sock.setblocking(False)
        sock.send(bytes(head) + bytes(body))
    except OSError:
        pass
    sock.close()
