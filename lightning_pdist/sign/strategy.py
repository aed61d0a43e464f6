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

from lightning_pdist.sign.config import (MAX_SIGN_STEP, REGISTERED_NAMES, SUGGESTED_SIGN_STEP, SignSGDConfig,
                                         hook_rank_state, load_hook_rank_state)  # fmt: skip
from lightning_pdist.sign.hooks import SignSGDState
from lightning_pdist.sign.llr import DEFAULT_MAX_WEIGHT
from lightning_pdist.sign.overflow import LossScaledRound
from lightning_pdist.sign.stats import take_vote_diagnostics
from lightning_pdist.sign.precision import SignMixedPrecision
from lightning_pdist.core.strategy import PdistStrategy, register_variants
from lightning_pdist.core.config import refuse_owned_ddp_args

__all__ = ["MAX_SIGN_STEP", "SUGGESTED_SIGN_STEP", "SignSGDConfig", "SignSGDStrategy"]

class SignSGDStrategy(PdistStrategy):
    """Sign voting: every rank sends one bit per coordinate and applies the voted sign ``U``.

    Update rule, with ``M`` ranks, ``Y_m = sign(v_m)`` the sign of rank ``m``'s vector ``v_m``
    (its gradient; Signum's momentum with ``momentum > 0``; ``g + e`` with ``error_feedback``)::

        signSGD-MV   U_n = sign(Σ_m Y_{m,n})                        (Bernstein et al., ICLR 2019)
        IT-signSGD   U_n = sign(Σ_m w_{m,n} Y_{m,n}),  w = log((1 − p)/p)     (paper 004, eqs. 3–4)
        every rank   x ← x − δ·U   with torch.optim.SGD(lr=δ, momentum=0)     (eq. 5)

    ``sign(0) = +1`` and ties vote ``+1``. IT-signSGD takes the plain majority for the first
    ``warmup_rounds`` rounds, then weighs each worker by the log-likelihood ratio of its
    estimated disagreement rate ``p`` with the vote (the Chair–Varshney fusion rule);
    :mod:`lightning_pdist.sign.llr` has the estimators and every choice. Transport and
    bytes: :mod:`lightning_pdist.sign.hooks` (about ``d/8`` bytes per direction per rank,
    :func:`~lightning_pdist.sign.hooks.sign_hook_bytes`, 32× less than an fp32 all-reduce).

    Registered names: ``"signsgd_mv"`` (``aggregation="majority"``) and ``"it_signsgd"``
    (``aggregation="llr"``), each with ``_fork`` and ``_spawn`` variants.

    **The optimizer applies the vote.** The hook replaces each rank's gradient by ``U`` (``±1``)
    before the optimizer runs, so:

    * ``SGD(lr=δ)`` is the paper's step ``x ← x − δ·U``: ``lr`` *is* the sign step size ``δ``,
      typically 1e-4 … 5e-3, far below SGD's usual learning rate (every coordinate moves by ``δ``).
      Setup warns when an optimizer's ``lr`` exceeds ``MAX_SIGN_STEP = 0.01`` and suggests
      ``lr=1e-3``. ``scale="l1"`` keeps a module's SGD ``lr`` instead: the hook returns
      ``s̄_j·U`` with ``s̄_j = mean_m ‖v_{m,j}‖₁/numel_j`` per tensor (the "scaled sign", EF-signSGD's
      step without the residual), so each tensor moves as far, in ℓ1, as SGD would move it.
    * ``weight_decay=λ`` is added by the optimizer *after* the vote to the ``±1`` gradient:
      ``x ← x − δ·(U + λ·x)``. It is not voted on and costs no bits; scale ``λ`` against 1, not
      against the gradient's magnitude.
    * The optimizer's ``momentum`` accumulates *voted* signs (server-side momentum on ``U``), a
      different algorithm from Signum, whose momentum each worker applies *before* its sign
      (this strategy's ``momentum``). Leave the optimizer's momentum at 0 for the papers' methods.
    * Adaptive optimizers (Adam) rescale ``U`` per coordinate; that is sign-Adam, not signSGD.
    * With ``error_feedback=True`` the result is the scaled vote ``s̄·U`` in gradient units
      (EF-signSGD, Karimireddy et al. 2019); use SGD's usual learning rate then, not ``δ``.

    Decisions a user meets:

    * **Several optimizers: the vote runs per backward pass over the parameters in it.** For GANs
      and actor-critic modules (manual optimization, Lightning's ``toggle_optimizer`` before each
      optimizer's forward) pass ``find_unused_parameters=True``: only tensors that received a
      gradient on some rank vote (tracked by gradient hooks, flags in the all-to-all header,
      :mod:`~lightning_pdist.sign.participation`). The others do not vote and keep their
      Signum momentum, EF residual and ``.grad`` (DDP's, untouched), under every aggregation and
      option; none is refused. IT-signSGD keeps one set of statistics (and warm-up count) per set
      of tensors voting together, i.e. per optimizer and DDP bucket, so a generator step never
      moves the discriminator's weights ``w``. A bucket's ``rounds`` counts backward passes in
      which any of its tensors voted. A tensor used on some ranks only gets a zero gradient from
      the others (``sign(0) = +1``, as DDP's average adds a zero), with a warning once. Without
      ``toggle_optimizer`` the other optimizer's parameters *are* in the backward pass (as for
      DDP) and vote on this loss's gradient, moving their momentum, residual and statistics.
    * **Manual optimization** works: the vote happens in ``manual_backward``.
    * **Gradient accumulation** works and votes once per optimizer step: DDP's ``no_sync`` skips
      the hook on accumulating batches, and the last backward votes on the accumulated gradient,
      i.e. signSGD with a ``k``-times larger batch (one round per optimizer step).
    * **Precision.** ``32``, ``bf16-mixed``, ``16-true`` and ``bf16-true`` work (signs ignore
      precision; half-precision buckets come back in their dtype).
    * **fp16 with a GradScaler** (``precision="16-mixed"`` on GPU; on CPU
      ``plugins=[MixedPrecision("16-mixed", "cpu")]``) works: setup swaps Lightning's
      ``MixedPrecision`` for :class:`~lightning_pdist.sign.precision.SignMixedPrecision`,
      keeping the user's scaler (settings and state). The loss is scaled as usual; the vote runs on
      the scaled gradients (the sign ignores a positive scale; Signum momentum, the EF residual and
      the ``"l1"`` scales see the gradient divided by the scale, in fp32, so they stay in gradient
      units); the voted ``±1`` (or ``s̄·U``) reaches the optimizer as is, never divided by the
      scale. An overflow (Inf/NaN) in any rank's gradient skips that optimizer step on *every*
      rank: the flag rides in each bucket's all-to-all header (no extra collective, no extra byte),
      the state changes of the whole backward pass are dropped (no Signum momentum, residual or
      LLR-statistics update, and the round is not counted: ``rounds`` counts applied votes only),
      and the scale backs off, or grows on the scaler's schedule, identically everywhere. With a
      scaler, overflows are expected and skipped, so ``nonfinite`` is not consulted; without
      one, ``nonfinite="raise"`` keeps its meaning. The scaler's state is checkpointed by
      Lightning under the plugin's key, so a resumed run continues with the same scale.
    * **One rank** works and warns: the update is ``δ·sign(grad)`` (signSGD), nothing is sent.
    * **Non-finite gradients** (``nonfinite=``, :mod:`lightning_pdist.core.nonfinite`): every
      rank's non-finite flag rides in each bucket's all-to-all header, so every rank learns in the
      same collective that some rank's gradient was not finite, and who (no extra collective, no
      extra byte). The whole backward pass is then dropped as an fp16 overflow would be: later
      buckets skip their collectives and no vote state changes (Signum momentum, EF residual, LLR
      statistics, round counters). ``"raise"`` (default) then stops every rank before the optimizer
      step with a ``FloatingPointError`` naming the ranks and the global step; ``"skip_step"`` skips
      that optimizer step on every rank (float buffers restored, ``pdist/skipped_steps``);
      ``"propagate"`` gives every rank a NaN gradient for that step and steps, so your code must
      skip it (plain SGD would write NaN into the parameters).
    * **Vote statistics** reach the loggers on every logged step, counted over the votes since the previous
      one from what the votes already hold (:mod:`~lightning_pdist.sign.stats`; one all-reduce of a few
      numbers per logged step, for the tie count): ``pdist/sign/disagreement``, the share of coordinates where
      this rank's sign differed from ``U`` (rank 0's in the loggers); ``pdist/sign/tie_rate`` (even world sizes),
      the share whose signs split evenly and so voted ``+1`` by the tie rule; and for IT-signSGD the learned
      weight of each worker, ``pdist/sign/llr_weight/rank{r}`` (``_min``/``_max`` above 8 workers; the vote
      uses them once ``warmup_rounds`` are over).
    * **Checkpoints**: each rank writes its own hook state (LLR statistics, EF residual, Signum
      momentum, round counters) to its own file next to the checkpoint
      (:mod:`~lightning_pdist.core.rank_files`); a resumed run with the same world size
      restores its own, so it continues exactly. The model in ``state_dict``
      is the model every rank holds.

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
        nonfinite: ``"raise"`` (default), ``"skip_step"`` or ``"propagate"`` (see "Non-finite
            gradients"); not consulted under a GradScaler, whose overflows skip the step on every rank.
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
        owner = type(self).__name__
        refuse_owned_ddp_args(owner, kwargs, f"{owner} owns gradient communication (the sign vote)")
        self.config = SignSGDConfig.of_strategy(
            owner, kwargs, aggregation=aggregation, warmup_rounds=warmup_rounds, estimator=estimator, decay=decay,
            max_weight=max_weight, negative_weights=negative_weights, momentum=momentum, error_feedback=error_feedback,
            nonfinite=nonfinite, scale=scale,
        )  # fmt: skip
        ignored = self.config.ignored_llr_warning()
        if ignored:
            rank_zero_warn(ignored)
        super().__init__(nonfinite=nonfinite, ddp_comm_state=None, ddp_comm_hook=None, ddp_comm_wrapper=None,
                         model_averaging_period=None, **kwargs)  # owned, so given here: LightningCLI does not offer what is given  # fmt: skip
        self.hook_state: SignSGDState | None = None
        self._round: LossScaledRound | None = None  # nonfinite raise/skip_step without a scaler: one per backward pass
        self._nonfinite_ranks: set[int] = set()  # ranks the passes since the last step found non-finite

    @property
    def aggregation(self) -> str:
        return self.config.aggregation

    @classmethod
    @override
    def registered_name(cls, strategy: PdistStrategy | None = None) -> str:
        llr = strategy is not None and strategy.config.aggregation == "llr"
        return "it_signsgd" if llr else "signsgd_mv"

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, (aggregation, description) in REGISTERED_NAMES.items():
            description = f"{description}: 1-bit sign voting (SignSGDStrategy(aggregation={aggregation!r}))"
            register_variants(strategy_registry, cls, name, description, aggregation=aggregation)

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
    def pdist_state_dict(self) -> dict:
        state = super().pdist_state_dict()
        state["config"] = self.config.as_dict()
        return state

    @override
    def pdist_rank_state(self) -> dict | None:
        # Each rank holds different buffers (its residual, its momentum, its slice of the per-coordinate
        # statistics): each writes its own file (None on every rank when no model was wrapped for training).
        return hook_rank_state(self.hook_state)

    @override
    def load_pdist_rank_state(self, state: dict | None, reason: str = "") -> None:
        warning = load_hook_rank_state(self.hook_state, state, reason, type(self).__name__)
        if warning:
            rank_zero_warn(warning)
