"""fp16 mixed precision with a ``GradScaler`` for the parameter server (``ParameterServerStrategy``).

Lightning's :class:`~lightning.pytorch.plugins.precision.MixedPrecision` ends every step with
``scaler.step(optimizer)``, which steps the optimizer unless this rank's gradients hold Inf/NaN. Under a
parameter server the worker's optimizer never steps (the servers do), and whether a step is skipped is
the strategy's call: in ``sync`` mode every worker must skip together, or the servers would average a
step that some workers left out and the workers' scales would part. :class:`ParameterServerMixedPrecision`
keeps the loss scaling and splits the rest into what the strategy calls:

* ``pre_backward``: the loss is scaled by ``S`` as usual (so fp16 backward does not underflow).
* :meth:`~ParameterServerMixedPrecision.backward_and_unscale`: the closure (forward, backward), then
  ``scaler.unscale_(optimizer)`` divides this worker's gradients by ``S`` in place (in fp32, as Lightning
  does before clipping, so ``on_before_optimizer_step`` and gradient clipping see gradient units), and says
  whether they hold Inf/NaN.
* the strategy agrees on the flag (``sync``: any worker) and pushes the unscaled gradients, or skips.
* :meth:`~ParameterServerMixedPrecision.end_step`: ``scaler.update()`` with that flag (torch's own back-off
  and growth rule, through :meth:`~lightning_pdist.core.precision.AgreedScalingPrecision.update_scale`).

The user's scaler object is kept (its settings, its current scale and growth tracker), and its state is what
Lightning checkpoints under this class's name, so a resumed run continues with the same ``S``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from typing_extensions import override

from lightning_pdist.core.precision import AgreedScalingPrecision

__all__ = ["ParameterServerMixedPrecision"]


class ParameterServerMixedPrecision(AgreedScalingPrecision):
    """``MixedPrecision`` for workers that push unscaled gradients and skip overflowed steps as the strategy decides.

    ``ParameterServerStrategy`` swaps it in at setup for a ``MixedPrecision`` with a scaler (on GPU
    ``precision="16-mixed"``; on CPU ``plugins=[MixedPrecision("16-mixed", "cpu")]``), keeping the user's
    scaler; the user changes nothing. See the module docstring for each step.

    Args:
        precision: ``"16-mixed"``.
        device: the device for ``torch.autocast``.
        scaler: the ``GradScaler`` (kept as is: its settings and its current state).

    Attributes:
        skipped_steps: this worker's optimizer steps whose push was skipped for an overflow.
    """

    def backward_and_unscale(self, model: Any, optimizer: Any, closure: Callable[[], Any]) -> tuple[Any, bool | None]:
        """Run ``closure``, unscale ``optimizer``'s gradients, then Lightning's ``on_before_optimizer_step`` and clipping.

        Returns:
            ``(closure_result, overflowed)``: whether this worker's unscaled gradients hold Inf/NaN, or ``None``
            when the closure ran no backward (``training_step`` returned ``None``), as Lightning then skips
            unscaling and the scaler update.
        """
        closure_result = closure()
        overflowed = None
        if not (closure_result is None and model.automatic_optimization):
            self.scaler.unscale_(optimizer)  # grad / S in place; a disabled scaler leaves them as they are
            overflowed = self.scaler.is_enabled() and not _all_finite(optimizer)
        self._after_closure(model, optimizer)
        return closure_result, overflowed

    def end_step(self, skipped: bool) -> None:
        """Close the step: count a skip, and back the scale off (``skipped``) or count towards growth."""
        self.skipped_steps += int(skipped)
        self.update_scale(skipped)

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:  # type: ignore[override]
        raise RuntimeError(
            f"{type(self).__name__}.optimizer_step: the parameter servers step, not the worker's optimizer; "
            "ParameterServerStrategy.optimizer_step drives this plugin (backward_and_unscale, then end_step)"
        )


def _all_finite(optimizer: Any) -> bool:
    """Whether every gradient of ``optimizer``'s parameters is finite (one device sync)."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    return not grads or bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())
