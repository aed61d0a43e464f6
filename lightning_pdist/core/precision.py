"""The part of fp16 loss scaling that strategies owning gradient numerics share: an overflow flag the ranks agreed on.

Lightning's :class:`~lightning.pytorch.plugins.precision.MixedPrecision` lets ``scaler.step`` skip the step when
*this* rank's gradients hold Inf/NaN and ``scaler.update()`` back the scale off or grow it from that local flag.
A strategy that decides elsewhere whether a step happens (a sign vote, a parameter server) needs the scaler to
follow *its* decision instead. :class:`AgreedScalingPrecision` keeps the loss scaling and the user's scaler and
adds :meth:`~AgreedScalingPrecision.update_scale`, which applies the scaler's own back-off/growth rule to a given
flag through the ``GradScaler``'s public API only. Subclasses decide when to call it:
:class:`~lightning_pdist.sign.precision.SignMixedPrecision` and
:class:`~lightning_pdist.parameter_server.precision.ParameterServerMixedPrecision`.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import Tensor
from typing_extensions import override

__all__ = ["AgreedScalingPrecision"]


class AgreedScalingPrecision(MixedPrecision):
    """``MixedPrecision`` whose skips and scale updates follow a flag given by the strategy (see the module docstring).

    Args:
        precision: ``"16-mixed"``.
        device: the device for ``torch.autocast``.
        scaler: the ``GradScaler`` (kept as is: its settings and its current state).

    Attributes:
        skipped_steps: optimizer steps skipped for an overflow (as the strategy counts them).
    """

    def __init__(self, precision: str, device: str, scaler: Any) -> None:
        if scaler is None:
            raise ValueError(f"{type(self).__name__}(precision={precision!r}, scaler=None): it exists for a GradScaler")
        super().__init__(precision, device, scaler)  # type: ignore[arg-type]
        self.skipped_steps = 0
        self._flag: torch.optim.Optimizer | None = None
        self._device: torch.device | None = None  # the loss's, where the scaler keeps its scale

    @classmethod
    def replacing(cls, plugin: MixedPrecision, *args: Any) -> Any:
        """The plugin that takes ``plugin``'s place, with its precision, device and (the same) scaler."""
        return cls(plugin.precision, plugin.device, plugin.scaler, *args)

    @override
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:  # type: ignore[override]
        tensor = super().pre_backward(tensor, module)  # scaler.scale(loss): its scale is initialised now
        self._device = tensor.device
        return tensor

    def step_or_skip(self, optimizer: Any, overflowed: bool, **kwargs: Any) -> Any:
        """Step ``optimizer`` unless ``overflowed`` (the agreed flag: every rank takes the same branch), then move
        the scale by torch's rule. Returns the step's output (None when skipped)."""
        output = None
        if overflowed:
            self.skipped_steps += 1
        else:
            output = optimizer.step(**kwargs)
        self.update_scale(overflowed)
        return output

    def update_scale(self, overflowed: bool) -> None:
        """``scaler.update()`` with ``overflowed`` as its overflow flag: back off on overflow, else count towards growth.

        Any optimizer already passed to ``scaler.unscale_`` since the last update adds its own flag (a local
        overflow there is always part of the agreed one).
        """
        if not self.scaler.is_enabled():
            return
        # GradScaler records an overflow only through unscale_(optimizer); a one-element optimizer carries the
        # flag, so update() applies torch's rule (and a custom scaler's) with the scaler's public API.
        if self._flag is None:
            carrier = torch.zeros(1, device=self._device or torch.device(self.device))
            carrier.grad = torch.zeros_like(carrier)
            self._flag = torch.optim.SGD([carrier], lr=0.0)
        self._flag.param_groups[0]["params"][0].grad.fill_(float("inf") if overflowed else 0.0)
        self.scaler.unscale_(self._flag)
        self.scaler.update()

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Lightning restores a plugin's state from the key of its class name; a checkpoint written by a run with
        # the plain MixedPrecision (before the swap existed, or by another strategy) holds the scaler there.
        own, plain = type(self).__qualname__, MixedPrecision.__qualname__
        if own not in checkpoint and plain in checkpoint:
            self.load_state_dict(checkpoint[plain])
