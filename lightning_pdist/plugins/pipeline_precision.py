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
  own back-off/growth rule to the agreed flag (through the scaler's public API), so ``S`` stays the same
  on every rank. (``gpipe``/``1f1b`` call it at the update; ``2bw`` later, once the flag has arrived.)

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

__all__ = ["PipelineMixedPrecision"]


class PipelineMixedPrecision(MixedPrecision):
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
        if scaler is None:
            raise ValueError(f"PipelineMixedPrecision(precision={precision!r}, scaler=None): it exists for a GradScaler")
        super().__init__(precision, device, scaler)  # type: ignore[arg-type]
        self.overflowed = False
        self.skipped_steps = 0
        self._flag: Optimizer | None = None
        self._device: torch.device | None = None  # the loss's, where the scaler keeps its scale

    @classmethod
    def replacing(cls, plugin: MixedPrecision) -> PipelineMixedPrecision:
        """The plugin that takes ``plugin``'s place, with its precision, device and (the same) scaler."""
        return cls(plugin.precision, plugin.device, plugin.scaler)

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
        output = None
        if overflowed:
            self.skipped_steps += 1
        else:
            output = optimizer.step(**kwargs)
        self.update_scale(overflowed)
        return output

    def update_scale(self, overflowed: bool) -> None:
        """``scaler.update()`` with ``overflowed`` as its flag: back off on overflow, else count towards growth.

        The optimizer passed to :meth:`unscale_` adds its own (local) flag, which is always part of the agreed one.
        """
        if not self.scaler.is_enabled():
            return
        # GradScaler records an overflow only through unscale_(optimizer); a one-element optimizer carries the
        # agreed flag, so update() applies torch's rule (and a custom scaler's) with the scaler's public API.
        if self._flag is None:
            carrier = torch.zeros(1, device=self._device or torch.device(self.device))
            carrier.grad = torch.zeros_like(carrier)
            self._flag = torch.optim.SGD([carrier], lr=0.0)
        self._flag.param_groups[0]["params"][0].grad.fill_(float("inf") if overflowed else 0.0)
        self._ensure_scale()
        self.scaler.unscale_(self._flag)
        self.scaler.update()

    def _ensure_scale(self) -> None:
        # Only the last stage scales losses; GradScaler creates its scale on the first scale() call (from its
        # init_scale or the checkpoint's), so the other stages make that call on a dummy before unscale_.
        self.scaler.scale(torch.zeros((), device=self._device or torch.device(self.device)))

    @staticmethod
    def handles_unscaling(optimizer: Optimizer) -> bool:
        """Whether ``optimizer`` unscales inside its own ``step`` (fused optimizers), which a pipeline cannot agree on."""
        return _optimizer_handles_unscaling(optimizer)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Lightning restores a plugin's state from the key of its class name; a checkpoint written with the plain
        # MixedPrecision (by another strategy) holds the scaler there.
        own, plain = type(self).__qualname__, MixedPrecision.__qualname__
        if own not in checkpoint and plain in checkpoint:
            self.load_state_dict(checkpoint[plain])
