"""1-bit sign voting (signSGD-MV, IT-signSGD, with Signum and EF-signSGD options) as a Lightning strategy.

The strategy is :class:`~lightning_pdist.core.strategy.PdistStrategy` (DDP) whose default comm
hook is :func:`~lightning_pdist.sign.hooks.signsgd_mv_hook` or
:func:`~lightning_pdist.sign.hooks.it_signsgd_hook`, counted by the strategy's ``comm_meter``.
Every rank gets the same voted sign ``U`` in its gradients and the user's optimizer applies it, so
the replicas stay identical without any parameter traffic.

Lifecycle (every rank): ``setup`` wraps the model in DDP and registers the hook with a fresh
hook state; a resumed run then loads *its own* hook state from ``checkpoint["pdist"]``. Each
backward pass is one vote (one round); ``pdist/comm_bytes`` is logged after every optimizer step.
With an fp16 ``GradScaler``, setup also swaps in
:class:`~lightning_pdist.sign.precision.SignMixedPrecision` (see "fp16 with a GradScaler").
"""

from __future__ import annotations

from typing import Any, Callable

from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_pdist.sign.arguments import SignSGDArguments
from lightning_pdist.sign.config import MAX_SIGN_STEP, SUGGESTED_SIGN_STEP, SignSGDConfig
from lightning_pdist.sign.overflow import LossScaledRound
from lightning_pdist.sign.stats import take_vote_diagnostics
from lightning_pdist.sign.precision import SignMixedPrecision
from lightning_pdist.core.strategy import PdistStrategy
from lightning_pdist.core.config import OwnedDDPArguments

__all__ = ["MAX_SIGN_STEP", "SUGGESTED_SIGN_STEP", "SignSGDConfig", "SignSGDStrategy"]


