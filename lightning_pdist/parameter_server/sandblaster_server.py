"""A parameter server's Sandblaster requests (``INIT`` with ``mode="sandblaster"``): portions, gradients, commands.

Three request kinds, each checked field by field before it touches any state (a refused request changes nothing):

``SB_CLAIM``  worker -> server 0: ``{"step", "portions", "batch"?}``; reply ``{"portion": p | null, "backup": bool}``
              (:class:`~lightning_pdist.parameter_server.sandblaster.PortionDispatcher`); ``batch``, the 64-bit hex
              digest of the worker's batch, is compared with the step's first (refused once two differ).
``SB_GRAD``   worker -> every server: this shard of portion ``p``'s gradient (payload, at most the shard's bytes),
              ``{"step", "portion", "portions", "samples", "loss"}``; reply ``{"accepted": bool}`` (the first answer
              for a portion is kept; a later one, or one for a finished step, is dropped).
``SB_OPS``    worker 0 (the coordinator) -> every server: ``{"step", "ops": [...]}`` (at most
              :data:`~lightning_pdist.parameter_server.sandblaster.MAX_OPS` commands); reply ``{"values": [...]}``. A
              list that starts with ``close`` waits until every portion of the step has arrived, for at most the
              request's ``patience``, then is answered with an error naming the workers that hold the missing
              portions (server 0 knows them; the others name the portions). ``finish`` ends the step: the server's
              version becomes the step, and the workers' waiting pulls are answered.

The shard itself is the parameters ``x`` (``PULL`` sends it, as in every mode); pushes and elastic exchanges are
refused. Never imports Lightning.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from lightning_pdist.parameter_server.loop import Connection, RequestRefused
from lightning_pdist.parameter_server.sandblaster import DIGEST, PortionDispatcher, ShardVectors, check_ops
from lightning_pdist.core.ps_wire import Kind, bytes_to_tensor

__all__ = ["MAX_HISTORY", "MAX_PORTIONS", "SB_KINDS", "SandblasterShard"]

SB_KINDS = (Kind.SB_CLAIM, Kind.SB_GRAD, Kind.SB_OPS)
MAX_HISTORY = 1024  # L-BFGS history pairs a server keeps (2 shard-sized vectors each)
MAX_PORTIONS = 1 << 12  # portions per step: each kept answer costs one shard-sized vector until the step closes


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _field(meta: dict, name: str, kind: str, rule: str, check: Any) -> Any:
    if name not in meta:
        raise RequestRefused(f"{kind}: field {name!r} is missing; {name} must be {rule}")
    value = meta[name]
    if not check(value):
        raise RequestRefused(f"{kind}: {name}={str(value)[:60]}: {name} must be {rule}")
    return value


@dataclass
class _Waiting:
    conn: Connection
    ops: list
    step: int
    portions: int
    since: float
    patience: float | None


class SandblasterShard:
    """The Sandblaster state of one :class:`~lightning_pdist.parameter_server.server.ShardServer` (``server``:
    duck-typed, for its shard, version, reply, peers and log)."""

    def __init__(self, server: Any, meta: dict):
        self.server = server
        self.history_size = _field(meta, "history_size", "INIT", f"an int in [1, {MAX_HISTORY}]",
                                   lambda v: _is_int(v) and 1 <= v <= MAX_HISTORY)  # fmt: skip
        self.max_portions = _field(meta, "max_portions", "INIT", f"an int in [1, {MAX_PORTIONS}]",
                                   lambda v: _is_int(v) and 1 <= v <= MAX_PORTIONS)  # fmt: skip
        backup = _field(meta, "backup_portions", "INIT", "an int in [0, max_portions)",
                        lambda v: _is_int(v) and 0 <= v < self.max_portions)  # fmt: skip
        self.vectors: ShardVectors | None = None
        self.dispatcher = PortionDispatcher(backup) if meta.get("dispatcher") is True else None
        self.waiting: list[_Waiting] = []
        self.step_portions = 0  # portions of the open step (from its first SB_GRAD or close)
        self.closed_step = 0  # the last step whose gradient was closed (its late answers are dropped from then on)
        self.last_loss: float | None = None
        self.stats = {"claims": 0, "backups": 0, "answers": 0, "dropped": 0}

    def attach(self, flat: Any) -> None:
        self.vectors = ShardVectors(flat, self.history_size)

    # ------------------------------------------------------------------ limits
    def payload_limit(self, kind: Kind, shard_bytes: int) -> int:
        return shard_bytes if kind == Kind.SB_GRAD else 0

    def state_bytes(self, shard_bytes: int) -> int:
        return (8 + 2 * self.history_size) * shard_bytes

    # ------------------------------------------------------------------ requests
    def handle(self, conn: Connection, kind: Kind, meta: dict, payload: bytearray, worker: int) -> None:
        name = kind.name
        step = _field(meta, "step", name, f"an int in [1, {self.server.version + 1}]",
                      lambda v: _is_int(v) and 1 <= v <= self.server.version + 1)  # fmt: skip
        if kind != Kind.SB_GRAD and payload:
            raise RequestRefused(f"{name}: payload of {len(payload)} bytes: {name} carries none")
        if kind == Kind.SB_CLAIM:
            self._claim(conn, meta, step, worker)
        elif kind == Kind.SB_GRAD:
            self._grad(conn, meta, payload, step, worker)
        else:
            self._ops(conn, meta, step, worker)

    def _portions(self, meta: dict, name: str) -> int:
        return _field(meta, "portions", name, f"an int in [1, {self.max_portions}]",
                      lambda v: _is_int(v) and 1 <= v <= self.max_portions)  # fmt: skip

    def _claim(self, conn: Connection, meta: dict, step: int, worker: int) -> None:
        if self.dispatcher is None:
            raise RequestRefused(f"SB_CLAIM: parameter server {self.server.index} does not hand out portions (server 0 does)")
        portions = self._portions(meta, "SB_CLAIM")
        batch = meta.get("batch")
        if batch is not None and not (isinstance(batch, str) and DIGEST.match(batch)):
            raise RequestRefused(f"SB_CLAIM: batch={str(batch)[:60]}: batch must be a digest of 16 lowercase hex digits")
        try:
            portion, backup = self.dispatcher.claim(step, portions, worker, batch)
        except ValueError as err:
            raise RequestRefused(f"SB_CLAIM: {err}") from None
        self.stats["claims"] += portion is not None
        self.stats["backups"] += backup
        self.server._reply(conn, Kind.REPLY, {"portion": portion, "backup": backup})

    def _grad(self, conn: Connection, meta: dict, payload: bytearray, step: int, worker: int) -> None:
        portions = self._portions(meta, "SB_GRAD")
        portion = _field(meta, "portion", "SB_GRAD", f"an int in [0, {portions})", lambda v: _is_int(v) and 0 <= v < portions)
        samples = _field(meta, "samples", "SB_GRAD", "an int >= 1", lambda v: _is_int(v) and v >= 1)
        loss = _field(meta, "loss", "SB_GRAD", "a finite number",
                      lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))  # fmt: skip
        dtype = self.server.config["dtype"]
        try:
            grad = bytes_to_tensor(payload, dtype)
        except ValueError as err:
            raise RequestRefused(f"SB_GRAD: {err}") from None
        if grad.numel() != self.vectors.x.numel():
            raise RequestRefused(f"SB_GRAD: a gradient of {grad.numel()} elements; this shard holds {self.vectors.x.numel()}")
        late = step <= max(self.server.version, self.closed_step)  # closed, even if not yet finished
        if not late and self.vectors.portions and portions != self.step_portions:
            raise RequestRefused(f"SB_GRAD: portions={portions}: step {step} has {self.step_portions} portions")
        accepted = not late and self.vectors.add_portion(portion, samples, loss, grad)
        if accepted:
            self.step_portions = portions
            if self.dispatcher is not None:
                self.dispatcher.answered_by(step, portion)
        self.stats["answers" if accepted else "dropped"] += 1
        self.server._reply(conn, Kind.REPLY, {"accepted": accepted, "late": late})

    def _ops(self, conn: Connection, meta: dict, step: int, worker: int) -> None:
        if worker != 0:
            raise RequestRefused(f"SB_OPS: worker {worker} sent commands; only the coordinator (worker 0) does")
        if step != self.server.version + 1:
            raise RequestRefused(f"SB_OPS: step={step}: step {self.server.version + 1} is the open one")
        ops = meta.get("ops")
        try:
            check_ops(ops, len(self.vectors.history), self.history_size)
        except ValueError as err:
            raise RequestRefused(f"SB_OPS: {err}") from None
        patience = meta.get("patience")
        if not (patience is None or (isinstance(patience, (int, float)) and not isinstance(patience, bool)
                                     and 0 < patience <= 1e7)):  # fmt: skip
            raise RequestRefused(f"SB_OPS: patience={str(patience)[:40]}: patience must be null or a number of seconds in (0, 1e7]")
        if ops[0][0] == "close" and self.vectors.missing(ops[0][1]):
            conn.pending = True
            self.waiting.append(_Waiting(conn, ops, step, ops[0][1], time.monotonic(), patience))
            return
        self._run(conn, ops, step)

    def _run(self, conn: Connection, ops: list, step: int) -> None:
        try:
            values = self.vectors.run(ops)
        except ValueError as err:
            raise RequestRefused(f"SB_OPS: {err}") from None
        if ops[0][0] == "close":
            self.last_loss = values[0]
            self.step_portions, self.closed_step = 0, step
        if ops[-1][0] == "finish":
            self.server.version += 1
            if self.dispatcher is not None:
                self.dispatcher.finish()
        self.server._reply(conn, Kind.REPLY, {"values": values, "version": self.server.version})

    # ------------------------------------------------------------------ waiting closes
    def serve_pending(self) -> None:
        for w in list(self.waiting):
            if w.conn.closed:
                self.waiting.remove(w)
            elif not self.vectors.missing(w.portions):
                self.waiting.remove(w)
                w.conn.pending = False
                try:
                    self._run(w.conn, w.ops, w.step)
                except RequestRefused as err:
                    self.server._reply(w.conn, Kind.ERROR, {"message": f"RequestRefused: {err}"})

    def next_deadline(self) -> float | None:
        return min((w.since + w.patience for w in self.waiting if w.patience is not None), default=None)

    def expire(self, now: float) -> None:
        for w in list(self.waiting):
            if w.patience is not None and now >= w.since + w.patience and not w.conn.closed:
                stalled, what = self.holding_back()
                self.waiting.remove(w)
                w.conn.pending = False
                names = ", ".join(f"worker {v} ({self.server._describe(v, now)})" for v in stalled[:8])
                who = f"{names} {'has' if len(stalled) == 1 else 'have'} not" if stalled else "not yet"
                message = (f"{who} {what} for {now - w.since:.1f} s: stopped, hung or dead; parameter server "
                           f"{self.server.index} is alive (the coordinator's close of step {w.step} waits for them)")  # fmt: skip
                self.server._log(f"answered the coordinator's close after {now - w.since:.1f} s: {message}", key="stalled")
                self.server._reply(w.conn, Kind.ERROR, {"message": message, "stalled": stalled[:64]})

    def holding_back(self) -> tuple[list[int], str]:
        """``(workers, what they have not done)`` that keep the open step from closing: the holders of missing
        portions (server 0 knows them; another server names the portions), or else the coordinator."""
        step = self.server.version + 1
        portions = self.dispatcher.portions if self.dispatcher is not None and self.dispatcher.step == step else \
            self.waiting[0].portions if self.waiting else self.step_portions  # fmt: skip
        missing = self.vectors.missing(portions) if portions else []
        if missing and self.dispatcher is not None and self.dispatcher.step == step:
            outstanding = self.dispatcher.outstanding()
            workers = sorted({v for p in missing for v in outstanding.get(p, [])})
            return workers, f"answered portion(s) {missing[:8]} of step {step}"
        if missing:
            return [], f"sent portion(s) {missing[:8]} of step {step} here (parameter server 0 names their workers)"
        return [0], f"finished step {step} (worker 0 coordinates the L-BFGS update)"

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {**self.vectors.state_dict(), "last_loss": self.last_loss}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict):
            raise ValueError("the sandblaster state must be a dict")
        self.vectors.load_state_dict(state)
        self.last_loss = state.get("last_loss")
        self.step_portions, self.closed_step = 0, self.server.version
        if self.dispatcher is not None:
            self.dispatcher = PortionDispatcher(self.dispatcher.backup_portions)
            self.dispatcher.closed = self.server.version
