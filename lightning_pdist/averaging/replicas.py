"""What both averaging shells (the Trainer's :mod:`.strategy`, Fabric's :mod:`.fabric`) do with their rule.

:class:`RuleShell` is mixed into both: the flat view of this rank's replica that the rule works on
(:class:`~lightning_pdist.averaging.rules.Replicas`), the synchronization's counted all-reduce, and the calls into
the rule. The shells keep what differs: the lifecycle (Trainer hooks, Fabric calls) and checkpoints.
"""

from __future__ import annotations

from torch import Tensor
from torch.nn import Module

from lightning_pdist.averaging.rules import AveragingRule
from lightning_pdist.averaging.schedule import PeriodicSchedule
from lightning_pdist.core.accounting import CommMeter
from lightning_pdist.core.collectives import all_reduce_mean_, all_reduce_sum_
from lightning_pdist.core.flat import averaged_tensors, flatten, unflatten_into_

__all__ = ["RuleShell"]


class RuleShell:
    """The rule's side of an averaging shell. The host sets ``rule``, ``step`` and ``comm_meter`` and gives
    :meth:`replica_module`."""

    rule: AveragingRule
    step: int  # optimizer (or training) steps taken: the 1-based count of the last finished step
    comm_meter: CommMeter

    def replica_module(self) -> Module:
        """The module whose parameters and float buffers are averaged."""
        raise NotImplementedError

    @property
    def schedule(self) -> PeriodicSchedule:
        """When gradients are averaged (warm-up) and when the replicas synchronize (the rule's)."""
        return self.rule.schedule

    # ------------------------------------------------------------------ flat views (Replicas)
    def local_vector(self) -> Tensor:
        """This rank's parameters and float buffers as one flat fp32 vector (a copy)."""
        return flatten(averaged_tensors(self.replica_module()))

    def load_vector(self, vector: Tensor) -> None:
        unflatten_into_(vector, averaged_tensors(self.replica_module()))

    def average_of_replicas(self, count: bool = False) -> Tensor:
        """``mean_i w_i`` over the ranks; counted in the step's bytes when ``count`` is set."""
        return all_reduce_mean_(self.local_vector(), meter=self.comm_meter if count else None, kind="param_all_reduce")

    # ------------------------------------------------------------------ the rule
    def reduce_replicas(self) -> Tensor:
        """The synchronization's collective (counted): ``mean_i w_i`` or ``Σ_i w_i``, as the rule's ``reduce`` says."""
        reduce = all_reduce_sum_ if self.rule.reduce == "sum" else all_reduce_mean_
        return reduce(self.local_vector(), meter=self.comm_meter, kind="param_all_reduce")

    def consensus(self) -> Tensor:
        """The flat consensus model: what the algorithm outputs if stopped now (collective: every rank calls it)."""
        return self.rule.consensus(self.step, self)

    def algorithm_state_dict(self) -> dict:
        return self.rule.state_dict()

    def load_algorithm_state_dict(self, state: dict) -> None:
        self.rule.load_state_dict(state)

    def _set_phase(self) -> None:
        """Configure gradient all-reduce and buffer broadcast for the *next* optimizer step (the shell's)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ checkpoints (cooperative: the shell's base next)
    def pdist_state_dict(self) -> dict:
        """The base's state plus the step count and the rule's state (the same on every rank)."""
        state = super().pdist_state_dict()  # type: ignore[misc]
        state.update(step=self.step, algorithm=self.algorithm_state_dict())
        return state

    def load_pdist_state_dict(self, state: dict) -> None:
        super().load_pdist_state_dict(state)  # type: ignore[misc]
        self.step = int(state.get("step", 0))
        self.load_algorithm_state_dict(state.get("algorithm", {}))
        self._set_phase()
