"""SimuParallelSGD (one-shot averaging) as a Lightning strategy."""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from lightning_pdist.averaging.rules import SimuParallelRule
from lightning_pdist.averaging.strategy import ModelAveragingStrategy

__all__ = ["SimuParallelSGDStrategy"]


class SimuParallelSGDStrategy(ModelAveragingStrategy):
    """One-shot averaging: ranks train independently and average once, at the end of ``fit``.

    Zinkevich, Weimer, Smola & Li, *Parallelized Stochastic Gradient Descent*, NeurIPS 2010: each of
    ``k`` machines runs SGD on its own shard with no communication; the output is
    ``v = (1/k) Σ_i w_i``. Every rank starts from the same (rank 0's) initialization, which is what
    makes averaging non-convex networks meaningful at all; the guarantees are for convex losses.

    Meanwhile: validation during ``fit`` evaluates the average of the current replicas (one
    all-reduce per validation run, not counted as training traffic), and checkpoints store that
    average as ``state_dict`` plus every rank's own replica for exact resume. Training traffic is
    zero until the final average.

    Args:
        nonfinite: ``"raise"`` (default), ``"skip_step"`` or ``"propagate"``: what every rank does when a step's
            gradients, or the replicas at the final average, hold NaN/Inf (see the method card).
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy`, e.g. ``timeout``: how long the
            rendezvous and every collective wait for a stopped or hung rank (default 30 min); then the waiting ranks
            fail naming the rank whose heartbeat stopped (method card, "Timeouts, hung and dead ranks").
    """

    strategy_name = "simuparallel_sgd"
    sync_changes = "the final average replaces the replicas"

    def __init__(self, nonfinite: str = "raise", **kwargs: Any) -> None:
        super().__init__(rule=SimuParallelRule(owner=type(self).__name__), nonfinite=nonfinite, **kwargs)

    @override
    def on_train_end(self) -> None:
        if not self._finalized:
            # The one and only training communication: counted, unlike evaluation averages.
            self.synchronize()
            self.comm_meter.end_step()
            self._finalized = True
        super().on_train_end()
