"""SimuParallelSGD (one-shot averaging) as a Lightning Fabric strategy."""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from lightning_pdist.averaging.fabric import ModelAveragingFabricStrategy
from lightning_pdist.averaging.rules import SimuParallelRule

__all__ = ["SimuParallelSGDFabricStrategy"]


class SimuParallelSGDFabricStrategy(ModelAveragingFabricStrategy):
    """One-shot averaging: ranks train independently; ``load_consensus()`` at the end averages them once.

    The rule of :class:`~lightning_pdist.averaging.simuparallel_strategy.SimuParallelSGDStrategy` (Zinkevich et al.,
    NeurIPS 2010): every rank starts from rank 0's initialization (DDP's broadcast in ``fabric.setup``), runs SGD on
    its own shard with no communication, and the output is ``(1/k) Σ_i w_i``. Fabric has no end of ``fit``, so call
    ``fabric.strategy.load_consensus()`` when training is over (the one training all-reduce, counted).

    Args:
        **kwargs: passed to Fabric's :class:`~lightning.fabric.strategies.DDPStrategy`.
    """

    strategy_name = "simuparallel_sgd"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(rule=SimuParallelRule(owner=type(self).__name__), **kwargs)

    @override
    def load_consensus(self) -> None:
        self.rule.apply(self.reduce_replicas(), self)  # the one training all-reduce: counted
