"""Synchronous elastic averaging SGD (EASGD).

Zhang, Choromanska & LeCun, *Deep learning with Elastic Averaging SGD*, NeurIPS 2015 (eqs. 5–6
of the synchronous variant, with the elastic step taken every ``period`` local steps).

Every rank keeps its own parameters ``x_i`` and an identical copy of the center ``x̃``. Every
``period`` steps, using the *old* center on both sides (a simultaneous update)::

    d_i = x_i - x̃
    x_i ← x_i - α·d_i                # each replica is pulled towards the center
    x̃  ← x̃ + α·Σ_i d_i  = (1 - Nα)·x̃ + Nα·mean_i x_i

so one all-reduce of ``Σ_i x_i`` per period suffices. The center is the model to evaluate and
to ship.

Advice per hyperparameter:
    * ``alpha`` ``α``: the paper fixes ``β = Nα = 0.9`` and sets ``α = β/N``, so the default is
      ``0.9 / world_size``. ``Nα > 1`` makes the center overshoot the mean of the replicas
      (its coefficient ``1 - Nα`` turns negative) and the round-robin analysis loses stability.
    * ``period`` ``τ``: the paper sweeps {1, 4, 16, 64}; 4 keeps replicas close on small data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_pdist.averaging.rules import AveragingRule, Replicas
from lightning_pdist.averaging.schedule import PeriodicSchedule

__all__ = ["EASGDConfig", "EASGDRule", "EASGDState", "easgd_update_"]


@dataclass(frozen=True)
class EASGDConfig:
    """EASGD hyperparameters; checks itself on construction and against the world size.

    ``alpha=None`` resolves to ``0.9 / world_size`` (the paper's ``β = Nα = 0.9``).
    """

    alpha: float | None = None
    owner: str = "EASGDConfig"

    def __post_init__(self) -> None:
        if self.alpha is not None and (isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float))):
            raise TypeError(f"{self.owner}(alpha={self.alpha!r}): alpha must be a number or None")
        if self.alpha is not None and not (0.0 < self.alpha <= 1.0):
            raise ValueError(f"{self.owner}(alpha={self.alpha}): alpha must be in (0, 1] or None")

    def alpha_for(self, world_size: int) -> float:
        """The elastic coefficient for ``world_size`` ranks; refuses ``alpha·world_size > 1``."""
        if self.alpha is None:
            return 0.9 / world_size
        if self.alpha * world_size > 1.0:
            raise ValueError(
                f"{self.owner}(alpha={self.alpha}): alpha * world_size = {self.alpha * world_size:g} must be <= 1; "
                f"the center update x̃ ← (1 - Nα)·x̃ + Nα·mean(x_i) then overshoots the replicas' mean and "
                f"is unstable. Use alpha <= {1.0 / world_size:g} (default 0.9 / world_size)"
            )
        return float(self.alpha)


@dataclass
class EASGDState:
    """Run-time state of EASGD: the center ``x̃`` as a flat fp32 vector."""

    center: Tensor

    def state_dict(self) -> dict:
        return {"center": self.center.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.center.copy_(state["center"])


@torch.no_grad()
def easgd_update_(local: Tensor, center: Tensor, sum_local: Tensor, world_size: int, alpha: float) -> None:
    """One elastic step, in place on ``local`` (``x_i``) and ``center`` (``x̃``).

    Args:
        local: this rank's flat parameters ``x_i``.
        center: the center ``x̃`` (identical on every rank).
        sum_local: ``Σ_i x_i`` over the ranks (from an all-reduce).
        world_size: ``N``.
        alpha: ``α``, the elastic coefficient.
    """
    diff = local - center  # d_i, with the old center
    total_diff = sum_local - world_size * center  # Σ_i d_i
    local.sub_(diff, alpha=alpha)
    center.add_(total_diff, alpha=alpha)


class EASGDRule(AveragingRule):
    """EASGD as a rule object: the elastic step of :func:`easgd_update_` every ``period`` steps.

    The all-reduce gives ``Σ_i x_i``; with the old center on both sides::

        d_i = x_i - x̃;   x_i ← x_i - α·d_i;   x̃ ← x̃ + α·Σ_i d_i

    The consensus is the center ``x̃`` (no collective). During warm-up the center follows the (identical) replicas
    (Zhang, Choromanska & LeCun, NeurIPS 2015). ``α·N > 1`` is refused by :meth:`check`.

    Args:
        period: local steps between elastic steps.
        alpha: ``α`` in ``(0, 1]``; ``None`` means ``0.9 / N``.
        warmup_steps: leading steps that average gradients (the center follows the replicas).
        owner: the name in error messages (the strategy class).
    """

    reduce = "sum"

    def __init__(self, period: int = 4, alpha: float | None = None, warmup_steps: int = 0,
                 owner: str = "EASGDRule") -> None:  # fmt: skip
        super().__init__(PeriodicSchedule(period=period, warmup_steps=warmup_steps, owner=owner))
        self.config = EASGDConfig(alpha=alpha, owner=owner)
        self.state: EASGDState | None = None

    @property
    def alpha(self) -> float:
        """``α`` for this run's world size (``0.9 / N`` by default)."""
        return self.config.alpha_for(self.world_size)

    def check(self, world_size: int) -> None:
        self.config.alpha_for(world_size)  # refuses alpha * world_size > 1

    def start(self, replicas: Replicas, world_size: int) -> None:
        super().start(replicas, world_size)
        self.state = EASGDState(center=replicas.local_vector())

    def after_warmup(self, replicas: Replicas) -> None:
        self.state.center.copy_(replicas.local_vector())

    def apply(self, combined: Tensor, replicas: Replicas) -> None:
        local = replicas.local_vector()
        easgd_update_(local, self.state.center, combined, self.world_size, self.alpha)  # combined = Σ_i x_i
        replicas.load_vector(local)

    def consensus(self, step: int, replicas: Replicas) -> Tensor:
        return self.state.center.clone()
