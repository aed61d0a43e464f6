"""Sandblaster L-BFGS (Dean et al. 2012, "Large Scale Distributed Deep Networks", §4.2): the math, no transport.

Batch L-BFGS whose vectors never leave the parameter servers. Each server holds its shard of the parameters ``x``
and of every vector the method needs (the gradient ``g``, the previous gradient, the direction ``d``, the two-loop
accumulator ``q``, the newest pair ``s, y`` and the history ``S_i, Y_i``, oldest first); a coordinator (worker 0)
runs the method as a sequence of small commands, each applied by every server to its shard::

    dot a b        -> Σ_shard a·b            (float64 partial sums; the coordinator adds them up)
    absmax a       -> max_shard |a|           (the coordinator takes the max)
    abssum a       -> Σ_shard |a|
    axpy a α b     a ← a + α·b               scale a α     a ← α·a
    copy a b       a ← b                      sub c a b     c ← a − b
    remember       (S, Y) ← (S, Y) + (s, y), dropping the oldest pair beyond history_size
    forget         the history is emptied
    close P B      g ← Σ_{p<P} (n_p / B)·G_p in portion order (all P portions must be there), -> the batch loss
    finish         the step is over (the workers may pull x)

so only scalars travel between the coordinator and the servers. :class:`LBFGSCoordinator` issues exactly the
arithmetic of ``torch.optim.LBFGS.step`` with ``max_iter=1`` and ``line_search_fn=None`` (its scalars rounded to
the parameters' dtype as torch's 0-d tensors are): on step 1 ``d = −g``, ``t = min(1, 1/‖g‖₁)·lr``; afterwards
``y = g − g_prev``, ``s = t·d``; if ``y·s > 1e-10`` the pair joins the history (``ρ = 1/y·s``, ``H = y·s / y·y``);
the two-loop recursion ``q = −g; α_i = ρ_i s_i·q; q −= α_i y_i`` (newest first), ``d = H q; β_i = ρ_i y_i·d;
d += (α_i − β_i) s_i`` (oldest first); ``t = lr``; and ``x += t·d`` unless ``g·d > −tolerance_change``. A step whose
``max|g| <= tolerance_grad`` changes nothing, as in torch.

The gradient of the batch is computed in *portions* (contiguous slices of the batch, :func:`portion_bounds`) that a
:class:`PortionDispatcher` hands to whichever worker asks next, so a fast worker takes more; once every portion is
handed out, an idle worker may get a copy of a portion still being computed (``backup_portions`` per step, the last
portions first), and each server keeps the first answer for each portion (:class:`ShardVectors`). The module's loss
is taken to be a mean over its batch, so portion ``p`` of ``n_p`` samples weighs ``n_p / B``.

Every worker must hold the same batch: ``g`` sums slices of *one* batch. Each claim carries a 64-bit digest of the
claimant's batch (:func:`batch_digest`); the dispatcher compares it with the step's first and refuses the step's
claims, and every later one, once two differ, naming the step and both workers.
"""

from __future__ import annotations

import hashlib
import math
import re
from typing import Any, Callable

import torch
from torch import Tensor

__all__ = [
    "LBFGSCoordinator",
    "batch_digest",
    "MAX_OPS",
    "PortionDispatcher",
    "ShardVectors",
    "check_ops",
    "combine",
    "portion_bounds",
]

VECTORS = ("x", "g", "prev", "d", "q", "s", "y")  # x is the shard itself; S<i>/Y<i> name the history, oldest first
MAX_OPS = 64  # commands in one request: the longest the coordinator sends is 6
DIGEST_STEPS = 64  # steps whose batch digest the dispatcher keeps (a worker this far behind is not checked)
DIGEST = re.compile(r"^[0-9a-f]{16}$")  # a batch digest: 64 bits in hex
_HISTORY = re.compile(r"^([SY])(0|[1-9][0-9]{0,3})$")
_SCALAR_OPS = {"dot": "sum", "absmax": "max", "abssum": "sum", "close": "first"}
_ARITY = {"dot": 2, "absmax": 1, "abssum": 1, "axpy": 3, "scale": 2, "copy": 2, "sub": 3, "remember": 0,
          "forget": 0, "close": 2, "finish": 0}  # fmt: skip


