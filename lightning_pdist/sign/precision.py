"""fp16 mixed precision with a ``GradScaler`` for the sign votes (``SignSGDStrategy``).

Lightning's :class:`~lightning.pytorch.plugins.precision.MixedPrecision` scales the loss by ``S``,
then ``scaler.unscale_`` divides every gradient by ``S``, ``scaler.step`` skips the step when this
rank's gradients hold Inf/NaN, and ``scaler.update()`` backs ``S`` off or grows it. Under a sign
vote each of the three is wrong: the gradient the optimizer sees is the voted ``±1`` (never
multiplied by ``S``, so dividing it shrinks the step to ``lr/S``), and an overflow on one rank only
would make that rank alone skip and back off, so the replicas and their scales would part.

:class:`SignMixedPrecision` keeps the loss scaling and replaces the rest:

* ``pre_backward``: the loss is scaled as usual (so fp16 backward does not underflow) and the hook
  state's :class:`~lightning_pdist.sign.overflow.LossScaledRound` learns ``S``.
* the vote runs on ``S·g``: the sign is invariant to a positive scale. Signum momentum, the EF
  residual and the ``"l1"`` scales are magnitudes kept across steps, so the hook divides by ``S``
  (in fp32) before they see the gradient; the result is ``±1`` or ``s̄·U`` in gradient units.
* ``post_backward``: the pass ends; every rank knows whether any rank overflowed in any bucket
  (the non-finite flag of each bucket's all-to-all header), and the pass's state changes are
  committed, or all dropped on overflow.
* ``optimizer_step``: no ``unscale_``; on an agreed overflow the optimizer step is skipped on every
  rank; ``scaler.update()`` then applies torch's own rule with the agreed flag, so ``S`` backs off
  or grows identically everywhere.

The user's scaler object is kept (its settings, its current scale and growth tracker), and its
state is what Lightning checkpoints (``state_dict``), so a resumed run continues with the same ``S``.
"""

from __future__ import annotations

from typing import Any, Callable

from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from torch.optim import LBFGS
from typing_extensions import override

from lightning_pdist.sign.overflow import LossScaledRound
from lightning_pdist.core.precision import AgreedScalingPrecision

__all__ = ["SignMixedPrecision"]


class SignMixedPrecision(AgreedScalingPrecision):
    """``MixedPrecision`` whose overflow skips and scale updates are agreed by every rank of a sign vote.

    ``SignSGDStrategy`` swaps it in at setup for a ``MixedPrecision`` with a scaler (on GPU
    ``precision="16-mixed"``; on CPU ``plugins=[MixedPrecision("16-mixed", "cpu")]``), keeping the
    user's scaler; the user changes nothing. See the module docstring for each hook.

    Args:
        precision: ``"16-mixed"``.
        device: the device for ``torch.autocast``.
        scaler: the ``GradScaler`` (kept as is: its settings and its current state).
        hook_state: the sign-vote hook state (a ``SignSGDState``) whose votes this plugin scales.

    Attributes:
        skipped_steps: optimizer steps skipped for an overflow on some rank (the same on every rank).
    """

    def __init__(self, precision: str, device: str, scaler: Any, hook_state: Any) -> None:
        super().__init__(precision, device, scaler)
        self.round = LossScaledRound()
        self._overflowed = False  # some backward pass since the last optimizer step overflowed (agreed)
        self.bind(hook_state)

    @classmethod
    def replacing(cls, plugin: MixedPrecision, hook_state: Any) -> SignMixedPrecision:
        """The plugin that takes ``plugin``'s place, with its precision, device and (the same) scaler."""
        return super().replacing(plugin, hook_state)

    def bind(self, hook_state: Any) -> None:
        """Scale the votes of ``hook_state`` (a new fit builds a new hook state)."""
        self.hook_state = hook_state
        hook_state.loss_scaling = self.round

    @override
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:  # type: ignore[override]
        tensor = super().pre_backward(tensor, module)  # scaler.scale(loss): its scale is initialised now
        self.round.begin(self.scaler.get_scale())
        return tensor

    @override
    def post_backward(self, tensor: Tensor, module: Any) -> Tensor:  # type: ignore[override]
        self._overflowed |= self.round.finish()
        return super().post_backward(tensor, module)

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if isinstance(optimizer, LBFGS):
            raise MisconfigurationException("AMP and the LBFGS optimizer are not compatible.")
        closure_result = closure()
        no_backward = closure_result is None and model.automatic_optimization  # training_step returned None
        # No scaler.unscale_: the vote (±1, or s̄·U in gradient units) was never multiplied by the loss scale.
        self._after_closure(model, optimizer)
        if no_backward:
            return closure_result
        overflowed, self._overflowed = self._overflowed, False
        return self.step_or_skip(optimizer, overflowed, **kwargs)
