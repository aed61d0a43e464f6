"""Server-side rules of parameter-server training, as pure single-process pieces.

Each piece decides *what* a parameter server does with the gradients that reach it; the transport and
the processes live elsewhere. Everything here is deterministic given the order in which pushes and pulls
arrive, so a test can script an arrival order and compare with equations written out by hand.

* :func:`dc_asgd_gradient`, :class:`DelayCompensation`: delay-compensated ASGD (Zheng et al., ICML 2017).
* :class:`BackupWorkerAggregator`: synchronous SGD with backup workers (Chen et al., 2016).
* :class:`SSPClock`: stale synchronous parallel gating (Ho et al., NIPS 2013).
* :func:`gradient_staleness`, :class:`StalenessTracker`: how many server versions old an applied
  gradient is (the asynchronous-SGD staleness ``τ``, ``algorithms-reference.md`` B7).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = [
    "BackupWorkerAggregator",
    "DelayCompensation",
    "DroppedGradient",
    "SSPClock",
    "StalenessTracker",
    "dc_asgd_gradient",
    "gradient_staleness",
]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_num_workers(owner: str, num_workers: object) -> None:
    if not _is_int(num_workers):
        raise TypeError(f"{owner}(num_workers={num_workers!r}): num_workers must be an int")
    if num_workers < 1:
        raise ValueError(f"{owner}(num_workers={num_workers}): num_workers must be >= 1")


def _check_worker(owner: str, worker: object, num_workers: int) -> None:
    if not _is_int(worker):
        raise TypeError(f"{owner}(worker={worker!r}): worker must be an int")
    if not 0 <= worker < num_workers:
        raise ValueError(f"{owner}(worker={worker}): worker must be in [0, {num_workers})")


def _check_lam(owner: str, lam: object) -> None:
    if not isinstance(lam, (int, float)) or isinstance(lam, bool):
        raise TypeError(f"{owner}(lam={lam!r}): lam must be a float")
    if not lam >= 0:
        raise ValueError(f"{owner}(lam={lam}): lam must be >= 0")


# ---- DC-ASGD ---------------------------------------------------------------------------------------


def dc_asgd_gradient(g: Tensor, w: Tensor, w_bak: Tensor, lam: float) -> Tensor:
    """The delay-compensated gradient of DC-ASGD (Zheng et al., ICML 2017, arXiv 1609.08326).

    Worker ``m`` computed ``g`` at the parameters ``w_bak(m)`` it last pulled; by the time the gradient
    reaches the server the parameters are ``w``. A first-order Taylor step, with the Hessian replaced by
    the cheap diagonal approximation ``λ·g⊙g``, moves the gradient to where it is applied::

        g̃ = g + λ · g ⊙ g ⊙ (w - w_bak(m))
        w ← w - η · g̃                       (then w_bak(m) ← w when m pulls)

    ``w_bak`` must be the backup of the *worker* that sent ``g``: the server keeps one per worker
    (:class:`DelayCompensation`). MXNet's ``DCASGD`` optimizer keeps one previous weight per key instead,
    which is this rule only when a single worker pushes to that key; do not copy it.

    Args:
        g: the worker's gradient.
        w: the server's current parameters (same shape as ``g``).
        w_bak: the parameters the worker computed ``g`` at (same shape).
        lam: ``λ >= 0``; 0 is plain ASGD. The paper's constant variant (DC-ASGD-c) and MXNet use 0.04;
            the adaptive variant scales ``λ_0 ≈ 2`` by ``1 / sqrt(mean square of g)``.

    Returns:
        ``g̃``, a new tensor.
    """
    _check_lam("dc_asgd_gradient", lam)
    for arg, value in (("g", g), ("w", w), ("w_bak", w_bak)):
        if not isinstance(value, Tensor):
            raise TypeError(f"dc_asgd_gradient({arg}={type(value).__name__}): {arg} must be a torch.Tensor")
    if not g.shape == w.shape == w_bak.shape:
        raise ValueError(
            f"dc_asgd_gradient(g={tuple(g.shape)}, w={tuple(w.shape)}, w_bak={tuple(w_bak.shape)}): "
            "g, w and w_bak must have the same shape"
        )
    return g + lam * g * g * (w - w_bak)


@dataclass(eq=False)
class DelayCompensation:
    """DC-ASGD state on one server (or shard): one parameter backup per worker.

    The server calls :meth:`record_pull` whenever worker ``m`` pulls (``w_bak(m) ← w``) and
    :meth:`compensate` on each of its pushes. Memory: ``num_workers`` copies of the shard.

    Attributes:
        num_workers: workers that push to this server.
        lam: ``λ >= 0`` (see :func:`dc_asgd_gradient`).
        backups: worker -> parameters it last pulled.
    """

    num_workers: int
    lam: float
    backups: dict[int, Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_num_workers("DelayCompensation", self.num_workers)
        _check_lam("DelayCompensation", self.lam)

    @classmethod
    def starting_from(cls, w: Tensor, num_workers: int, lam: float) -> "DelayCompensation":
        """State at the start of training: every worker holds the initial parameters ``w``."""
        state = cls(num_workers=num_workers, lam=lam)
        for worker in range(num_workers):
            state.record_pull(worker, w)
        return state

    def record_pull(self, worker: int, w: Tensor) -> None:
        """Worker ``worker`` has just pulled ``w``: keep a copy as its backup."""
        _check_worker("DelayCompensation.record_pull", worker, self.num_workers)
        self.backups[worker] = w.detach().clone()

    def compensate(self, worker: int, g: Tensor, w: Tensor) -> Tensor:
        """``g + λ·g⊙g⊙(w - w_bak(worker))`` for a gradient ``worker`` pushed, ``w`` the current parameters."""
        _check_worker("DelayCompensation.compensate", worker, self.num_workers)
        if worker not in self.backups:
            raise RuntimeError(
                f"DelayCompensation.compensate(worker={worker}): worker {worker} has never pulled; "
                "record_pull (or starting_from) must come before its first push"
            )
        return dc_asgd_gradient(g, w, self.backups[worker], self.lam)

    def state_dict(self) -> dict:
        return {"lam": self.lam, "backups": {m: b.clone() for m, b in self.backups.items()}}

    def load_state_dict(self, state: dict) -> None:
        _check_lam("DelayCompensation.load_state_dict", state["lam"])
        self.lam = state["lam"]
        self.backups = {int(m): b.clone() for m, b in state["backups"].items()}


# ---- backup workers ------------------------------------------------------------------------------


@dataclass(frozen=True)
class DroppedGradient:
    """A gradient the aggregator refused: ``worker`` pushed it for ``step`` while ``open_step`` was open."""

    worker: int
    step: int
    open_step: int

    @property
    def reason(self) -> str:
        """``"late"`` (its step has closed) or ``"early"`` (its step has not opened)."""
        return "late" if self.step < self.open_step else "early"


@dataclass(eq=False)
class BackupWorkerAggregator:
    """Synchronous SGD with backup workers (Chen, Pan, Monga, Bengio, Jozefowicz 2016, arXiv 1604.00981).

    ``num_workers = N`` workers compute step ``t``; the server averages the first ``N - b`` gradients
    tagged with step ``t`` that arrive, applies the mean once, and opens step ``t + 1``. The ``b``
    slowest gradients of the step arrive after it closed and are dropped by step id, as is any gradient
    whose step id is not the open one::

        mean_t = (1 / (N - b)) · Σ_{first N - b arrivals m with step t} g_m

    ``b = 0`` is plain synchronous SGD. The effective batch is ``(N - b)`` worker batches. Chen et al.
    found a few percent of backups (e.g. 50 + 3 workers) enough to cut the straggler tail.

    Attributes:
        num_workers: ``N``, workers that push every step.
        backup_workers: ``b`` in ``[0, N - 1]``.
        step: the open step ``t``.
        num_dropped: gradients dropped so far.
        last_contributors: workers whose gradients made up the last closed step, in arrival order.
    """

    num_workers: int
    backup_workers: int = 0
    step: int = 0
    num_dropped: int = 0
    last_contributors: tuple[int, ...] = ()
    _dropped: list[DroppedGradient] = field(default_factory=list, init=False, repr=False)
    _arrived: list[int] = field(default_factory=list, init=False, repr=False)
    _sum: Tensor | None = field(default=None, init=False, repr=False)  # running sum of the open step

    def __post_init__(self) -> None:
        owner = "BackupWorkerAggregator"
        _check_num_workers(owner, self.num_workers)
        if not _is_int(self.backup_workers):
            raise TypeError(f"{owner}(backup_workers={self.backup_workers!r}): backup_workers must be an int")
        if not 0 <= self.backup_workers < self.num_workers:
            raise ValueError(
                f"{owner}(num_workers={self.num_workers}, backup_workers={self.backup_workers}): backup_workers "
                f"must be in [0, num_workers - 1] = [0, {self.num_workers - 1}] (a step needs one gradient)"
            )
        if not _is_int(self.step) or self.step < 0:
            raise ValueError(f"{owner}(step={self.step!r}): step must be an int >= 0")

    @property
    def quorum(self) -> int:
        """``N - b``, the gradients that close a step."""
        return self.num_workers - self.backup_workers

    @property
    def arrived(self) -> tuple[int, ...]:
        """Workers whose gradient for the open step has arrived, in arrival order."""
        return tuple(self._arrived)

    @property
    def dropped(self) -> tuple[DroppedGradient, ...]:
        """Dropped gradients not yet taken by :meth:`drain_dropped`, in arrival order."""
        return tuple(self._dropped)

    def drain_dropped(self) -> list[DroppedGradient]:
        """Return and forget the dropped gradients recorded so far (for logging; ``num_dropped`` stays)."""
        out, self._dropped = self._dropped, []
        return out

    @torch.no_grad()
    def push(self, worker: int, step: int, grad: Tensor) -> Tensor | None:
        """Take the gradient ``worker`` computed for ``step``.

        Returns:
            The mean of the step's ``N - b`` gradients when this push closes the open step (the step then
            advances), otherwise ``None``: the gradient was kept, or dropped because ``step`` is not the
            open step (see :attr:`dropped`).

        Raises:
            ValueError: ``worker`` outside ``[0, N)``, a second gradient from ``worker`` for the open
                step, or a gradient whose shape differs from the step's first one.
        """
        owner = "BackupWorkerAggregator.push"
        _check_worker(owner, worker, self.num_workers)
        if not _is_int(step):
            raise TypeError(f"{owner}(step={step!r}): step must be an int")
        if not isinstance(grad, Tensor):
            raise TypeError(f"{owner}(grad={type(grad).__name__}): grad must be a torch.Tensor")
        if step != self.step:
            self._dropped.append(DroppedGradient(worker=worker, step=step, open_step=self.step))
            self.num_dropped += 1
            return None
        if worker in self._arrived:
            raise ValueError(
                f"{owner}(worker={worker}, step={step}): worker {worker} already pushed a gradient for step {step}; "
                "a worker pushes once per step"
            )
        if self._sum is None:
            self._sum = grad.detach().clone()
        elif grad.shape != self._sum.shape:
            raise ValueError(
                f"{owner}(worker={worker}, grad={tuple(grad.shape)}): grad must have the step's shape "
                f"{tuple(self._sum.shape)}"
            )
        else:
            self._sum.add_(grad)  # summed in arrival order: deterministic
        self._arrived.append(worker)
        if len(self._arrived) < self.quorum:
            return None
        mean = self._sum.div_(self.quorum)
        self.last_contributors = tuple(self._arrived)
        self._arrived, self._sum = [], None
        self.step += 1
        return mean

    def state_dict(self) -> dict:
        """The open step and the drop counter; only between steps (no gradient of the open step held)."""
        if self._arrived:
            raise RuntimeError(
                f"BackupWorkerAggregator.state_dict(): step {self.step} holds gradients of workers "
                f"{self._arrived}; take the state between steps"
            )
        return {"step": self.step, "num_dropped": self.num_dropped}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.num_dropped = int(state["step"]), int(state["num_dropped"])
        self._arrived, self._sum, self._dropped, self.last_contributors = [], None, [], ()


# ---- SSP -----------------------------------------------------------------------------------------------


@dataclass
class SSPClock:
    """Stale synchronous parallel gating (Ho, Cipar, Cui, et al., NIPS 2013).

    Every worker has a clock ``c_m``, the number of iterations it has finished. A worker may start
    iteration (clock) ``c`` only if no active worker lags more than ``s`` clocks behind::

        may_start(m, c)  ⇔  c - min_q c_q <= s

    so reads at clock ``c`` contain every update from clocks ``<= c - s - 1``. ``s = 0`` is bulk
    synchronous (BSP): all workers move in lockstep. A very large ``s`` is fully asynchronous. The bound
    is on iterations, not wall time. A retired worker (finished, or dead) no longer holds others back.

    Attributes:
        num_workers: workers sharing the clock.
        staleness: ``s >= 0``. Ho et al. use small bounds (a few clocks); larger ones trade
            per-iteration progress for less waiting.
        clocks: finished iterations per worker.
        retired: workers that left.
    """

    num_workers: int
    staleness: int = 0
    clocks: list[int] = field(default_factory=list)
    retired: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        _check_num_workers("SSPClock", self.num_workers)
        if not _is_int(self.staleness):
            raise TypeError(f"SSPClock(staleness={self.staleness!r}): staleness must be an int")
        if self.staleness < 0:
            raise ValueError(f"SSPClock(staleness={self.staleness}): staleness must be >= 0")
        if not self.clocks:
            self.clocks = [0] * self.num_workers
        if len(self.clocks) != self.num_workers:
            raise ValueError(
                f"SSPClock(clocks={self.clocks}): clocks must hold one entry per worker ({self.num_workers})"
            )

    @property
    def min_clock(self) -> int | None:
        """The slowest active worker's clock (``None`` once every worker retired)."""
        active = [c for m, c in enumerate(self.clocks) if m not in self.retired]
        return min(active) if active else None

    def _resolve(self, owner: str, worker: int, clock: int | None) -> int:
        _check_worker(owner, worker, self.num_workers)
        if worker in self.retired:
            raise RuntimeError(f"{owner}(worker={worker}): worker {worker} has retired")
        if clock is None:
            return self.clocks[worker]
        if not _is_int(clock):
            raise TypeError(f"{owner}(clock={clock!r}): clock must be an int or None")
        if clock < self.clocks[worker]:
            raise ValueError(
                f"{owner}(worker={worker}, clock={clock}): clock must be >= the worker's clock {self.clocks[worker]}"
            )
        return clock

    def waiting_for(self, worker: int, clock: int | None = None) -> tuple[int, ...]:
        """Active workers that ``worker`` must wait for before starting ``clock`` (its own by default)."""
        clock = self._resolve("SSPClock.waiting_for", worker, clock)
        return tuple(
            q for q, c in enumerate(self.clocks) if q not in self.retired and clock - c > self.staleness
        )

    def may_start(self, worker: int, clock: int | None = None) -> bool:
        """Whether ``worker`` may start iteration ``clock`` (its own clock by default) now."""
        clock = self._resolve("SSPClock.may_start", worker, clock)
        return clock - self.min_clock <= self.staleness

    def advance(self, worker: int) -> int:
        """``worker`` finished its iteration: move its clock on by one and return the new clock.

        Raises:
            RuntimeError: the worker was not allowed to start that iteration (a gating bug upstream).
        """
        blockers = self.waiting_for(worker)
        if blockers:
            raise RuntimeError(
                f"SSPClock.advance(worker={worker}): worker {worker} at clock {self.clocks[worker]} may not have "
                f"started it: workers {list(blockers)} are more than staleness={self.staleness} clocks behind"
            )
        self.clocks[worker] += 1
        return self.clocks[worker]

    def retire(self, worker: int) -> None:
        """``worker`` has left (finished or died): it no longer holds the others back."""
        _check_worker("SSPClock.retire", worker, self.num_workers)
        self.retired.add(worker)

    def state_dict(self) -> dict:
        return {"staleness": self.staleness, "clocks": list(self.clocks), "retired": sorted(self.retired)}

    def load_state_dict(self, state: dict) -> None:
        self.staleness, self.clocks, self.retired = state["staleness"], list(state["clocks"]), set(state["retired"])


