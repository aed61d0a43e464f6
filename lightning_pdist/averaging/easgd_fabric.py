"""Synchronous EASGD (elastic averaging SGD) as a Lightning Fabric strategy."""

from __future__ import annotations

from typing import Any

from lightning_pdist.averaging.easgd import EASGDRule
from lightning_pdist.averaging.fabric import ModelAveragingFabricStrategy

__all__ = ["EASGDFabricStrategy"]


class EASGDFabricStrategy(ModelAveragingFabricStrategy):
    """EASGD: replicas are pulled towards a center variable every ``period`` steps.

    The rule of :class:`~lightning_pdist.averaging.easgd_strategy.EASGDStrategy` (Zhang, Choromanska & LeCun, NeurIPS
    2015): every ``period`` steps, with the old center, ``d_i = x_i - x̃``; ``x_i ← x_i - α·d_i``;
    ``x̃ ← x̃ + α·Σ_i d_i``. One all-reduce of ``Σ_i x_i`` per period. The consensus is the center ``x̃``.

    Args:
        period: local steps between elastic steps (4).
        alpha: ``α`` in ``(0, 1]``; ``None`` means ``0.9 / world_size``. ``alpha * world_size > 1`` is refused in
            ``fabric.setup``, when the world size is known: the center would overshoot.
        warmup_steps: leading steps that run as plain DDP (the center follows the replicas).
        **kwargs: passed to Fabric's :class:`~lightning.fabric.strategies.DDPStrategy`.
    """

    strategy_name = "easgd"
    one_rank_behaviour = "the replica and the center still pull towards each other with alpha every period"

    def __init__(self, period: int = 4, alpha: float | None = None, warmup_steps: int = 0, **kwargs: Any) -> None:
        rule = EASGDRule(period=period, alpha=alpha, warmup_steps=warmup_steps, owner=type(self).__name__)
        super().__init__(rule=rule, **kwargs)

    @property
    def alpha(self) -> float:
        """The elastic coefficient in force (resolved against the world size)."""
        return self.rule.config.alpha_for(self.rank_world[1])