def portion_bounds(batch: int, portions: int) -> list[tuple[int, int]]:
    """``portions`` contiguous ``[start, stop)`` slices of a batch of ``batch`` samples, sizes differing by at most 1."""
    if batch < 1 or not 1 <= portions <= batch:
        raise ValueError(f"portion_bounds(batch={batch}, portions={portions}): need 1 <= portions <= batch")
    q, r = divmod(batch, portions)
    bounds, start = [], 0
    for p in range(portions):
        stop = start + q + (1 if p < r else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def batch_digest(tensors: list[Tensor]) -> str:
    """A 64-bit digest (BLAKE2b, hex) of a batch's tensors: their dtypes, shapes and bytes, in order."""
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_ops(ops: Any, history: int, history_size: int) -> None:
    """Refuse a command list that is not well formed (``ValueError`` naming the command, the field and the rule).

    ``history``: the pairs held before the list runs; ``remember`` and ``forget`` in it change that as they will.
    """
    if not isinstance(ops, list) or not 1 <= len(ops) <= MAX_OPS:
        raise ValueError(f"ops must be a list of 1 to {MAX_OPS} commands")
    for i, op in enumerate(ops):
        if not isinstance(op, list) or not op or op[0] not in _ARITY:
            raise ValueError(f"ops[{i}]={str(op)[:60]}: a command is [name, args...] with name one of {sorted(_ARITY)}")
        name, args = op[0], op[1:]
        if len(args) != _ARITY[name]:
            raise ValueError(f"ops[{i}]: {name} takes {_ARITY[name]} arguments, got {len(args)}")
        if name in ("remember", "forget"):
            history = min(history + 1, history_size) if name == "remember" else 0
            continue
        if name == "close":
            if not (_is_int(args[0]) and _is_int(args[1]) and 1 <= args[0] <= args[1]):
                raise ValueError(f"ops[{i}]: close takes portions and batch, ints with 1 <= portions <= batch")
            continue
        vectors = [args[0], args[2]] if name == "axpy" else [args[0]] if name == "scale" else list(args)
        for v in vectors:
            m = _HISTORY.match(v) if isinstance(v, str) else None
            if not (isinstance(v, str) and (v in VECTORS or (m and int(m.group(2)) < history))):
                raise ValueError(f"ops[{i}]: {name} names vector {str(v)[:40]!r}; vectors are {', '.join(VECTORS)} "
                                 f"and S<i>, Y<i> for i < {history} (the history held now)")  # fmt: skip
        if name in ("axpy", "scale") and not _is_number(args[1]):
            raise ValueError(f"ops[{i}]: {name}'s coefficient {str(args[1])[:40]} must be a finite number")
        written = args[0] if name in ("axpy", "scale", "copy", "sub") else None
        if written is not None and (written[0] in "SY" or (written == "x" and name != "axpy")):
            raise ValueError(f"ops[{i}]: {name} may not write {written!r} (the history changes by remember/forget only, "
                             "x by axpy only)")  # fmt: skip


def combine(ops: list, replies: list[list[float]]) -> list[float]:
    """The scalars of a command list from every server's partial ones: sums, maxima, or server 0's (``close``)."""
    rules = [_SCALAR_OPS[op[0]] for op in ops if op[0] in _SCALAR_OPS]
    out = []
    for j, rule in enumerate(rules):
        values = [float(r[j]) for r in replies]
        out.append(sum(values) if rule == "sum" else max(values) if rule == "max" else values[0])
    return out


class ShardVectors:
    """One server's shard of every Sandblaster vector, the portions of the open step, and the commands on them.

    ``x`` is the server's parameter shard (shared storage: a pull sends it). ``history_size`` bounds the history.
    """

    def __init__(self, x: Tensor, history_size: int):
        self.x = x
        self.history_size = history_size
        self.vectors = {name: torch.zeros_like(x) for name in VECTORS if name != "x"}
        self.history: list[tuple[Tensor, Tensor]] = []  # (s, y), oldest first
        self.portions: dict[int, tuple[int, float, Tensor]] = {}  # portion -> (samples, loss, gradient) of the open step

    def _vec(self, name: str) -> Tensor:
        if name == "x":
            return self.x
        if name[0] in "SY":
            return self.history[int(name[1:])][0 if name[0] == "S" else 1]
        return self.vectors[name]

    def add_portion(self, portion: int, samples: int, loss: float, grad: Tensor) -> bool:
        """Keep the first answer for ``portion``; ``False`` (nothing kept) for a later one."""
        if portion in self.portions:
            return False
        self.portions[portion] = (samples, float(loss), grad.clone())
        return True

    def missing(self, portions: int) -> list[int]:
        return [p for p in range(portions) if p not in self.portions]

    @torch.no_grad()
    def run(self, ops: list) -> list[float]:
        """Apply ``ops`` (checked by :func:`check_ops`) in order; the scalars they produce, this shard's part."""
        out: list[float] = []
        for op in ops:
            name, args = op[0], op[1:]
            if name == "dot":
                out.append(float(torch.dot(self._vec(args[0]).double(), self._vec(args[1]).double())))
            elif name == "absmax":
                v = self._vec(args[0])
                out.append(float(v.abs().max()) if v.numel() else 0.0)
            elif name == "abssum":
                out.append(float(self._vec(args[0]).double().abs().sum()))
            elif name == "axpy":
                self._vec(args[0]).add_(self._vec(args[2]), alpha=float(args[1]))
            elif name == "scale":
                self._vec(args[0]).mul_(float(args[1]))
            elif name == "copy":
                self._vec(args[0]).copy_(self._vec(args[1]))
            elif name == "sub":
                torch.sub(self._vec(args[1]), self._vec(args[2]), out=self._vec(args[0]))
            elif name == "remember":
                if len(self.history) == self.history_size:
                    self.history.pop(0)
                self.history.append((self.vectors["s"].clone(), self.vectors["y"].clone()))
            elif name == "forget":
                self.history = []
            elif name == "close":
                out.append(self.close(*args))
        return out

    def close(self, portions: int, batch: int) -> float:
        """``g ← Σ_p (n_p / B)·G_p`` over every portion, in portion order; the batch loss ``Σ_p n_p·L_p / B``."""
        missing = self.missing(portions)
        if missing or len(self.portions) != portions:
            raise ValueError(f"close: portions {missing[:8]} have not arrived; all {portions} are needed")
        samples = sum(n for n, _, _ in self.portions.values())
        if samples != batch:
            raise ValueError(f"close: the portions hold {samples} samples; the batch has {batch}")
        g = self.vectors["g"]
        g.zero_()
        loss = 0.0
        for p in range(portions):
            n, portion_loss, grad = self.portions[p]
            g.add_(grad, alpha=n / batch)
            loss += n * portion_loss / batch
        self.portions = {}
        return loss

    def state_dict(self) -> dict:
        """The vectors and the history (never the open step's portions: a checkpoint falls between steps)."""
        return {"vectors": {k: v.clone() for k, v in self.vectors.items()},
                "history": [[s.clone(), y.clone()] for s, y in self.history]}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        vectors, history = state["vectors"], state["history"]
        like = self.x
        ok = lambda t: isinstance(t, Tensor) and t.shape == like.shape and t.dtype == like.dtype  # noqa: E731
        if set(vectors) != set(self.vectors) or not all(ok(v) for v in vectors.values()):
            raise ValueError(f"sandblaster vectors must be {sorted(self.vectors)}, each {tuple(like.shape)} {like.dtype}")
        if not isinstance(history, list) or len(history) > self.history_size or not all(
                isinstance(p, (list, tuple)) and len(p) == 2 and ok(p[0]) and ok(p[1]) for p in history):  # fmt: skip
            raise ValueError(f"sandblaster history must be at most history_size={self.history_size} pairs of shard-sized "
                             "vectors")  # fmt: skip
        for k, v in vectors.items():
            self.vectors[k].copy_(v)
        self.history = [(s.clone(), y.clone()) for s, y in history]
        self.portions = {}


class PortionDispatcher:
    """Hands out the portions of each step (server 0): in order, then up to ``backup_portions`` copies of unanswered
    ones to idle workers (the last portions first, never to a worker that already has that portion)."""

    def __init__(self, backup_portions: int):
        self.backup_portions = backup_portions
        self.closed = 0  # steps finished
        self.digests: dict[int, tuple[str, int]] = {}  # step -> (batch digest, first worker), the last DIGEST_STEPS
        self.mixed: str | None = None  # set once two workers claimed with different batches
        self._open(0, 0)

    def _open(self, step: int, portions: int) -> None:
        self.step, self.portions = step, portions
        self.issued: list[list[int]] = [[] for _ in range(portions)]
        self.answered: set[int] = set()
        self.next, self.reissued = 0, 0

    def claim(self, step: int, portions: int, worker: int, batch: str | None = None) -> tuple[int | None, bool]:
        """``(portion, is_backup)`` for ``worker`` in ``step``; ``(None, False)``: nothing left to hand out.

        ``batch``: the digest of the worker's batch (:func:`batch_digest`); ``ValueError`` if it differs from the
        first one claimed for ``step``, and for every claim after that (the job mixed batches: it cannot go on)."""
        if step > self.closed + 1:
            raise ValueError(f"step={step}: step {self.closed + 1} is the open one")
        if self.mixed is None and batch is not None:
            first = self.digests.setdefault(step, (batch, worker))
            if first[0] != batch:
                self.mixed = (f"step {step}: worker {worker}'s batch (digest {batch}) differs from worker {first[1]}'s "
                              f"(digest {first[0]}); Sandblaster's portions are slices of one batch that every worker "
                              "must hold (same sampler order, same data on every rank)")  # fmt: skip
            for old in [s for s in self.digests if s <= step - DIGEST_STEPS]:
                del self.digests[old]
        if self.mixed is not None:
            raise ValueError(self.mixed)
        if step <= self.closed:
            return None, False  # a late worker: the step is over
        if self.step != step:
            self._open(step, portions)
        if portions != self.portions:
            raise ValueError(f"portions={portions}: step {step} has {self.portions} portions")
        if self.next < self.portions:
            p, self.next = self.next, self.next + 1
            self.issued[p].append(worker)
            return p, False
        if self.reissued < self.backup_portions:
            for p in reversed(range(self.portions)):
                if p not in self.answered and worker not in self.issued[p] and len(self.issued[p]) == 1:
                    self.reissued += 1
                    self.issued[p].append(worker)
                    return p, True
        return None, False

    def answered_by(self, step: int, portion: int) -> None:
        if step == self.step:
            self.answered.add(portion)

    def finish(self) -> None:
        self.closed += 1
        self._open(0, 0)

    def outstanding(self) -> dict[int, list[int]]:
        """Unanswered portions of the open step and the workers holding them."""
        return {p: w for p, w in enumerate(self.issued) if p not in self.answered and w}


class LBFGSCoordinator:
    """``torch.optim.LBFGS.step`` (``max_iter=1``, ``line_search_fn=None``) as commands on the sharded vectors.

    ``run(ops) -> scalars`` sends one command list to every server and combines the replies (:func:`combine`). The
    scalar state (``n_iter``, ``t``, ``H``, ``ρ_i``, ``func_evals``) lives here; the vectors on the servers.
    """

    def __init__(self, dtype: torch.dtype = torch.float32):
        self.dtype = dtype
        self.n_iter, self.func_evals = 0, 0
        self.t: float | None = None
        self.h_diag = 1.0
        self.ro: list[float] = []

    def _r(self, value: float) -> float:
        """Rounded to the parameters' dtype, as torch's 0-d tensors are."""
        return float(torch.tensor(value, dtype=torch.float64).to(self.dtype))

    def step(self, run: Callable[[list], list[float]], *, lr: float, history_size: int, tolerance_grad: float,
             tolerance_change: float, portions: int, batch: int) -> dict:  # fmt: skip
        """One L-BFGS iteration on the batch whose portions are on the servers; ``{"loss", "updated"}``."""
        r = self._r
        loss, absmax, abssum = run([["close", portions, batch], ["absmax", "g"], ["abssum", "g"]])
        self.func_evals += 1
        if absmax <= tolerance_grad:  # torch returns before anything changes
            run([["finish"]])
            return {"loss": loss, "updated": False}
        self.n_iter += 1
        if self.n_iter == 1:
            prog: list = [["copy", "d", "g"], ["scale", "d", -1.0], ["forget"]]
            self.ro, self.h_diag = [], 1.0
        else:
            ys, yy = run([["sub", "y", "g", "prev"], ["copy", "s", "d"], ["scale", "s", self.t], ["dot", "y", "s"],
                          ["dot", "y", "y"]])  # fmt: skip
            ys, yy = r(ys), r(yy)
            prog = []
            if ys > 1e-10:
                prog.append(["remember"])
                if len(self.ro) == history_size:
                    self.ro.pop(0)
                self.ro.append(r(1.0 / ys))
                self.h_diag = r(ys / yy)
            m = len(self.ro)
            al = [0.0] * m
            prog += [["copy", "q", "g"], ["scale", "q", -1.0]]
            for i in reversed(range(m)):  # newest first
                (sq,) = run(prog + [["dot", f"S{i}", "q"]])
                al[i] = r(r(sq) * self.ro[i])
                prog = [["axpy", "q", -al[i], f"Y{i}"]]
            prog += [["copy", "d", "q"], ["scale", "d", self.h_diag]]
            for i in range(m):  # oldest first
                (yd,) = run(prog + [["dot", f"Y{i}", "d"]])
                be = r(r(yd) * self.ro[i])
                prog = [["axpy", "d", r(al[i] - be), f"S{i}"]]
        if self.n_iter == 1:
            inv = r(1.0 / r(abssum))
            t = r(inv * lr) if inv < 1.0 else 1.0 * lr
        else:
            t = lr
        (gtd,) = run(prog + [["copy", "prev", "g"], ["dot", "g", "d"]])
        self.t = t
        updated = not r(gtd) > -tolerance_change
        run(([["axpy", "x", t, "d"]] if updated else []) + [["finish"]])
        return {"loss": loss, "updated": updated}

    def state_dict(self) -> dict:
        return {"n_iter": self.n_iter, "func_evals": self.func_evals, "t": self.t, "h_diag": self.h_diag,
                "ro": list(self.ro)}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.n_iter, self.func_evals = int(state["n_iter"]), int(state["func_evals"])
        self.t = None if state["t"] is None else float(state["t"])
        self.h_diag, self.ro = float(state["h_diag"]), [float(v) for v in state["ro"]]
