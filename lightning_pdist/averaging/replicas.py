"""What both averaging shells (the Trainer's :mod:`.strategy`, Fabric's :mod:`.fabric`) do with their rule.

:class:`RuleShell` is mixed into both: the flat view of this rank's replica that the rule works on
(:class:`~lightning_pdist.averaging.rules.Replicas`), the synchronization's counted all-reduce, and the calls into
the rule, and ``compression=`` of the model delta (BMUF, local SGD). The shells keep what differs: the lifecycle
(Trainer hooks, Fabric calls) and checkpoints.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import Module

from lightning_pdist.averaging.rules import AveragingRule
from lightning_pdist.averaging.schedule import PeriodicSchedule
from lightning_pdist.core.accounting import CommMeter
from lightning_pdist.core.collectives import all_reduce_mean_, all_reduce_sum_
from lightning_pdist.core.compression import CompressionState, Compressor
from lightning_pdist.core.flat import averaged_tensors, flatten, unflatten_into_

__all__ = ["RuleShell"]


class RuleShell:
    """The rule's side of an averaging shell. The host sets ``rule``, ``step`` and ``comm_meter`` and gives
    :meth:`replica_module`; with ``compression`` set it calls :meth:`start_compression` at setup and
    :meth:`refresh_anchor` after every synchronization and after every warm-up step."""

    rule: AveragingRule
    step: int  # optimizer (or training) steps taken: the 1-based count of the last finished step
    comm_meter: CommMeter
    compression: Compressor | None = None
    compression_state: CompressionState | None = None
    _anchor: Tensor | None = None  # with compression: the model every rank held after the last sync

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
        """The synchronization's collective (counted): ``mean_i w_i`` or ``Σ_i w_i``, as the rule's ``reduce`` says.

        With ``compression``: ``a + mean_i C(w_i − a + e_i)`` per tensor, where ``a`` is the model every rank held
        after the last synchronization and ``e_i`` this rank's residual (all NaN when some rank's was not finite).
        """
        if self.compression is None:
            reduce = all_reduce_sum_ if self.rule.reduce == "sum" else all_reduce_mean_
            return reduce(self.local_vector(), meter=self.comm_meter, kind="param_all_reduce")
        local = self.local_vector()
        tensors = averaged_tensors(self.replica_module())
        deltas = list(torch.split(local - self._anchor, [t.numel() for t in tensors]))
        out = self.compression.mean(deltas, list(range(len(deltas))), self.compression_state, None, self.comm_meter,
                                    "delta_" + self.compression.name)  # fmt: skip
        if out is None:  # some rank's replica was not finite
            return torch.full_like(local, float("nan"))
        return self._anchor + flatten(out)

    def start_compression(self) -> None:
        """A fresh compressor state and anchor (setup; nothing without ``compression``)."""
        if self.compression is not None:
            self.compression_state = self.compression.new_state()
            self.refresh_anchor()

    def refresh_anchor(self) -> None:
        """The anchor becomes the model this rank holds now (the same on every rank: right after a synchronization)."""
        if self.compression is not None:
            self._anchor = self.local_vector()

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
        if self._anchor is not None:
            state["compression_anchor"] = self._anchor.detach().cpu().clone()
        return state

    def load_pdist_state_dict(self, state: dict) -> None:
        super().load_pdist_state_dict(state)  # type: ignore[misc]
        self.step = int(state.get("step", 0))
        if self.compression is not None and "compression_anchor" in state:
            self._anchor = state["compression_anchor"].to(self.root_device)  # type: ignore[attr-defined]
        self.load_algorithm_state_dict(state.get("algorithm", {}))
        self._set_phase()