class SignSGDStrategy(SignSGDArguments, OwnedDDPArguments, PdistStrategy):
    """Sign voting: every rank sends one bit per coordinate and applies the voted sign ``U``.

    Update rule, with ``M`` ranks, ``Y_m = sign(v_m)`` the sign of rank ``m``'s vector ``v_m``
    (its gradient; Signum's momentum with ``momentum > 0``; ``g + e`` with ``error_feedback``)::

        signSGD-MV   U_n = sign(Σ_m Y_{m,n})                        (Bernstein et al., ICLR 2019)
        IT-signSGD   U_n = sign(Σ_m w_{m,n} Y_{m,n}),  w = log((1 − p)/p)     (paper 004, eqs. 3–4)
        every rank   x ← x − δ·U   with torch.optim.SGD(lr=δ, momentum=0)     (eq. 5)

    ``sign(0) = +1`` and ties vote ``+1``; IT-signSGD votes by plain majority for ``warmup_rounds`` rounds
    (:mod:`lightning_pdist.sign.llr`). About ``d/8`` bytes per direction per rank
    (:func:`~lightning_pdist.sign.hooks.sign_hook_bytes`). Registered as ``"signsgd_mv"`` (``aggregation="majority"``)
    and ``"it_signsgd"`` (``aggregation="llr"``), each with ``_fork`` and ``_spawn`` variants.

    The hook replaces each rank's gradient by ``U`` before the optimizer runs, so the optimizer's ``lr`` is the sign
    step ``δ`` (setup warns above ``MAX_SIGN_STEP``; ``scale="l1"`` keeps an SGD ``lr``), and weight decay and the
    optimizer's momentum act on the voted signs. Several optimizers (``find_unused_parameters=True``), manual
    optimization, gradient accumulation, every precision (fp16 with a GradScaler through
    :class:`~lightning_pdist.sign.precision.SignMixedPrecision`), non-finite gradients, the logged vote statistics
    and per-rank checkpoint files: ``docs/algorithms/signsgd.md`` has each decision and its tests.

    Args:
        aggregation: ``"majority"`` (signSGD-MV, default) or ``"llr"`` (IT-signSGD).
        warmup_rounds: IT-signSGD's rounds of plain majority vote before the weights apply
            (statistics are collected from the first round). Default 10; the pooled estimators
            need only a few, ``"coordinate"`` a few tens.
        estimator: how ``p`` is pooled: ``"worker"`` (default: one ``p`` per worker and DDP
            bucket; thousands of observations per round, and in the heterogeneous-batch setting
            the error rate belongs to the worker), ``"tensor"`` (per parameter tensor) or
            ``"coordinate"`` (the paper's eq. 4; noisy for many rounds).
        decay: ``1.0`` for eq. 4's running fraction; ``< 1`` for an exponential moving average
            (``0.99`` ≈ the last 100 rounds) when worker quality drifts.
        max_weight: bound on ``|w|`` (default ``log 99``: ``p`` held in ``[0.01, 0.99]``).
        negative_weights: allow ``w < 0`` (the exact Chair–Varshney rule inverts workers that are
            wrong more often than not); default False ignores them instead.
        momentum: Signum's ``β`` in ``[0, 1)``, applied on each worker *before* the sign
            (``m ← β·m + (1 − β)·g``). Default 0 (plain signSGD); ``0.9`` is the papers' value.
        error_feedback: EF-signSGD (scaled signs plus a local residual).
        nonfinite: ``"raise"`` (default), ``"skip_step"`` or ``"propagate"`` (the method card's "Non-finite
            values"); not consulted under a GradScaler, whose overflows skip the step on every rank.
        scale: ``"unit"`` (default; the papers' ``±1``, the optimizer's ``lr`` is ``δ``) or ``"l1"``
            (the per-tensor scaled vote; an SGD ``lr`` keeps its meaning; 4 bytes per tensor more
            per bucket and rank). Error feedback always returns the scaled vote.
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy`; the comm-hook
            arguments must be left unset (this strategy owns gradient communication).

    Example::

        Trainer(accelerator="cpu", devices=2, strategy="it_signsgd")
        Trainer(accelerator="cpu", devices=2, strategy=SignSGDStrategy("llr", warmup_rounds=5, estimator="tensor"))
    """

    strategy_name = "signsgd_mv"
    registered_description = "{description}: 1-bit sign voting (SignSGDStrategy(aggregation={aggregation!r}))"
    owned_reason = "{owner} owns gradient communication (the sign vote)"
    _round: LossScaledRound | None = None  # nonfinite raise/skip_step without a scaler: one per backward pass
    _nonfinite_ranks: set[int] | frozenset[int] = frozenset()  # ranks the passes since the last step found non-finite

    @classmethod
    @override
    def registered_name(cls, strategy: PdistStrategy | None = None) -> str:
        llr = strategy is not None and strategy.config.aggregation == "llr"
        return "it_signsgd" if llr else "signsgd_mv"

    # ------------------------------------------------------------------ comm hook
    @override
    def _default_comm_hook(self) -> tuple[object, Callable]:
        # A fresh state per DDP model, built before its first backward (so its canonical bucket layout is DDP's
        # initial one); a resumed run loads its saved state into it in load_pdist_state_dict.
        parameters = self.model.parameters() if self.model is not None else None
        self.hook_state, hook = self.config.make_hook(self.comm_meter, parameters)
        return self.hook_state, hook

    @override
    def diagnostics(self) -> dict[str, float]:
        """The vote statistics since the last logged step (:mod:`~lightning_pdist.sign.stats`)."""
        out = super().diagnostics()
        if self.hook_state is not None:
            out.update(take_vote_diagnostics(self.hook_state, self.hook_state.process_group, self.root_device))
        return out

    # ------------------------------------------------------------------ lifecycle
    @override
    def setup_algorithm(self) -> None:
        owner = type(self).__name__
        for optimizer in self.optimizers:
            warning = self.config.sign_step_warning(optimizer)
            if warning:
                rank_zero_warn(warning)
                break
        self._use_sign_precision()
        self._round, self._nonfinite_ranks = None, set()
        if self.hook_state is not None and self.hook_state.loss_scaling is None and self.nonfinite != "propagate":
            # A non-finite bucket drops the whole backward pass (as an fp16 overflow does); the step decides after.
            self._round = LossScaledRound()
            self.hook_state.loss_scaling = self._round
        _, world_size = self.rank_world
        if world_size == 1:
            rank_zero_warn(
                f"{owner}: world_size == 1, so there is no vote; each step applies lr * sign(grad) (signSGD"
                f"{' with error feedback' if self.config.error_feedback else ''}) and sends nothing."
            )

    @override
    def pre_backward(self, closure_loss: Any) -> None:
        super().pre_backward(closure_loss)
        if self._round is not None:
            self._round.begin(1.0)

    @override
    def post_backward(self, closure_loss: Any) -> None:
        super().post_backward(closure_loss)
        if self._round is not None:
            if self._round.overflow_at is not None:
                self._nonfinite_ranks.update(self._round.overflow_at[1])
            self._round.finish()  # drops the pass's vote state changes if any bucket was not finite

    @override
    def nonfinite_ranks(self, optimizer: Any) -> list[int] | None:
        """The ranks whose gradients the votes since the last step found non-finite (read from the all-to-all
        headers, so the same on every rank; no extra collective)."""
        ranks, self._nonfinite_ranks = sorted(self._nonfinite_ranks), set()
        return ranks or None

    def _use_sign_precision(self) -> None:
        """Swap a ``MixedPrecision`` with a scaler for :class:`SignMixedPrecision` (the same scaler), bound to the vote."""
        plugin = self.precision_plugin
        if isinstance(plugin, SignMixedPrecision):
            plugin.bind(self.hook_state)  # a later fit with this strategy: a fresh hook state
        elif isinstance(plugin, MixedPrecision) and plugin.scaler is not None:
            self.precision_plugin = SignMixedPrecision.replacing(plugin, self.hook_state)

    # ------------------------------------------------------------------ checkpoints
    @override
    def pdist_rank_state(self) -> dict | None:
        return self.hook_rank_state()

    @override
    def load_pdist_rank_state(self, state: dict | None, reason: str = "") -> None:
        self.load_hook_rank_state(state, reason)
