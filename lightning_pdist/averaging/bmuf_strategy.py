"""BMUF (blockwise model-update filtering) as a Lightning strategy."""

from __future__ import annotations

from typing import Any

from lightning_pdist.averaging.bmuf import BMUFRule
from lightning_pdist.averaging.strategy import ModelAveragingStrategy
from lightning_pdist.core.compression import Compressor

__all__ = ["BMUFStrategy"]


class BMUFStrategy(ModelAveragingStrategy):
    """BMUF: local SGD whose block updates are filtered with (Nesterov) block momentum.

    At each block end, with ``A`` the model every rank started the block from
    (:mod:`lightning_pdist.averaging.bmuf` has the derivation)::

        G = mean_i(A - W_i);  Δ ← η·Δ + ζ·G;  W_g = A - Δ;  S = W_g - η·Δ (nesterov) or W_g
        every rank loads S;   A ← S

    Chen & Huo, ICASSP 2016. Validation and checkpoints see the global model ``W_g`` (with an open
    block closed early on a copy); at the end of ``fit`` every rank loads it.

    Args:
        period: local steps per block (8).
        block_momentum: ``η`` in ``[0, 1)``; ``None`` means ``1 - 1/world_size`` (CNTK's rule, which
            makes ``(1-η)·Σ`` equal the mean). Retune when the world size changes.
        block_lr: ``ζ > 0`` (1.0).
        nesterov: start blocks from the look-ahead ``W_g - η·Δ`` (True, the paper's NBM).
        warmup_steps: leading steps that run as plain DDP; the first block starts after them.
        nonfinite: ``"raise"`` (default), ``"skip_step"`` or ``"propagate"``: what every rank does when a step's
            gradients, or the replicas at a synchronization, hold NaN/Inf (see the method card).
        compression: a compressor from :mod:`lightning_pdist.compression` (e.g. ``TopK(0.01)``) for the model delta
            since the last synchronization, with error feedback per rank (``docs/algorithms/compression.md``).
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy`, e.g. ``timeout``: how long the
            rendezvous and every collective wait for a stopped or hung rank (default 30 min); then the waiting ranks
            fail naming the rank whose heartbeat stopped (method card, "Timeouts, hung and dead ranks").
    """

    strategy_name = "bmuf"
    one_rank_behaviour = (
        "with one rank G = A - W, so block momentum and block_lr still act on top of local training; "
        "the default block_momentum 1 - 1/1 = 0 with block_lr 1 is plain training"
    )
    sync_changes = "the block update changes the anchor, the block momentum and the replicas"

    def __init__(
        self,
        period: int = 8,
        block_momentum: float | None = None,
        block_lr: float = 1.0,
        nesterov: bool = True,
        warmup_steps: int = 0,
        nonfinite: str = "raise",
        compression: Compressor | None = None,
        **kwargs: Any,
    ) -> None:
        rule = BMUFRule(period=period, block_momentum=block_momentum, block_lr=block_lr, nesterov=nesterov,
                        warmup_steps=warmup_steps, owner=type(self).__name__)  # fmt: skip
        super().__init__(rule=rule, nonfinite=nonfinite, compression=compression, **kwargs)

    @property
    def block_momentum(self) -> float:
        """The block momentum in force (resolved against the world size)."""
        return self.rule.config.momentum_for(self.rank_world[1])
