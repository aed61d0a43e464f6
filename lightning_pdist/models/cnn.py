"""A small convolutional classifier for 8x8 digits, 28x28 MNIST and 32x32x3 CIFAR-10."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn


class SmallCNN(nn.Sequential):
    """Three 3x3 convolutions, one 2x2 max-pool, and a linear head on a 4x4 pooled map.

    ::

        (C, S, S) -conv,relu-> (w, S, S) -conv,relu-> (2w, S, S) -maxpool-> (2w, S/2, S/2)
                  -conv,relu-> (2w, S/2, S/2) -adaptive avg pool-> (2w, 4, 4) -linear-> num_classes

    About ``54 * w**2`` convolution weights plus a ``32 * w * num_classes`` head (``w=16``: 19k parameters).
    No batch norm, so the parameters are the whole state and parameter averaging is all a distributed
    algorithm has to sync. Weights come from ``torch``'s default initialisation: seed with
    ``torch.manual_seed`` (or ``lightning.seed_everything``) before building it for a reproducible network.

    Args:
        in_channels: image channels (1 for digits and MNIST, 3 for CIFAR-10).
        num_classes: output logits.
        image_size: side of the square input images, at least 4. The head always sees a 4x4 map, so the
            parameter count does not grow with it; ``forward`` checks it, to catch a model configured for
            another dataset.
        width: channels of the first convolution; the others have ``2 * width``.
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 8, width: int = 16):
        limits = (("in_channels", in_channels, 1), ("num_classes", num_classes, 2), ("image_size", image_size, 4))
        for arg, value, low in (*limits, ("width", width, 1)):
            if value < low:
                raise ValueError(f"SmallCNN({arg}={value}): {arg} must be >= {low}")
        features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(4),
        )
        # An nn.Sequential (features, flatten, head): parameter names stay features.* and head.*, and a
        # pipeline can cut it between any two layers.
        super().__init__(OrderedDict(features=features, flatten=nn.Flatten(1), head=nn.Linear(2 * width * 4 * 4, num_classes)))
        self.in_channels, self.image_size = in_channels, image_size
        for layer in self.features:
            if isinstance(layer, nn.Conv2d):
                # He init: torch's default (kaiming_uniform with a=sqrt(5)) shrinks the signal through three
                # ReLU layers, and plain SGD then sits on a loss plateau for the first epochs.
                nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
                nn.init.zeros_(layer.bias)

    @property
    def example_input(self) -> torch.Tensor:
        """A zero batch of one image of the configured shape, ``(1, in_channels, image_size, image_size)``."""
        return torch.zeros(1, self.in_channels, self.image_size, self.image_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, num_classes)`` for images ``(B, in_channels, image_size, image_size)``."""
        if x.shape[1:] != (self.in_channels, self.image_size, self.image_size):
            raise ValueError(
                f"SmallCNN.forward(x={tuple(x.shape)}): x must be "
                f"(B, {self.in_channels}, {self.image_size}, {self.image_size})"
            )
        return super().forward(x)
