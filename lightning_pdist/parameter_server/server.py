"""A parameter server's request semantics: one shard of the flat parameter vector, and the optimizer run on it.

:class:`ShardServer` is the :class:`~lightning_pdist.parameter_server.loop.Handler` of a
:class:`~lightning_pdist.parameter_server.loop.ConnectionLoop`. It is generic until rank 0 sends ``INIT`` (its shard,
the optimizers' class names and param-group hyperparameters, the mode); then it serves ``HELLO``/``PUSH``/``PULL``/
``PUSHPULL``/``GET_STATE``/``SET_STATE``. What it does with gradients is the pure rules of
:mod:`~lightning_pdist.parameter_server.rules`:

``sync``   :class:`BackupWorkerAggregator`: the mean of the first ``N - b`` gradients tagged with the open step,
           applied once; a pull that waits for step ``t`` is answered once step ``t`` closed.
``async``  each push is one optimizer step on ``g / N`` on arrival; pulls are answered at once.
``ssp``    as ``async``, but a pull is answered only when :class:`SSPClock` lets the worker start its next clock.
``easgd``  no optimizer here: the shard is the center ``x̃`` of asynchronous elastic averaging; an ``ELASTIC`` request
           carries a worker's ``x_i`` and is answered with ``e = α(x_i − x̃)`` after ``x̃ ← x̃ + e``
           (:class:`~lightning_pdist.parameter_server.elastic.ElasticCenter`); pushes are refused.

``delay_compensation = λ > 0`` (async/ssp) first turns ``g`` into ``g + λ·g⊙g⊙(w - w_bak(m))``
(:class:`DelayCompensation`). ``sync`` without backup workers or chunks, given ``reply_turns`` in ``INIT`` (the
workers do not meet between a pull and their next push), answers a closed step's pulls **one worker at a time**,
rotating the first worker with the step (``version mod N``, so every server serves the same worker first): the next
reply is handed to its socket once the previous one is all in its own, so the first worker served computes and
pushes its next gradient into the server while the others still pull (the overlap a sync server's link needs;
answering all ``N`` at once made every worker finish pulling together, then push together).
``reply_buffer_bytes`` in ``INIT`` sets the send buffer of every worker connection (:func:`_set_reply_buffer`).
Every request is checked field by field before it touches any state
(:class:`RequestRefused` names the field, the value and the rule). The modes, the ``g / N`` scaling, missing
gradients and the server's lifetime are described in ``docs/algorithms/parameter_server.md``.
"""

from __future__ import annotations

import copy
import math
import socket
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_pdist.parameter_server.rules import (
    BackupWorkerAggregator,
    DelayCompensation,
    SSPClock,
    StalenessTracker,
)
from lightning_pdist.parameter_server.chunks import ChunkedStep, check_chunks
from lightning_pdist.parameter_server.elastic import ElasticCenter
from lightning_pdist.parameter_server.parallax_rows import ROW_KINDS, RowShard, handle_rows, row_payload_limit
from lightning_pdist.parameter_server.loop import Connection, ConnectionLoop, RequestRefused, ServerLimits
from lightning_pdist.parameter_server.sandblaster_server import SB_KINDS, SandblasterShard
from lightning_pdist.parameter_server.shard import ELEMENTWISE_OPTIMIZERS, ParameterShard, parse_present
from lightning_pdist.core.push_codec import decode_push
from lightning_pdist.core.ps_wire import (
    CODED,
    Kind,
    bytes_to_tensor,
    coded_payload_limit,
    dumps_state,
    loads_state,
    tensor_bytes,
)

__all__ = [
    "ELEMENTWISE_OPTIMIZERS",
    "MODES",
    "STALENESS_BUCKETS",
    "ParameterShard",
    "RequestRefused",
    "ServerLimits",
    "ShardServer",
]

MODES = ("sync", "async", "ssp", "easgd")
SERVER_MODES = (*MODES, "parallax", "sandblaster")  # not ParameterServerStrategy modes: "parallax" the sparse tables' row ranges (parallax_rows.py; ParallaxStrategy), "sandblaster" SandblasterStrategy's (sandblaster_server.py)
STALENESS_BUCKETS = 16  # histogram bins 0..15, the last one also counts everything staler
DTYPES = ("torch.float32", "torch.float64", "torch.float16", "torch.bfloat16")
MAX_WORKERS = 1 << 16  # per-worker bookkeeping is allocated from INIT's num_workers: bound it
MAX_PATIENCE = 1e7  # seconds a waiting request may ask the server to wait before naming the workers it waits for
MAX_HOST_CHARS = 255  # a HELLO's host name (DNS names are at most 253 characters)
TURN_STALL = 2.0  # seconds a worker's socket may take no byte of its reply before the next worker's reply is queued
REPLY_BUFFER_RANGE = (4096, 1 << 26)  # reply_buffer_bytes: Linux doubles it (floor 4,608); above 64 MiB paces nothing
_MISSING = object()


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


