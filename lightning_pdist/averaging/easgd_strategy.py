"""Synchronous EASGD (elastic averaging SGD) as a Lightning strategy."""

from __future__ import annotations

from typing import Any

from lightning_pdist.averaging.easgd import EASGDRule
from lightning_pdist.averaging.strategy import ModelAveragingStrategy

__all__ = ["EASGDStrategy"]


class EASGDStrategy(ModelAveragingStrategy):
    """EASGD: replicas are pulled towards a center variable every ``period`` steps.

    Every rank keeps its own ``x_i`` and an identical copy of the center ``x̃``. Every ``period``
    steps, with the old center: ``d_i = x_i - x̃``; ``x_i ← x_i - α·d_i``; ``x̃ ← x̃ + α·Σ_i d_i``
    (Zhang, Choromanska & LeCun, NeurIPS 2015). One all-reduce of ``Σ_i x_i`` per period.

    Validation, test, predict and the checkpoint's ``state_dict`` use the center; checkpoints also
    hold every rank's own replica so a resumed run continues exactly; at the end of ``fit`` every
    rank loads the center.

    Args:
        period: local steps between elastic steps (4).
        alpha: ``α`` in ``(0, 1]``; ``None`` means ``0.9 / world_size`` (the paper's ``β = Nα = 0.9``).
            ``alpha * world_size > 1`` is refused at setup: the center would overshoot.
        warmup_steps: leading steps that run as plain DDP (the center follows the replicas).
        nonfinite: ``"raise"`` (default), ``"skip_step"`` or ``"propagate"``: what every rank does when a step's
            gradients, or the replicas at a synchronization, hold NaN/Inf (see the method card).
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy`, e.g. ``timeout``: how long the
            rendezvous and every collective wait for a stopped or hung rank (default 30 min); then the waiting ranks
            fail naming the rank whose heartbeat stopped (method card, "Timeouts, hung and dead ranks").
    """

    strategy_name = "easgd"
    one_rank_behaviour = (
        "the replica and the center still pull towards each other with alpha every period, "
        "and validation and the output use the center"
    )
    sync_changes = "the elastic step changes the center and the replicas"

    def __init__(
        self, period: int = 4, alpha: float | None = None, warmup_steps: int = 0, nonfinite: str = "raise", **kwargs: Any
    ) -> None:
        rule = EASGDRule(period=period, alpha=alpha, warmup_steps=warmup_steps, owner=type(self).__name__)
        super().__init__(rule=rule, nonfinite=nonfinite, **kwargs)

    @property
    def alpha(self) -> float:
        """The elastic coefficient in force (resolved against the world size)."""
        return self.rule.config.alpha_for(self.rank_world[1])
