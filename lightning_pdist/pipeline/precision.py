"""fp16 mixed precision with a ``GradScaler`` for the pipeline schedules that update once per batch (``PipelineStrategy``).

Lightning's :class:`~lightning.pytorch.plugins.precision.MixedPrecision` scales the loss by ``S`` in
``backward``, and in ``optimizer_step`` unscales, lets ``scaler.step`` skip when *this* rank's gradients
hold Inf/NaN and backs ``S`` off or grows it from that local flag. Under a pipeline none of it runs where
Lightning expects: the backwards and the update happen inside the schedule, one stage's overflow is
invisible to the other stages, and a stage skipping alone would leave the stages of one model at
different steps.

:class:`PipelineMixedPrecision` keeps the user's scaler and splits the work where the schedule needs it:

* :meth:`~PipelineMixedPrecision.scale_loss`: the last stage scales each micro-batch's loss by ``S``
  (``scaler.scale``), so the activation gradients that travel between stages are ``S·g`` (fp16 backward
  does not underflow).
* :meth:`~PipelineMixedPrecision.unscale_`: before the update, every stage divides its gradients by ``S``
  (``scaler.unscale_``) and reports whether they hold Inf/NaN.
* the strategy agrees on the flag over the whole world (any stage, any replica) and sets
  :attr:`~PipelineMixedPrecision.overflowed`;
* ``optimizer_step``: every rank steps, or every rank skips; ``scaler.update()`` then applies torch's
  own back-off/growth rule to the agreed flag (:meth:`~lightning_pdist.core.precision.AgreedScalingPrecision.update_scale`,
  the scaler's public API only), so ``S`` stays the same on every rank. (``gpipe``/``1f1b`` call it at the update; ``2bw`` later, once the flag has arrived.)

The scaler's state is what Lightning checkpoints under this plugin's name, so a resumed run continues
with the same ``S``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning_pdist.core.precision import AgreedScalingPrecision

__all__ = ["PipelineMixedPrecision"]


class PipelineMixedPrecision(AgreedScalingPrecision):
    """``MixedPrecision`` whose loss scaling, unscaling and skips are driven by a pipeline schedule.

    ``PipelineStrategy`` swaps it in at setup for a ``MixedPrecision`` with a scaler (on GPU
    ``precision="16-mixed"``; on CPU ``plugins=[MixedPrecision("16-mixed", "cpu")]``), keeping the user's
    scaler; the user changes nothing. See the module docstring for the order of the calls.

    Args:
        precision: ``"16-mixed"``.
        device: the device for ``torch.autocast``.
        scaler: the ``GradScaler`` (kept as is: its settings and its current state).

    Attributes:
        overflowed: the agreed flag for the coming ``optimizer_step`` (set by the strategy, consumed by the step).
        skipped_steps: updates skipped for an overflow on some rank (the same on every rank).
    """

    def __init__(self, precision: str, device: str, scaler: Any) -> None:
        super().__init__(precision, device, scaler)
        self.overflowed = False

    @classmethod
    def replacing(cls, plugin: MixedPrecision) -> PipelineMixedPrecision:
        """The plugin that takes ``plugin``'s place, with its precision, device and (the same) scaler."""
        return super().replacing(plugin)

    def scale_loss(self, loss: Tensor) -> Tensor:
        """``loss · S`` (the last stage, per micro-batch): what the schedule's backward starts from."""
        self._device = loss.device
        return self.scaler.scale(loss)

    def unscale_(self, optimizer: Optimizer) -> bool:
        """Divide this stage's gradients by ``S``; whether any of them is Inf/NaN (this rank's flag)."""
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not self.scaler.is_enabled():
            return False
        self._ensure_scale()
        self.scaler.unscale_(optimizer)
        # unscale_ multiplies by 1/S: an Inf/NaN stays one, and it alone marks an overflow (as scaler.step checks).
        return bool(grads) and not bool(torch.stack([g.isfinite().all() for g in grads]).all())

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if isinstance(optimizer, LBFGS):
            raise MisconfigurationException("AMP and the LBFGS optimizer are not compatible.")
        closure()  # the schedule already ran the backwards; unscale_ and the agreement came before
        self._after_closure(model, optimizer)  # on_before_optimizer_step, clipping (on unscaled gradients)
        overflowed, self.overflowed = self.overflowed, False
        return self.step_or_skip(optimizer, overflowed, **kwargs)

    @override
    def update_scale(self, overflowed: bool) -> None:
        if self.scaler.is_enabled():
            self._ensure_scale()
        super().update_scale(overflowed)

    def _ensure_scale(self) -> None:
        # Only the last stage scales losses; GradScaler creates its scale on the first scale() call (from its
        # init_scale or the checkpoint's), so the other stages make that call on a dummy before unscale_.
        self.scaler.scale(torch.zeros((), device=self._device or torch.device(self.device)))

    @staticmethod
    def handles_unscaling(optimizer: Optimizer) -> bool:
        """Whether ``optimizer`` unscales inside its own ``step`` (fused optimizers), which a pipeline cannot agree on."""
        return _optimizer_handles_unscaling(optimizer)