# ---- staleness -----------------------------------------------------------------------------------------


def gradient_staleness(applied_version: int, pulled_version: int) -> int:
    """Staleness ``τ`` of an applied gradient, in server versions: ``applied_version - pulled_version``.

    ``pulled_version`` is the server version the worker computed the gradient on (its last pull);
    ``applied_version`` the version the gradient is applied to. ``τ = 0`` is a fresh gradient (always,
    in synchronous mode); asynchronous SGD with ``N`` workers averages ``τ ≈ N - 1``.
    """
    for arg, value in (("applied_version", applied_version), ("pulled_version", pulled_version)):
        if not _is_int(value):
            raise TypeError(f"gradient_staleness({arg}={value!r}): {arg} must be an int")
    if not 0 <= pulled_version <= applied_version:
        raise ValueError(
            f"gradient_staleness(applied_version={applied_version}, pulled_version={pulled_version}): "
            "versions must satisfy 0 <= pulled_version <= applied_version"
        )
    return applied_version - pulled_version


@dataclass
class StalenessTracker:
    """Server version counter plus the version each worker last pulled; yields each update's staleness.

    Version 0 is the initial model, which every worker starts from. Each applied update bumps the
    version by one.

    Attributes:
        num_workers: workers that pull and push.
        version: the server's current version (updates applied so far).
        pulled: worker -> version it last pulled.
    """

    num_workers: int
    version: int = 0
    pulled: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_num_workers("StalenessTracker", self.num_workers)
        if not self.pulled:
            self.pulled = {m: 0 for m in range(self.num_workers)}

    def record_pull(self, worker: int) -> int:
        """``worker`` pulls the current parameters; returns the version it got."""
        _check_worker("StalenessTracker.record_pull", worker, self.num_workers)
        self.pulled[worker] = self.version
        return self.version

    def record_apply(self, worker: int) -> int:
        """Apply one update from ``worker``: returns its staleness, then bumps the version."""
        _check_worker("StalenessTracker.record_apply", worker, self.num_workers)
        tau = gradient_staleness(self.version, self.pulled[worker])
        self.version += 1
        return tau

    def state_dict(self) -> dict:
        return {"version": self.version, "pulled": dict(self.pulled)}

    def load_state_dict(self, state: dict) -> None:
        self.version, self.pulled = int(state["version"]), {int(m): int(v) for m, v in state["pulled"].items()}
