"""The validated settings of :class:`~lightning_pdist.sign.strategy.SignSGDStrategy` and its Fabric twin."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Callable

from lightning_pdist.core.accounting import CommMeter
from lightning_pdist.core.config import ConfigErrors
from lightning_pdist.core.nonfinite import check_nonfinite_policy
from lightning_pdist.sign.hooks import SCALES, ITSignSGDState, SignSGDState, it_signsgd_hook, signsgd_mv_hook
from lightning_pdist.sign.llr import DEFAULT_MAX_WEIGHT, LLRConfig
from lightning_pdist.sign.simulator import AGGREGATIONS

__all__ = ["SignSGDConfig"]

# The options that only the LLR vote reads, with their defaults (a non-default one under "majority" warns).
_LLR_DEFAULTS = {"warmup_rounds": 10, "estimator": "worker", "decay": 1.0, "max_weight": DEFAULT_MAX_WEIGHT,
                 "negative_weights": False}  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class SignSGDConfig(ConfigErrors):
    """The settings of :class:`SignSGDStrategy` (see it for each field); ``owner`` names the class in errors."""

    aggregation: str = "majority"
    warmup_rounds: int = 10
    estimator: str = "worker"
    decay: float = 1.0
    max_weight: float = DEFAULT_MAX_WEIGHT
    negative_weights: bool = False
    momentum: float = 0.0
    error_feedback: bool = False
    nonfinite: str = "raise"
    scale: str = "unit"
    find_unused_parameters: bool = False
    owner: str = "SignSGDConfig"

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            self._fail("aggregation", f"aggregation must be one of {', '.join(map(repr, AGGREGATIONS))}")
        self.llr_config()  # checks warmup_rounds, estimator, decay, max_weight, also under "majority"
        if isinstance(self.momentum, bool) or not isinstance(self.momentum, (int, float)):
            self._fail("momentum", "momentum must be a float", TypeError)
        if not 0.0 <= self.momentum < 1.0:
            self._fail("momentum", "momentum (Signum's beta) must be in [0, 1)")
        for name in ("error_feedback", "negative_weights"):
            if not isinstance(getattr(self, name), bool):
                self._fail(name, f"{name} must be a bool", TypeError)
        check_nonfinite_policy(self.nonfinite, self.owner)
        if self.scale not in SCALES:
            self._fail("scale", f"scale must be one of {', '.join(map(repr, SCALES))} ('unit': the optimizer's lr is "
                                "the sign step; 'l1': the vote is scaled by the gradient's mean magnitude, so an SGD "
                                "lr keeps its meaning)")  # fmt: skip

    def llr_config(self) -> LLRConfig:
        """The LLR vote's settings (validated even when ``aggregation="majority"`` ignores them)."""
        return LLRConfig(warmup_rounds=self.warmup_rounds, estimator=self.estimator, decay=self.decay,
                         max_weight=self.max_weight, negative_weights=self.negative_weights, owner=self.owner)  # fmt: skip

    def ignored_llr_options(self) -> list[str]:
        """LLR-only options set to non-default values under ``aggregation="majority"`` (``name=value``)."""
        if self.aggregation == "llr":
            return []
        changed = []
        for name, default in _LLR_DEFAULTS.items():
            value = getattr(self, name)
            same = math.isclose(value, default) if isinstance(default, float) else value == default
            if not same:
                changed.append(f"{name}={value!r}")
        return changed

    def make_hook(self, meter: CommMeter | None) -> tuple[SignSGDState, Callable]:
        """A fresh hook state (counted by ``meter``) and the hook that goes with it."""
        common = dict(meter=meter, momentum=float(self.momentum), error_feedback=self.error_feedback,
                      nonfinite=self.nonfinite, scale=self.scale,
                      find_unused_parameters=self.find_unused_parameters)  # fmt: skip
        if self.aggregation == "majority":
            return SignSGDState(**common), signsgd_mv_hook
        llr = {name: getattr(self, name) for name in _LLR_DEFAULTS}
        return ITSignSGDState(**common, **llr), it_signsgd_hook

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "owner"}
