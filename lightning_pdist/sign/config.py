"""The sign family's algorithm object, shared by the Trainer (:mod:`.strategy`) and Fabric (:mod:`.fabric`) strategies.

:class:`SignSGDConfig` holds the settings and checks them; it builds the vote's hook state (:mod:`.hooks`), which
holds the run-time state (LLR statistics, EF residual, Signum momentum, round counters), and words the advice both
strategies give (options the majority vote ignores, an SGD-sized ``lr``). No Lightning here: the strategies (and
:class:`~lightning_pdist.sign.arguments.SignSGDArguments`, their shared constructor) warn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterable

from torch.nn import Parameter
from torch.optim import Optimizer

from lightning_pdist.core.accounting import CommMeter
from lightning_pdist.core.config import ConfigErrors
from lightning_pdist.core.nonfinite import check_nonfinite_policy
from lightning_pdist.sign.hooks import SCALES, ITSignSGDState, SignSGDState, it_signsgd_hook, signsgd_mv_hook
from lightning_pdist.sign.llr import DEFAULT_MAX_WEIGHT, LLRConfig
from lightning_pdist.sign.simulator import AGGREGATIONS

__all__ = ["MAX_SIGN_STEP", "REGISTERED_NAMES", "SUGGESTED_SIGN_STEP", "SignSGDConfig"]

#: The registered names: ``{name: (aggregation, description)}`` (Trainer and Fabric alike).
REGISTERED_NAMES = {"signsgd_mv": ("majority", "signSGD with majority vote"), "it_signsgd": ("llr", "IT-signSGD")}
#: Above this optimizer ``lr`` the unit-scaled vote warns: ``lr`` is the sign step δ, and the papers' δ are 1e-4 … 5e-3.
MAX_SIGN_STEP = 0.01
#: The sign step the warning suggests: Adam's default lr, itself a per-coordinate step (see the method card).
SUGGESTED_SIGN_STEP = 1e-3

# The options that only the LLR vote reads, with their defaults (a non-default one under "majority" warns).
_LLR_DEFAULTS = {"warmup_rounds": 10, "estimator": "worker", "decay": 1.0, "max_weight": DEFAULT_MAX_WEIGHT,
                 "negative_weights": False}  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class SignSGDConfig(ConfigErrors):
    """The settings of the sign strategies (Trainer and Fabric); checks itself on construction.

    See :class:`~lightning_pdist.sign.strategy.SignSGDStrategy` for each field; ``owner`` names the class in error
    messages.
    """

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
        return LLRConfig(
            warmup_rounds=self.warmup_rounds,
            estimator=self.estimator,
            decay=self.decay,
            max_weight=self.max_weight,
            negative_weights=self.negative_weights,
            owner=self.owner,
        )

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

    @classmethod
    def of_strategy(cls, owner: str, ddp_kwargs: dict[str, Any], **settings: Any) -> "SignSGDConfig":
        """The settings of strategy ``owner``; DDP's ``find_unused_parameters`` or ``static_graph`` in ``ddp_kwargs``
        make the vote track which tensors take part (DDP leaves parameters out of a backward pass only with these)."""
        watch = bool(ddp_kwargs.get("find_unused_parameters")) or bool(ddp_kwargs.get("static_graph"))
        return cls(**settings, find_unused_parameters=watch, owner=owner)

    def ignored_llr_warning(self) -> str | None:
        """The warning for LLR-only options set under ``aggregation="majority"`` (None: nothing to say)."""
        ignored = self.ignored_llr_options()
        if not ignored:
            return None
        return (f"{self.owner}(aggregation='majority', {', '.join(ignored)}): these options belong to the LLR vote "
                "(aggregation='llr') and are ignored by the majority vote.")  # fmt: skip

    def make_hook(self, meter: CommMeter | None,
                  parameters: Iterable[Parameter] | None = None) -> tuple[SignSGDState, Callable]:  # fmt: skip
        """A fresh hook state (counted by ``meter``) and the hook that goes with it.

        With ``find_unused_parameters``, the state watches ``parameters`` (the DDP module's, before its first backward)
        to learn which tensors take part in each vote.
        """
        common = dict(meter=meter, momentum=float(self.momentum), error_feedback=self.error_feedback,
                      nonfinite=self.nonfinite, scale=self.scale,
                      find_unused_parameters=self.find_unused_parameters)  # fmt: skip
        if self.aggregation == "majority":
            state, hook = SignSGDState(**common), signsgd_mv_hook
        else:
            llr = {name: getattr(self, name) for name in _LLR_DEFAULTS}
            state, hook = ITSignSGDState(**common, **llr), it_signsgd_hook
        if self.find_unused_parameters and parameters is not None:
            state.watch(parameters)
        return state, hook

    def sign_step_warning(self, optimizer: Optimizer) -> str | None:
        """The warning when ``optimizer``'s lr, which the unit-scaled vote makes the sign step δ, is an SGD-sized lr."""
        if self.scale != "unit" or self.error_feedback:
            return None  # the scaled vote is in gradient units: the lr keeps its SGD meaning
        lr = max((float(g.get("lr", 0.0)) for g in optimizer.param_groups), default=0.0)
        if lr <= MAX_SIGN_STEP:
            return None
        owner = self.owner
        return (f"{owner}(scale='unit'): {type(optimizer).__name__}(lr={lr:g}) is the sign step δ: every coordinate "
                f"moves by ±{lr:g} per step whatever its gradient (SGD would move it by lr·|g|). Sign steps above "
                f"{MAX_SIGN_STEP:g} rarely train; try lr={SUGGESTED_SIGN_STEP:g}, or keep lr={lr:g} with "
                f"{owner}(scale='l1'), which scales the vote by the gradient's mean magnitude per tensor.")  # fmt: skip

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "owner"}