@dataclass
class _Pending:
    conn: Connection
    worker: int
    wait_version: int | None
    record: bool
    ack: dict
    since: float = 0.0  # when the request started waiting (monotonic)
    patience: float | None = None  # the worker's own timeout: answer by then, naming the workers we wait for
    answer: Any = None  # () -> (extra meta, payload) of the reply; None: this shard (PULL_ROWS: the rows asked for)
    chunk: int | None = None  # PUSHPULL_CHUNK: answered once this chunk closed step wait_version - 1


class ShardServer:
    """The request semantics of one server process, served by its own :class:`ConnectionLoop`.

    A request with bad values gets an ``ERROR`` reply and changes nothing. Arguments as :func:`start_server`'s
    (:mod:`~lightning_pdist.parameter_server.process`); ``listener`` is a bound, listening socket and ``lifeline``
    the read end of a pipe whose EOF ends :meth:`serve`.
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
        limits = limits if limits is not None else ServerLimits.from_io_timeout(io_timeout)
        self.loop = ConnectionLoop(self, index, listener, lifeline, allowed_networks, idle_timeout, limits, secret)
        self.live: dict[int, int] = {}  # worker -> open connections that said HELLO as it
        self.registered: set[int] = set()  # workers that said HELLO
        self.shard: ParameterShard | None = None
        self.config: dict[str, Any] = {}
        self.version = 0
        self.closed_bytes = (0, 0)  # sync: (bytes_in, bytes_out) when the last step closed
        self.histogram = [0] * STALENESS_BUCKETS
        self.pending: list[_Pending] = []
        self.gone: set[int] = set()  # workers whose connection closed (or said BYE)
        self.failed: str | None = None  # why sync training cannot continue
        self.refusals: dict[int, str] = {}  # a worker's last refused push, named if that worker then goes
        self.steps_closed = False  # sync: the workers left can never close another step
        self.aggregator: BackupWorkerAggregator | None = None
        self.clock: SSPClock | None = None
        self.dc: DelayCompensation | None = None
        self.elastic: ElasticCenter | None = None  # mode="easgd": the center x̃ (the shard) and its exchanges
        self.sandblaster: SandblasterShard | None = None  # mode="sandblaster": L-BFGS vectors, portions, commands
        self.open_step: tuple[int, list[bool]] | None = None  # sync: (optimizer, present) of the open step
        self.chunked: ChunkedStep | None = None  # sync with chunk_bytes: each chunk's sums and step (chunks.py)
        self.peers: dict[int, str] = {}  # worker -> "pid P on host H, connected from A" (its last HELLO)
        self.last_heard: dict[int, float] = {}  # worker -> when its last push or pull arrived (monotonic)
        self.in_turn = False  # sync, no backup workers, no chunks: whole-shard replies go out one worker at a time
        self.sending: Connection | None = None  # in_turn: the connection whose reply is being handed to its socket
        self._serving = False  # serve_pending is running (a reply that fails closes a connection, which calls it)
        self._serve_again = False

    def serve(self) -> None:
        """Serve until ``SHUTDOWN``, every worker gone, the lifeline's EOF or ``idle_timeout`` (:class:`ConnectionLoop`)."""
        self.loop.serve()

    @property
    def bytes_in(self) -> int:
        """Training traffic received (handshakes not counted)."""
        return self.loop.bytes_in

    @property
    def bytes_out(self) -> int:
        """Training traffic sent (handshakes and refusals of unauthenticated peers not counted)."""
        return self.loop.bytes_out

    def _log(self, message: str, key: str | None = None) -> None:
        self.loop.log(message, key)

    def _reply(self, conn: Connection, kind: Kind, meta: dict, payload: Any = None) -> None:
        self.loop.reply(conn, kind, meta, payload)

    # ------------------------------------------------------------------ the loop's Handler protocol
    def closed(self, conn: Connection) -> None:
        self.pending = [p for p in self.pending if p.conn is not conn]
        if conn is self.sending:  # its reply will never drain: the next worker's turn
            self.sending = None
            self.serve_pending()
        if self.sandblaster is not None:
            self.sandblaster.waiting = [w for w in self.sandblaster.waiting if w.conn is not conn]
        if conn.worker is not None:
            self.live[conn.worker] -= 1
            if not self.live[conn.worker]:  # another connection that said HELLO as this worker is still up
                self._worker_gone(conn.worker, "disconnected")

    def payload_limit(self, kind: Kind) -> int:
        if kind == Kind.INIT:
            return self.loop.limits.max_init_bytes
        if self.shard is None:
            return 0
        shard_bytes = self.shard.flat.numel() * self.shard.flat.element_size()
        if kind in (Kind.PUSH, Kind.PUSHPULL):
            return shard_bytes
        if kind == Kind.PUSHPULL_CHUNK:  # the largest chunk; 0 (refused on the header) unless INIT had chunks
            if self.chunked is None:
                return 0
            return max(b - a for a, b in self.chunked.ranges) * self.shard.flat.element_size()
        if kind in ROW_KINDS:
            return row_payload_limit(self.shard, kind)
        if kind in CODED:
            return coded_payload_limit(self.shard.flat.numel(), len(self.shard.segments))
        if kind == Kind.ELASTIC:  # a worker's x_i, this shard's size; no other mode takes one
            return shard_bytes if self.elastic is not None else 0
        if kind in SB_KINDS:
            return self.sandblaster.payload_limit(kind, shard_bytes) if self.sandblaster is not None else 0
        if kind == Kind.SET_STATE:  # values, up to 3 optimizer moments, one DC backup per worker, and overhead
            extra = self.sandblaster.state_bytes(shard_bytes) if self.sandblaster is not None else 0
            return (int(self.config["num_workers"]) + 6) * shard_bytes + extra + (64 << 20)
        return 0

    def connections_needed(self) -> int:
        chunks = self.chunked.count if self.chunked is not None else 0  # one more connection per chunk per worker
        return (2 + chunks) * int(self.config.get("num_workers", 0)) + 8

    def next_deadline(self) -> float | None:
        deadlines = [p.since + p.patience for p in self.pending if p.patience is not None]
        if self.sending is not None and self.sending.out:
            deadlines.append(self.sending.sent_at + TURN_STALL)
        if self.sandblaster is not None and self.sandblaster.next_deadline() is not None:
            deadlines.append(self.sandblaster.next_deadline())
        return min(deadlines, default=None)

    def expire(self, now: float) -> None:
        if self.sandblaster is not None:
            self.sandblaster.expire(now)
        if self.sending is not None and self.sending.out and now >= self.sending.sent_at + TURN_STALL:
            # A worker that stops reading keeps its reply (dropped at reply_timeout), not the others' turns
            self._log(f"{self.sending.name()} took no byte of its reply for {TURN_STALL:g} s; answering the next "
                      "worker meanwhile", key="turn")  # fmt: skip
            self.sending = None
            self.serve_pending()
        for pending in list(self.pending):
            if pending.patience is not None and now >= pending.since + pending.patience and not pending.conn.closed:
                if self.in_turn and pending.answer is None and self._ready(pending):
                    continue  # answerable, waiting for its turn behind another worker's reply (not for a worker)
                self._answer_stalled(pending, now)

    def replies_sent(self, conn: Connection) -> None:
        if conn is self.sending:  # its reply is all in its socket: the next worker's turn
            self.sending = None
            self.serve_pending()

    def finished_when_idle(self) -> bool:
        return bool(self.registered)

    def frame_error_note(self) -> str:
        return " (nothing but INIT is accepted before INIT)" if self.shard is None else ""

    # ------------------------------------------------------------------ requests
    def handle(self, conn: Connection, kind: Kind, meta: dict, payload: bytearray) -> None:
        coded = kind in CODED  # a compressed push: decoded in _check_push, then the same as its plain kind
        kind = CODED.get(kind, kind)
        if kind == Kind.INIT:
            self._init(meta, payload)
            self._reply(conn, Kind.REPLY, {"server": self.index, "numel": self.shard.flat.numel()})
        elif kind == Kind.SHUTDOWN:
            self._reply(conn, Kind.REPLY, {})
            self.loop.stop()
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
                _set_reply_buffer(conn, self.config.get("reply_buffer_bytes"))
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
        elif kind in ROW_KINDS:
            handle_rows(self, conn, kind, meta, payload)
        elif kind in (Kind.PUSH, Kind.PUSHPULL, Kind.ELASTIC) and isinstance(self.shard, RowShard):
            raise RequestRefused(f"{kind.name}: this server runs mode='parallax', which takes PUSH_ROWS of the sparse "
                                 "tables' touched rows")  # fmt: skip
        elif kind == Kind.ELASTIC:
            self._elastic(conn, meta, payload)
        elif kind in SB_KINDS:
            if self.sandblaster is None:
                raise RequestRefused(f"{kind.name}: this server runs mode={self.config['mode']!r}; {kind.name} needs "
                                     "mode='sandblaster'")  # fmt: skip
            worker = self._worker_of(conn, kind, meta)
            self.last_heard[worker] = time.monotonic()
            self.sandblaster.handle(conn, kind, meta, payload, worker)
        elif kind in (Kind.PUSH, Kind.PUSHPULL) and self.sandblaster is not None:
            raise RequestRefused(f"{kind.name}: this server runs mode='sandblaster', which takes SB_GRAD portions, not pushes")
        elif kind in (Kind.PUSH, Kind.PUSHPULL) and self.elastic is not None:
            raise RequestRefused(f"{kind.name}: this server runs mode='easgd', which takes ELASTIC exchanges of the "
                                 "workers' parameters, not gradients")  # fmt: skip
        elif kind == Kind.PUSHPULL_CHUNK:
            self._chunk(conn, meta, payload)
        elif kind in (Kind.PUSH, Kind.PUSHPULL) and self.chunked is not None:
            raise RequestRefused(f"{kind.name}: this server's steps are chunked (INIT had chunks); push each chunk with "
                                 "PUSHPULL_CHUNK")  # fmt: skip
        elif kind in (Kind.PUSH, Kind.PUSHPULL, Kind.PULL):
            worker = self._worker_of(conn, kind, meta)
            wait = _field(meta, "wait_version", kind.name, "null or an int >= 0", lambda v: v is None or (_is_int(v) and v >= 0), None)
            record = _field(meta, "record", kind.name, "true or false", lambda v: isinstance(v, bool), True)
            patience = _field(meta, "patience", kind.name, f"null or a number of seconds in (0, {MAX_PATIENCE:g}]",
                              lambda v: v is None or (_is_finite_number(v) and 0 < v <= MAX_PATIENCE), None)  # fmt: skip
            if kind == Kind.PULL and payload:
                raise RequestRefused(f"PULL: payload of {len(payload)} bytes: a PULL carries none")
            self.last_heard[worker] = time.monotonic()
            ack = self._push(worker, kind, meta, payload, coded) if kind != Kind.PULL else {}
            if kind == Kind.PUSH:
                self._reply(conn, Kind.REPLY, {**ack, **self._stats()})
            else:
                if kind == Kind.PUSHPULL and self.config["mode"] == "sync" and wait is None:
                    wait = int(meta["version"]) + 1  # answered once the step this gradient belongs to closed
                conn.pending = True
                self.pending.append(_Pending(conn, worker, wait, record, ack, time.monotonic(), patience))
        else:
            raise RequestRefused(f"unexpected message kind {kind.name}")

    def _chunk(self, conn: Connection, meta: dict, payload: bytearray) -> None:
        """Chunk ``j`` of a worker's sync push; answered with ``x[a_j:b_j]`` once every worker pushed chunk ``j`` (chunks.py)."""
        if self.chunked is None:
            raise RequestRefused(f"PUSHPULL_CHUNK: this server runs mode={self.config['mode']!r} without chunks; "
                                 "chunked pushes need an INIT with chunks (chunk_bytes=)")  # fmt: skip
        worker = self._worker_of(conn, Kind.PUSHPULL_CHUNK, meta)
        steps = self.chunked
        j = _field(meta, "chunk", "PUSHPULL_CHUNK", f"an int in [0, {steps.count})", lambda v: _is_int(v) and 0 <= v < steps.count)
        patience = _field(meta, "patience", "PUSHPULL_CHUNK", f"null or a number of seconds in (0, {MAX_PATIENCE:g}]",
                          lambda v: v is None or (_is_finite_number(v) and 0 < v <= MAX_PATIENCE), None)  # fmt: skip
        if self.failed:
            raise RuntimeError(self.failed)
        count = len(self.shard.optimizers)
        k = _field(meta, "optimizer", "PUSHPULL_CHUNK", f"an int in [0, {count})", lambda v: _is_int(v) and 0 <= v < count, 0)
        version = _field(meta, "version", "PUSHPULL_CHUNK", "an int >= 0", lambda v: _is_int(v) and v >= 0)
        dtype = self.config["dtype"]
        _field(meta, "dtype", "PUSHPULL_CHUNK", f"{dtype!r}, the shard's dtype", lambda v: v == dtype, dtype)
        try:
            present = parse_present(meta.get("present"), len(self.shard.pieces[k]))
            part = bytes_to_tensor(payload, dtype)
            bounds = steps.bounds(k, present)
            if part.numel() != bounds[j + 1] - bounds[j]:
                raise ValueError(f"chunk {j} of {part.numel()} elements; optimizer {k}'s present pieces in chunk {j} "
                                 f"hold {bounds[j + 1] - bounds[j]}")  # fmt: skip
            hparams = meta.get("hparams")
            self.shard.check_hparams(hparams, k)
        except ValueError as err:
            raise RequestRefused(f"PUSHPULL_CHUNK: {err}") from None
        aggregator, opened = steps.aggregators[j], steps.open[j]
        if version == aggregator.step and opened is not None and opened[0] != k:
            self.refusals[worker] = (f"worker {worker} pushed chunk {j} of optimizer {k} for step {version}, which "
                                     f"optimizer {opened[0]} opened; every worker must step the same optimizers in the "
                                     "same order")  # fmt: skip
            raise ValueError(f"parameter server {self.index}: {self.refusals[worker]}")
        self.last_heard[worker] = time.monotonic()
        accepted = False
        if not self.steps_closed:  # else: the others finished, nobody can close a step; answered at once
            dropped_before = aggregator.num_dropped
            mean = aggregator.push(worker, version, steps.expand(part, j, k, present))
            accepted = aggregator.num_dropped == dropped_before
            aggregator.drain_dropped()
            self.aggregator.num_dropped += aggregator.num_dropped - dropped_before
            self.shard.set_hparams(hparams, k)
            if accepted:
                seen = opened[1] if opened is not None else [False] * len(present)
                steps.open[j] = (k, [a or b for a, b in zip(seen, present)])
            if mean is not None:
                self._close_chunk(j, k, mean, version)
        ack = {"accepted": accepted, "staleness": 0, "contributors": list(aggregator.last_contributors)}
        a, b = steps.ranges[j]
        answer = lambda: ({"chunk": j, "version": steps.closed(j)}, tensor_bytes(self.shard.flat[a:b]))  # noqa: E731
        conn.pending = True
        self.pending.append(_Pending(conn, worker, version + 1, j == steps.count - 1, ack, time.monotonic(), patience,
                                     answer, j))  # fmt: skip

    def _close_chunk(self, j: int, k: int, mean: Tensor, version: int) -> None:
        """Chunk ``j`` of step ``version`` has every gradient: step its pieces; the last chunk closes the step."""
        steps = self.chunked
        a, b = steps.ranges[j]
        try:
            self.shard.apply_range_(mean, k, steps.open[j][1], a, b)
        except Exception as err:
            self.failed = (f"parameter server {self.index}: applying chunk {j} of step {version} failed "
                           f"({type(err).__name__}: {err}); mode='sync' cannot continue")  # fmt: skip
            raise
        steps.open[j] = None
        if all(steps.closed(i) > version for i in range(steps.count)):
            self.version += 1
            self.aggregator.step += 1
            self.aggregator.last_contributors = steps.aggregators[j].last_contributors
            self.closed_bytes = (self.loop.bytes_in, self.loop.bytes_out)

    def _elastic(self, conn: Connection, meta: dict, payload: bytearray) -> None:
        """One elastic exchange: the worker's ``x_i`` in, ``e = α(x_i − x̃)`` out, ``x̃ ← x̃ + e`` (checked first)."""
        worker = self._worker_of(conn, Kind.ELASTIC, meta)
        if self.elastic is None:
            raise RequestRefused(f"ELASTIC: this server runs mode={self.config['mode']!r}; elastic exchanges need "
                                 "mode='easgd'")  # fmt: skip
        dtype = self.config["dtype"]
        _field(meta, "dtype", "ELASTIC", f"{dtype!r}, the shard's dtype", lambda v: v == dtype, dtype)
        try:
            local = bytes_to_tensor(payload, dtype)
        except ValueError as err:
            raise RequestRefused(f"ELASTIC: {err}") from None
        if local.numel() != self.shard.flat.numel():
            raise RequestRefused(f"ELASTIC: x_i of {local.numel()} elements; this shard holds {self.shard.flat.numel()}")
        self.last_heard[worker] = time.monotonic()
        e = self.elastic.exchange(local)
        self.version += 1
        self._reply(conn, Kind.REPLY, {"version": self.version, "dtype": dtype, **self._stats()}, tensor_bytes(e))

    def _worker_of(self, conn: Connection, kind: Kind, meta: dict) -> int:
        if conn.worker is None:
            raise RuntimeError("send HELLO before PUSH/PULL")
        if "worker" in meta and meta["worker"] != conn.worker:
            raise RequestRefused(f"{kind.name}: worker={_show(meta['worker'])}: this connection said HELLO as worker {conn.worker}")
        return conn.worker

    def _init(self, meta: dict, payload: bytearray) -> None:
        """Check every field, build everything, and only then replace the current state (a refused INIT changes nothing)."""
        mode = _field(meta, "mode", "INIT", f"one of {SERVER_MODES}", lambda v: v in SERVER_MODES)
        num_workers = _field(meta, "num_workers", "INIT", f"an int in [1, {MAX_WORKERS}]",
                             lambda v: _is_int(v) and 1 <= v <= MAX_WORKERS)  # fmt: skip
        dtype = _field(meta, "dtype", "INIT", f"one of {DTYPES}", lambda v: v in DTYPES)
        segments = _field(meta, "segments", "INIT", "a list of [optimizer, group, numel] (or [group, numel]) ints, numel >= 0",
                          lambda v: isinstance(v, list) and all(isinstance(s, list) and len(s) in (2, 3)
                                                                and all(_is_int(x) for x in s) and s[-1] >= 0 for s in v))  # fmt: skip
        alpha = None
        sandblaster = SandblasterShard(self, meta) if mode == "sandblaster" else None  # its fields checked first
        if mode in ("easgd", "sandblaster"):  # easgd: the workers step locally; sandblaster: the coordinator's commands
            if mode == "easgd":
                alpha = _field(meta, "alpha", "INIT", "a number in (0, 1]", lambda v: _is_finite_number(v) and 0 < v <= 1)
            optimizers = []
            if any(s[0] != -1 for s in segments if len(s) == 3) or any(len(s) != 3 for s in segments):
                raise RequestRefused(f"INIT: segments={_show(segments)}: mode={mode!r} segments must be [-1, -1, numel] "
                                     "(no server optimizer)")  # fmt: skip
        elif "optimizers" in meta:
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
        low, high = REPLY_BUFFER_RANGE
        _field(meta, "reply_buffer_bytes", "INIT", f"null or an int in [{low}, {high}]",
               lambda v: v is None or (_is_int(v) and low <= v <= high), None)  # fmt: skip
        turns = _field(meta, "reply_turns", "INIT", "true or false", lambda v: isinstance(v, bool), False)
        numel = sum(s[-1] for s in segments)
        itemsize = torch.empty(0, dtype=getattr(torch, dtype.removeprefix("torch."))).element_size()
        if len(payload) != numel * itemsize:
            raise RequestRefused(f"INIT: payload of {len(payload)} bytes; segments hold {numel} elements of {dtype}, "
                                 f"{numel * itemsize} bytes")  # fmt: skip
        values = bytes_to_tensor(payload, dtype).clone()
        if not torch.isfinite(values).all():
            raise RequestRefused("INIT: the initial shard holds non-finite values; they must be finite")
        try:
            shard = (ParameterShard(values, segments, optimizers) if mode != "parallax" else
                     RowShard(values, segments, optimizers, meta.get("tables")))  # fmt: skip
        except ValueError as err:
            raise RequestRefused(f"INIT: {err}") from None
        elastic = ElasticCenter(shard.flat, float(alpha)) if alpha is not None else None
        chunked = None
        if "chunks" in meta:
            if mode != "sync" or backup:
                raise RequestRefused(f"INIT: chunks with mode={mode!r}, backup_workers={backup}: chunked steps need "
                                     "mode='sync' without backup workers (each chunk closes on every worker's push)")  # fmt: skip
            try:
                ranges = check_chunks(meta["chunks"], segments)
            except ValueError as err:
                raise RequestRefused(f"INIT: {err}") from None
            chunked = ChunkedStep(ranges, [[(a, b) for a, b, _ in ps] for ps in shard.pieces], num_workers)
        aggregator = BackupWorkerAggregator(num_workers, backup) if mode in ("sync", "parallax") else None
        clock = SSPClock(num_workers, staleness) if mode == "ssp" else None
        tracker = StalenessTracker(num_workers)
        dc = DelayCompensation.starting_from(shard.flat, num_workers, float(lam)) if lam > 0 else None
        self.shard, self.aggregator, self.clock, self.tracker, self.dc = shard, aggregator, clock, tracker, dc
        self.elastic, self.chunked = elastic, chunked
        self.in_turn = turns and mode == "sync" and not backup and chunked is None
        self.sending = None
        if sandblaster is not None:
            sandblaster.attach(shard.flat)
        self.sandblaster = sandblaster
        self.open_step = None
        self.config = dict(meta)
        self.version = 0
        self.failed, self.steps_closed, self.refusals = None, False, {}

    def _decode(self, payload: bytearray, k: int, present: list[bool]) -> Tensor:
        """The compact gradient of a compressed push: one tensor per present piece of optimizer ``k``, in shard order.

        Each piece's size comes from the shard layout, so nothing decoded is larger than the piece it fills
        (:func:`~lightning_pdist.core.push_codec.decode_push` bounds every length first); trailing bytes are refused.
        """
        parts, offset = [], 0
        pieces = self.shard.pieces[k]
        if len(present) != len(pieces):
            raise ValueError(f"present of {len(present)} pieces; optimizer {k} has {len(pieces)} here")
        for i, ((start, stop, _), p) in enumerate(zip(pieces, present)):
            if p:
                try:
                    part, offset = decode_push(payload, stop - start, offset)
                except ValueError as err:
                    raise ValueError(f"compressed piece {i} ({stop - start} elements): {err}") from None
                parts.append(part)
        if offset != len(payload):
            raise ValueError(f"compressed payload of {len(payload)} bytes; its pieces end at byte {offset}")
        compact = torch.cat(parts) if parts else torch.zeros(0)
        return compact.to(self.shard.flat.dtype)

    def _check_push(self, worker: int, kind: Kind, meta: dict, payload: bytearray,
                    coded: bool = False) -> tuple[int, list[bool], Tensor, Any, int | None]:  # fmt: skip
        """``(optimizer, present, shard-sized gradient, hparams, version)`` of a push; refuses before anything changes."""
        name = kind.name if not coded else f"{kind.name}_CODED"
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
            compact = self._decode(payload, k, present) if coded else bytes_to_tensor(payload, dtype)
            grad = self.shard.expand(compact, k, present)
            hparams = meta.get("hparams")
            self.shard.check_hparams(hparams, k)
        except ValueError as err:
            raise RequestRefused(f"{name}: {err}") from None
        return k, present, grad, hparams, version

    def _push(self, worker: int, kind: Kind, meta: dict, payload: bytearray, coded: bool = False) -> dict:
        if self.failed:
            raise RuntimeError(self.failed)
        k, present, grad, hparams, version = self._check_push(worker, kind, meta, payload, coded)
        if self.aggregator is not None and self.steps_closed:  # the others finished: nobody can close a step
            self.aggregator.num_dropped += 1
            return {"accepted": False, "staleness": 0, "contributors": []}
        if self.aggregator is not None:  # sync (with or without backup workers)
            if version == self.aggregator.step and self.open_step is not None and self.open_step[0] != k:
                # The step cannot close: fail its waiters with the reason, not with the disconnect that follows.
                # Refused, and the server carries on (one bad request never takes it down); the reason is kept
                # so that, if this worker's run ends on it, the failure its peers then see names it.
                self.refusals[worker] = (
                    f"worker {worker} pushed a gradient of optimizer {k} for step {version}, which optimizer "
                    f"{self.open_step[0]} opened; every worker must step the same optimizers in the same order"
                )
                raise ValueError(f"parameter server {self.index}: {self.refusals[worker]}")
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
                self.closed_bytes = (self.loop.bytes_in, self.loop.bytes_out)
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
        if pending.chunk is not None:  # a chunk whose step failed to apply has closed in count only: not ready
            return not self.failed and self.chunked.closed(pending.chunk) >= pending.wait_version
        return pending.wait_version is None or self.version >= pending.wait_version

    def serve_pending(self) -> None:
        if self._serving:  # called again from within (a failed reply closed a connection): one more pass after
            self._serve_again = True
            return
        self._serving = True
        try:
            self._serve_again = True
            while self._serve_again:
                self._serve_again = False
                self._serve_pending_once()
        finally:
            self._serving = False

    def _serve_pending_once(self) -> None:
        if self.sandblaster is not None:  # a coordinator's close waiting for portions
            self.sandblaster.serve_pending()
        in_turn = []
        for pending in list(self.pending):
            if pending not in self.pending:
                continue
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
            if self.in_turn and pending.answer is None:
                in_turn.append(pending)
                continue
            self._answer(pending)
        if in_turn:
            self._answer_in_turn(in_turn)

    def _answer_in_turn(self, ready: list[_Pending]) -> None:
        """Hand whole-shard replies to their sockets one worker at a time, from worker ``version mod N`` on.

        The next reply is queued once the previous one is all in its socket (:meth:`replies_sent`), so the server's
        link carries one worker's parameters at a time (each socket's autotuned buffer still overlaps the next reply's
        start with the previous one's tail), or once that socket took no byte for ``TURN_STALL`` seconds (a worker
        that stops reading delays the others by that much, not until ``reply_timeout`` drops it). Values are
        untouched: a sync shard changes only when every worker, those still waiting their turn included, pushed again.
        """
        n = int(self.config["num_workers"])
        first = self.version % n
        for pending in sorted(ready, key=lambda p: (p.worker - first) % n):
            if self.sending is not None and not self.sending.closed and self.sending.out:
                return
            if pending not in self.pending or pending.conn.closed:
                continue
            self.sending = pending.conn
            self._answer(pending)

    def _answer(self, pending: _Pending) -> None:
        self.pending.remove(pending)
        pending.conn.pending = False
        if pending.record:
            self.tracker.record_pull(pending.worker)
            if self.dc is not None:
                self.dc.record_pull(pending.worker, self.shard.flat)
        extra, payload = pending.answer() if pending.answer is not None else ({}, tensor_bytes(self.shard.flat))
        meta = {**pending.ack, "version": self.version, "dtype": self.config["dtype"], **self._stats(), **extra}
        self._reply(pending.conn, Kind.REPLY, meta, payload)

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
            step, arrived = self.aggregator.step, set(self._arrived())
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
        if self.sandblaster is not None:
            return (*self.sandblaster.holding_back(), "mode='sandblaster' answers a pull once the coordinator finished the step")
        return [], "answered", f"mode={self.config.get('mode')!r}"

    def _arrived(self) -> tuple[int, ...]:
        """Sync: the workers whose gradient of the open step arrived (chunked: of its lowest chunk not yet closed)."""
        if self.chunked is not None:
            return self.chunked.aggregators[self.chunked.lowest_open()].arrived
        return self.aggregator.arrived

    def _describe(self, worker: int, now: float) -> str:
        peer = self.peers.get(worker, "never said HELLO")
        if worker in self.gone:
            return f"{peer}; disconnected"
        heard = self.last_heard.get(worker)
        return f"{peer}; last heard from {_secs(now - heard)} s ago" if heard is not None else peer

    def _stats(self) -> dict:
        stats = {"bytes_in": self.bytes_in, "bytes_out": self.bytes_out}
        if self.config.get("mode") in ("sync", "parallax"):
            stats["step_bytes_in"], stats["step_bytes_out"] = self.closed_bytes
        elif self.elastic is not None:
            stats["exchanges"] = self.elastic.exchanges
        elif self.sandblaster is not None:
            stats.update(self.sandblaster.stats, loss=self.sandblaster.last_loss)
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
            if len(set(self._arrived()) | unfinished) < self.aggregator.quorum:
                dropped = self.aggregator.num_dropped + len(self._arrived())
                self.aggregator.load_state_dict({"step": self.aggregator.step, "num_dropped": dropped})
                self.steps_closed = True
        if self.aggregator is not None and how == "disconnected":
            live = self.config["num_workers"] - len(self.gone)
            if live < self.aggregator.quorum:
                self.failed = (
                    f"parameter server {self.index}: worker {worker} {how} and mode='sync' needs "
                    f"{self.aggregator.quorum} of {self.config['num_workers']} workers per step "
                    f"(backup_workers={self.aggregator.backup_workers}); {live} remain"
                    + (f" (its last push was refused: {self.refusals[worker]})" if worker in self.refusals else "")
                )
        self.serve_pending()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        if self.chunked is not None and any(a.arrived for a in self.chunked.aggregators):
            raise RuntimeError(f"parameter server {self.index}: chunks of step {self.version} hold gradients; take the "
                               "state between steps")  # fmt: skip
        return {
            "server": self.index,
            "version": self.version,
            "shard": self.shard.state_dict(),
            "aggregator": self.aggregator.state_dict() if self.aggregator is not None else None,
            "clock": self.clock.state_dict() if self.clock is not None else None,
            "tracker": self.tracker.state_dict(),
            "dc": self.dc.state_dict() if self.dc is not None else None,
            "histogram": list(self.histogram),
            "elastic": self.elastic.state_dict() if self.elastic is not None else None,
            "sandblaster": self.sandblaster.state_dict() if self.sandblaster is not None else None,
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
        if self.chunked is not None:
            self.chunked.reset(self.aggregator.step)
        if self.clock is not None and state.get("clock") is not None:
            clock = state["clock"]
            # every worker of the resumed run is live again, at the clock it had
            self.clock.load_state_dict({**clock, "retired": []})
        self.tracker.load_state_dict(state["tracker"])
        if self.dc is not None and state.get("dc") is not None:
            self.dc.load_state_dict(state["dc"])
        self.histogram = [int(c) for c in state.get("histogram", self.histogram)]
        if self.elastic is not None and state.get("elastic") is not None:
            self.elastic.load_state_dict(state["elastic"])
        if self.sandblaster is not None and state.get("sandblaster") is not None:
            self.sandblaster.load_state_dict(state["sandblaster"])


def _set_reply_buffer(conn: Connection, size: int | None) -> None:
    """A worker connection's send buffer: ``size`` bytes (``INIT``'s ``reply_buffer_bytes``), or the kernel's autotuning.

    A sync step (or a chunk of one) closes for every worker at once, so its ``W`` replies start together; with
    autotuned buffers each socket hands the server host's own queue (here the link shaper's) as much as its congestion
    window allows (BBR, this machine's default, starts at 2.89 times its rate estimate), the queue can overflow and
    replies are dropped before they leave the host. With ``size`` each socket holds about ``2 · size`` bytes unsent or
    unacknowledged (Linux doubles it) and the loop refills it as the link drains it. Values are untouched: this changes
    when bytes leave, not which. Measured (docs/benchmarks.md): 16 KiB was faster for chunked steps at 4 workers and
    slower at 8 on 2 shared cores (more refills of more sockets by single-threaded servers), so the default is ``None``.
    """
    if size is not None:  # called once per connection: at its first HELLO
        try:
            conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
        except OSError:
            pass
