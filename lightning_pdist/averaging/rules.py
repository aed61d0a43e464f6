"""The periodic-averaging rules as objects: each holds its config and state, and runs no collective of its own.

A rule is driven by a shell, the Trainer strategy (:mod:`.strategy`) or the Fabric strategy (:mod:`.fabric`), which
both call it the same way, so each update is written once. ``replicas`` is the shell's flat view of this rank's model
(parameters and floating-point buffers, :mod:`lightning_pdist.core.flat`):

* ``replicas.local_vector()``: this rank's ``w_i`` as one flat fp32 vector (a copy);
* ``replicas.load_vector(v)``: load ``v`` into the model;
* ``replicas.average_of_replicas()``: ``mean_i w_i`` over the ranks (a collective, not counted as training traffic).

At a synchronization the shell all-reduces ``w_i`` (``mean_i w_i`` or ``Σ_i w_i``, as :attr:`AveragingRule.reduce`
says; counted) and hands the result to :meth:`AveragingRule.apply`. The rules: local SGD and one-shot averaging here,
BMUF in :mod:`.bmuf`, EASGD in :mod:`.easgd`.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor

from lightning_pdist.averaging.schedule import OneShotSchedule, PeriodicSchedule

__all__ = ["AveragingRule", "LocalSGDRule", "Replicas", "SimuParallelRule"]


class Replicas(Protocol):
    """The shell's flat view of this rank's model (see the module docstring)."""

    def local_vector(self) -> Tensor: ...

    def load_vector(self, vector: Tensor) -> None: ...

    def average_of_replicas(self) -> Tensor: ...


class AveragingRule:
    """Base of the rules: the schedule, the world size, and the defaults of plain averaging.

    Args:
        schedule: when gradients are averaged (warm-up) and when the replicas synchronize.
    """

    #: What the synchronization's all-reduce of ``w_i`` computes: ``"mean"`` (``mean_i w_i``) or ``"sum"``.
    reduce = "mean"

    def __init__(self, schedule: PeriodicSchedule) -> None:
        self.schedule = schedule
        self.world_size = 1  # set by start()
        self.state: Any = None  # the run-time state (with state_dict/load_state_dict), created by start(); None: none

    def check(self, world_size: int) -> None:
        """Refuse a setting that cannot run with ``world_size`` ranks (called before anything is set up)."""

    def start(self, replicas: Replicas, world_size: int) -> None:
        """Create the run-time state from the synchronized replicas (every rank holds the same model)."""
        self.check(world_size)
        self.world_size = world_size

    def after_warmup(self, replicas: Replicas) -> None:
        """Called after each warm-up step, when all replicas are identical."""

    def replica_mean(self, combined: Tensor) -> Tensor:
        """``mean_i w_i`` from the synchronization's all-reduce result ``combined``."""
        return combined if self.reduce == "mean" else combined / self.world_size

    def apply(self, combined: Tensor, replicas: Replicas) -> None:
        """Apply the synchronization to this rank's replica, given the all-reduce result ``combined``; no collective.

        Plain averaging: every rank loads ``combined = mean_i w_i``.
        """
        replicas.load_vector(combined)

    def consensus(self, step: int, replicas: Replicas) -> Tensor:
        """The flat model the algorithm outputs if stopped after step ``step``: ``mean_i w_i`` (a collective)."""
        return replicas.average_of_replicas()

    def state_dict(self) -> dict:
        """The rule's run-time state (the same on every rank)."""
        return {} if self.state is None else self.state.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (after :meth:`start`)."""
        if self.state is not None:
            self.state.load_state_dict(state)


class LocalSGDRule(AveragingRule):
    """Local SGD: at each synchronization every rank loads ``w_i ← mean_j w_j``.

    Stich, *Local SGD converges fast and communicates little*, ICLR 2019; Lin et al., *Don't use large mini-batches,
    use local SGD*, ICLR 2020 (post-local SGD: the warm-up of the schedule). The consensus is ``mean_i w_i``.

    Args:
        period: local steps between averages.
        warmup_steps: leading steps that average gradients (exactly DDP).
        owner: the name in error messages (the strategy class).
    """

    def __init__(self, period: int = 8, warmup_steps: int = 0, owner: str = "LocalSGDRule") -> None:
        super().__init__(PeriodicSchedule(period=period, warmup_steps=warmup_steps, owner=owner))


class SimuParallelRule(AveragingRule):
    """One-shot averaging: no communication while training; the output is ``v = (1/k) Σ_i w_i``, averaged once.

    Zinkevich, Weimer, Smola & Li, *Parallelized Stochastic Gradient Descent*, NeurIPS 2010. Every rank starts from
    the same (rank 0's) initialization; the guarantees are for convex losses.
    """

    def __init__(self, owner: str = "SimuParallelRule") -> None:
        super().__init__(OneShotSchedule(owner=owner))
