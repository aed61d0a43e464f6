"""A one-hidden-layer perceptron on flattened images: the smallest baseline model."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """``flatten -> linear(in_features, hidden) -> relu -> linear(hidden, num_classes)``.

    Args:
        in_features: inputs per sample after flattening (``channels * height * width``).
        num_classes: output logits.
        hidden: hidden units.
    """

    def __init__(self, in_features: int = 64, num_classes: int = 10, hidden: int = 128):
        super().__init__()
        limits = (("in_features", in_features, 1), ("num_classes", num_classes, 2), ("hidden", hidden, 1))
        for arg, value, low in limits:
            if value < low:
                raise ValueError(f"MLP({arg}={value}): {arg} must be >= {low}")
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, num_classes)`` for inputs ``(B, ...)`` with ``in_features`` values each."""
        return self.net(x)
