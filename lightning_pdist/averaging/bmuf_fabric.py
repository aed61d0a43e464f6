"""BMUF (blockwise model-update filtering) as a Lightning Fabric strategy."""

from __future__ import annotations

from typing import Any

from lightning_pdist.averaging.bmuf import BMUFRule
from lightning_pdist.averaging.fabric import ModelAveragingFabricStrategy
from lightning_pdist.core.compression import Compressor

__all__ = ["BMUFFabricStrategy"]


class BMUFFabricStrategy(ModelAveragingFabricStrategy):
    """BMUF: local SGD whose block updates are filtered with (Nesterov) block momentum.

    The rule of :class:`~lightning_pdist.averaging.bmuf_strategy.BMUFStrategy` (Chen & Huo, ICASSP 2016), at each block end
    (:mod:`lightning_pdist.averaging.bmuf` has the derivation)::

        G = mean_i(A - W_i);  Δ ← η·Δ + ζ·G;  W_g = A - Δ;  S = W_g - η·Δ (nesterov) or W_g
        every rank loads S;   A ← S

    The consensus (``consensus_weights``, ``load_consensus``, the saved model) is the global model ``W_g``, with an
    open block closed early on a copy.

    Args:
        period: local steps per block (8).
        block_momentum: ``η`` in ``[0, 1)``; ``None`` means ``1 - 1/world_size``.
        block_lr: ``ζ > 0`` (1.0).
        nesterov: start blocks from the look-ahead ``W_g - η·Δ`` (True, the paper's NBM).
        warmup_steps: leading steps that run as plain DDP; the first block starts after them.
        compression: a compressor from :mod:`lightning_pdist.compression` (e.g. ``TopK(0.01)``) for the model delta
            since the last synchronization, with error feedback per rank (``docs/algorithms/compression.md``).
        **kwargs: passed to Fabric's :class:`~lightning.fabric.strategies.DDPStrategy`.
    """

    strategy_name = "bmuf"
    one_rank_behaviour = "block momentum and block_lr still act on top of local training"

    def __init__(
        self,
        period: int = 8,
        block_momentum: float | None = None,
        block_lr: float = 1.0,
        nesterov: bool = True,
        warmup_steps: int = 0,
        compression: Compressor | None = None,
        **kwargs: Any,
    ) -> None:
        rule = BMUFRule(period=period, block_momentum=block_momentum, block_lr=block_lr, nesterov=nesterov,
                        warmup_steps=warmup_steps, owner=type(self).__name__)  # fmt: skip
        super().__init__(rule=rule, compression=compression, **kwargs)

    @property
    def block_momentum(self) -> float:
        """The block momentum in force (resolved against the world size)."""
        return self.rule.config.momentum_for(self.rank_world[1])
