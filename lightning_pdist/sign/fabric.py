"""1-bit sign voting (signSGD-MV, IT-signSGD, Signum and EF-signSGD options) as a Lightning Fabric strategy.

``fabric.setup`` wraps the module in DDP and registers :func:`~lightning_pdist.sign.hooks.signsgd_mv_hook` or
:func:`~lightning_pdist.sign.hooks.it_signsgd_hook` with a fresh hook state, exactly as
:class:`~lightning_pdist.sign.strategy.SignSGDStrategy` does (the same :class:`SignSGDConfig`). Each
``fabric.backward(loss)`` is one vote; every rank's gradient becomes the voted sign ``U`` and the optimizer applies
it, so the replicas stay identical and nothing else is communicated.

``fabric.save`` writes each rank's hook state (LLR statistics, EF residual, Signum momentum, round counters) to its
own file next to the checkpoint; ``fabric.load`` after ``fabric.setup`` restores it, so a resumed run continues
exactly. What the Trainer strategy's docstring says about the optimizer (``SGD(lr=δ)``: ``lr`` is the sign step),
several optimizers, gradient accumulation (``fabric.no_backward_sync``) and ``find_unused_parameters`` holds here
too. Not here: fp16 with a GradScaler (``precision="16-mixed"``), whose overflow skip the Trainer strategy wires
into the vote through its precision plugin; it is refused at setup (``bf16-mixed`` and ``32-true`` work).
"""

from __future__ import annotations

from typing import Any, Callable

from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_pdist.core.fabric import NoSkipStep, PdistFabricStrategy
from lightning_pdist.sign.arguments import SignSGDArguments

__all__ = ["SignSGDFabricStrategy"]


class SignSGDFabricStrategy(SignSGDArguments, NoSkipStep, PdistFabricStrategy):
    """Sign voting: every rank sends one bit per coordinate and applies the voted sign ``U``.

    The rule of :class:`~lightning_pdist.sign.strategy.SignSGDStrategy`::

        signSGD-MV   U_n = sign(Σ_m Y_{m,n})                       (Bernstein et al., ICLR 2019)
        IT-signSGD   U_n = sign(Σ_m w_{m,n} Y_{m,n}),  w = log((1 − p)/p)
        every rank   x ← x − δ·U   with torch.optim.SGD(lr=δ)

    Registered with Fabric as ``"signsgd_mv"`` (``aggregation="majority"``) and ``"it_signsgd"``
    (``aggregation="llr"``), each with ``_fork`` and ``_spawn`` variants.

    Args:
        aggregation: ``"majority"`` (signSGD-MV, default) or ``"llr"`` (IT-signSGD).
        warmup_rounds, estimator, decay, max_weight, negative_weights: the LLR vote's options (see
            :class:`~lightning_pdist.sign.strategy.SignSGDStrategy`); a non-default one under ``"majority"`` warns.
        momentum: Signum's ``β`` in ``[0, 1)``, applied on each worker before the sign (0).
        error_feedback: EF-signSGD (scaled signs plus a local residual).
        nonfinite: ``"raise"`` (default: every rank raises in the backward that met a non-finite gradient) or
            ``"propagate"``; ``"skip_step"`` is refused: your loop calls ``optimizer.step()``, not the strategy.
        scale: ``"unit"`` (the optimizer's ``lr`` is the sign step ``δ``) or ``"l1"`` (the per-tensor scaled vote).
        **kwargs: passed to Fabric's :class:`~lightning.fabric.strategies.DDPStrategy`.

    Example::

        fabric = Fabric(accelerator="cpu", devices=2, strategy=SignSGDFabricStrategy("llr", warmup_rounds=5))
    """

    strategy_name = "signsgd_mv"
    registered_description = "{description} (Lightning Fabric): SignSGDFabricStrategy(aggregation={aggregation!r})"
    one_rank_behaviour = "each step applies lr * sign(grad) (signSGD) and sends nothing"

    @override
    def check_setup(self, module: Module) -> None:
        if getattr(self.precision, "scaler", None) is not None:
            owner = type(self).__name__
            raise ValueError(
                f"{owner}(precision={getattr(self.precision, 'precision', '16-mixed')!r}): fp16 with a GradScaler is "
                f"not supported by {owner}: an overflow on one rank must skip the step on every rank, which only the "
                "Trainer's SignSGDStrategy wires into the vote. Use precision='bf16-mixed' or '32-true' with Fabric, "
                "or the Trainer."
            )

    @override
    def comm_hook(self) -> tuple[object, Callable]:
        self.hook_state, hook = self.config.make_hook(self.comm_meter, self.ddp_module.parameters())
        return self.hook_state, hook

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        warning = self.config.sign_step_warning(optimizer)
        if warning:
            rank_zero_warn(warning)
        return super().setup_optimizer(optimizer)

    # ------------------------------------------------------------------ checkpoints
    @override
    def rank_state(self, objects: dict[str, Any]) -> dict | None:
        return self.hook_rank_state()

    @override
    def load_rank_state(self, state: dict | None, objects: dict[str, Any], reason: str) -> None:
        self.load_hook_rank_state(state, reason)

