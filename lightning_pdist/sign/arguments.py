"""The sign strategies' shared constructor and checkpoint records (wiring: it warns through Lightning).

Both shells, :class:`~lightning_pdist.sign.strategy.SignSGDStrategy` (Trainer) and
:class:`~lightning_pdist.sign.fabric.SignSGDFabricStrategy`, inherit :class:`SignSGDArguments` first: its explicit
signature is the one LightningCLI (jsonargparse), ``help()`` and editors read, written once.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_pdist.core.config import register_variants
from lightning_pdist.sign.config import REGISTERED_NAMES, SignSGDConfig
from lightning_pdist.sign.hooks import SignSGDState
from lightning_pdist.sign.llr import DEFAULT_MAX_WEIGHT

__all__ = ["SignSGDArguments"]


class SignSGDArguments:
    """The sign strategies' constructor and checkpoint records, inherited by both shells (written once).

    The constructor's explicit signature is what LightningCLI (jsonargparse), ``help()`` and editors read; the
    arguments are documented on :class:`~lightning_pdist.sign.strategy.SignSGDStrategy`. It builds
    :class:`SignSGDConfig` (``self.config``) and passes ``nonfinite`` and every other keyword on through the shell's
    MRO: the Trainer's :class:`~lightning_pdist.core.config.OwnedDDPArguments` refuses DDP's comm-hook arguments, the
    Fabric's :class:`~lightning_pdist.core.fabric.NoSkipStep` refuses ``nonfinite="skip_step"``.
    """

    def __init__(
        self,
        aggregation: str = "majority",
        warmup_rounds: int = 10,
        estimator: str = "worker",
        decay: float = 1.0,
        max_weight: float = DEFAULT_MAX_WEIGHT,
        negative_weights: bool = False,
        momentum: float = 0.0,
        error_feedback: bool = False,
        nonfinite: str = "raise",
        scale: str = "unit",
        **kwargs: Any,
    ) -> None:
        self.config = SignSGDConfig.of_strategy(
            type(self).__name__, kwargs, aggregation=aggregation, warmup_rounds=warmup_rounds, estimator=estimator,
            decay=decay, max_weight=max_weight, negative_weights=negative_weights, momentum=momentum,
            error_feedback=error_feedback, nonfinite=nonfinite, scale=scale
        )
        super().__init__(nonfinite=nonfinite, **kwargs)  # type: ignore[call-arg]
        self.hook_state: SignSGDState | None = None  # built with the DDP model (the shell's comm hook)
        ignored = self.config.ignored_llr_warning()
        if ignored:
            rank_zero_warn(ignored)

    @property
    def aggregation(self) -> str:
        return self.config.aggregation

    #: How each shell describes a registered name, from its :data:`REGISTERED_NAMES` entry.
    registered_description: str

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """``"signsgd_mv"`` and ``"it_signsgd"`` (:data:`REGISTERED_NAMES`) with their variants, in the shell's registry."""
        for name, (aggregation, description) in REGISTERED_NAMES.items():
            described = cls.registered_description.format(description=description, aggregation=aggregation)
            register_variants(strategy_registry, cls, name, described, aggregation=aggregation)

    def pdist_state_dict(self) -> dict:
        """The shell's record plus the settings (``"config"``)."""
        return super().pdist_state_dict() | {"config": self.config.as_dict()}  # type: ignore[misc]

    def hook_rank_state(self) -> dict | None:
        """What each rank writes to its own file: its hook state (LLR statistics, EF residual, Signum momentum, round
        counters; each rank's differ), or None on every rank when no model was set up for training."""
        return None if self.hook_state is None else {"hook_state": self.hook_state.state_dict()}

    def load_hook_rank_state(self, state: dict | None, reason: str) -> None:
        """Restore :meth:`hook_rank_state`'s output; a rank without one (``reason`` says why) warns and starts from zero."""
        if self.hook_state is None:
            return
        if state is None:
            rank_zero_warn(f"{type(self).__name__}: {reason}; the vote statistics, residuals and momentum start from "
                           "zero.")
            return
        self.hook_state.load_state_dict(state["hook_state"])
