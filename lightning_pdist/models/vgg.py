"""VGG-16 (configuration D of Simonyan & Zisserman, ICLR 2015) at full size and scaled down for benchmarks.

Paper 000 trains VGG-16 on a parameter server because one layer, ``fc6`` (25088 x 4096), holds 74.3% of
its 138,357,544 parameters: under layer-wise sharding the server that owns it is the bottleneck. This file
gives the exact layer shapes (13 bias-carrying 3x3 convolutions, five 2x2 max-pools, ``fc6``, ``fc7``,
``fc8``; ``algorithms-reference.md`` A6 lists them) and a scaled variant with the same parameter
distribution, small enough that a dozen processes train it on two CPU cores.

Scaling rule (what keeps ``fc6``'s share):
    * every convolution's channel count and the FC width (4096) are multiplied by ``width`` (rounded,
      at least 1);
    * the feature map is average-pooled to a fixed 7x7 grid before ``fc6``, as torchvision's VGG does, so
      ``fc6``'s fan-in is ``49 * 512 * width`` whatever ``in_size`` is. ``in_size`` (>= 32, five pools)
      then sets only the compute, never the parameter count;
    * the convolutions, ``fc6`` and ``fc7`` then all scale as ``width**2`` and keep their relative sizes.
      Only ``fc8`` (``4096 * width * num_classes``) scales as ``width``; pass
      ``num_classes = round(1000 * width)`` (what :func:`vgg16_scaled` does) to keep its share too.

With that rule ``fc6`` holds 74.2-74.3% of the parameters at ``width`` 1/2, 1/4 and 1/8, within 0.1
points of the full model (``python -m lightning_pdist.models.vgg`` prints the table). Keeping 1000
classes at ``width=1/8`` would let ``fc8`` grow to 20% and ``fc6`` fall to 61%; 10 classes push ``fc6``
to 76%.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

__all__ = ["VGG16", "layer_shares", "share_table", "vgg16", "vgg16_scaled"]

# (name, output channels) per convolution, "M" = 2x2 max-pool; configuration D of the paper.
_CONV_PLAN = (
    ("conv1_1", 64), ("conv1_2", 64), "M",
    ("conv2_1", 128), ("conv2_2", 128), "M",
    ("conv3_1", 256), ("conv3_2", 256), ("conv3_3", 256), "M",
    ("conv4_1", 512), ("conv4_2", 512), ("conv4_3", 512), "M",
    ("conv5_1", 512), ("conv5_2", 512), ("conv5_3", 512), "M",
)  # fmt: skip
_FC_WIDTH = 4096
_GRID = 7  # fc6 sees a 7x7 map: 224 / 2**5


def _scaled(channels: int, width: float) -> int:
    return max(1, round(channels * width))


class VGG16(nn.Module):
    """VGG-16 with named layers (``features.conv1_1`` ... ``classifier.fc8``), each with a bias.

    ::

        (3, in_size, in_size) -13 conv3x3+ReLU, 5 maxpool-> (512w, in_size/32, in_size/32)
            -adaptive avg pool-> (512w, 7, 7) -flatten-> 25088w -fc6,ReLU,dropout-> 4096w
            -fc7,ReLU,dropout-> 4096w -fc8-> num_classes

    At ``width=1`` and 1000 classes: 138,357,544 parameters, of which ``fc6`` holds 102,764,544 (74.3%).
    Initialisation follows torchvision (He-normal convolutions, N(0, 0.01) linear weights, zero biases);
    seed with ``torch.manual_seed`` for a reproducible network.

    Args:
        num_classes: logits of ``fc8``.
        width: multiplier on every channel count and on the FC width (see the module docstring); > 0.
        in_size: side of the square RGB input, >= 32 (five 2x2 pools). Changes compute, not parameters.
        dropout: dropout probability after ``fc6`` and ``fc7`` (0.5 in the paper), in [0, 1).
        device: where to allocate the parameters; ``"meta"`` builds the shapes without memory (the full
            model is 553 MB of fp32 weights).
    """

    def __init__(
        self,
        num_classes: int = 1000,
        width: float = 1.0,
        in_size: int = 224,
        dropout: float = 0.5,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        for arg, value in (("num_classes", num_classes), ("in_size", in_size)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"VGG16({arg}={value!r}): {arg} must be an int")
        if not isinstance(width, (int, float)) or isinstance(width, bool):
            raise TypeError(f"VGG16(width={width!r}): width must be a float")
        if num_classes < 1:
            raise ValueError(f"VGG16(num_classes={num_classes}): num_classes must be >= 1")
        if not width > 0:
            raise ValueError(f"VGG16(width={width}): width must be > 0")
        if in_size < 32:
            raise ValueError(f"VGG16(in_size={in_size}): in_size must be >= 32 (five 2x2 max-pools)")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"VGG16(dropout={dropout}): dropout must be in [0, 1)")
        self.num_classes, self.width, self.in_size = num_classes, float(width), in_size

        layers: list[tuple[str, nn.Module]] = []
        channels, pool = 3, 0
        for item in _CONV_PLAN:
            if item == "M":
                pool += 1
                layers.append((f"pool{pool}", nn.MaxPool2d(2)))
                continue
            name, out = item
            out = _scaled(out, width)
            layers.append((name, nn.Conv2d(channels, out, 3, padding=1, device=device)))
            layers.append((f"relu{name[4:]}", nn.ReLU(inplace=True)))
            channels = out
        self.features = nn.Sequential(OrderedDict(layers))
        self.avgpool = nn.AdaptiveAvgPool2d(_GRID)
        hidden = _scaled(_FC_WIDTH, width)
        self.classifier = nn.Sequential(
            OrderedDict(
                [
                    ("fc6", nn.Linear(channels * _GRID * _GRID, hidden, device=device)),
                    ("relu6", nn.ReLU(inplace=True)),
                    ("drop6", nn.Dropout(dropout)),
                    ("fc7", nn.Linear(hidden, hidden, device=device)),
                    ("relu7", nn.ReLU(inplace=True)),
                    ("drop7", nn.Dropout(dropout)),
                    ("fc8", nn.Linear(hidden, num_classes, device=device)),
                ]
            )
        )
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, 0.01)
                nn.init.zeros_(module.bias)

    @property
    def example_input(self) -> torch.Tensor:
        """A zero batch of one image, ``(1, 3, in_size, in_size)``, on the parameters' device."""
        device = self.classifier.fc8.weight.device
        return torch.zeros(1, 3, self.in_size, self.in_size, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, num_classes)`` for images ``(B, 3, in_size, in_size)``."""
        if x.shape[1:] != (3, self.in_size, self.in_size):
            raise ValueError(
                f"VGG16.forward(x={tuple(x.shape)}): x must be (B, 3, {self.in_size}, {self.in_size})"
            )
        return self.classifier(self.avgpool(self.features(x)).flatten(1))


def vgg16(
    num_classes: int = 1000,
    width: float = 1.0,
    in_size: int = 224,
    device: torch.device | str | None = None,
) -> VGG16:
    """VGG-16; the defaults give the exact ImageNet model of 138,357,544 parameters.

    See :class:`VGG16` for the arguments and the module docstring for how ``width`` scales the model.
    """
    return VGG16(num_classes=num_classes, width=width, in_size=in_size, device=device)


def vgg16_scaled(
    width: float = 0.125,
    in_size: int = 32,
    device: torch.device | str | None = None,
) -> VGG16:
    """VGG-16 scaled for the parameter-server benchmark, keeping the full model's parameter shares.

    Uses ``num_classes = max(2, round(1000 * width))`` so that ``fc8`` keeps its 3.0% and ``fc6`` its
    74.3% (within 0.1 points for ``width`` in [1/8, 1]). The default, ``width=1/8`` at 32x32 inputs and
    125 classes, has 2,163,493 parameters (8.7 MB of fp32), ``fc6`` holding 74.2% of them.
    """
    if not isinstance(width, (int, float)) or isinstance(width, bool):
        raise TypeError(f"vgg16_scaled(width={width!r}): width must be a float")
    if not width > 0:
        raise ValueError(f"vgg16_scaled(width={width}): width must be > 0")
    return vgg16(num_classes=max(2, round(1000 * width)), width=width, in_size=in_size, device=device)


def _layer_counts(module: nn.Module) -> dict[str, int]:
    counts: dict[str, int] = {}
    for name, param in module.named_parameters():
        layer = name.rpartition(".")[0]
        counts[layer] = counts.get(layer, 0) + param.numel()
    return counts


def layer_shares(module: nn.Module) -> dict[str, float]:
    """Fraction of ``module``'s parameters held by each owning submodule, in registration order.

    A layer's weight and bias count together (``{"features.conv1_1": ..., "classifier.fc6": 0.743, ...}``).
    Works on ``meta``-device modules.
    """
    counts = _layer_counts(module)
    total = sum(counts.values())
    if total == 0:
        raise ValueError(f"layer_shares(module={type(module).__name__}): module has no parameter elements")
    return {layer: count / total for layer, count in counts.items()}


def share_table(module: nn.Module) -> str:
    """A printable table of parameters per layer, their share, and the largest layer's share."""
    counts = _layer_counts(module)
    shares = layer_shares(module)
    total = sum(counts.values())
    width = max(len(layer) for layer in counts)
    lines = [f"{'layer':<{width}}  {'params':>12}  {'share':>6}"]
    lines += [f"{layer:<{width}}  {counts[layer]:>12,}  {shares[layer]:>6.1%}" for layer in counts]
    biggest = max(shares, key=shares.__getitem__)
    lines.append(f"{'total':<{width}}  {total:>12,}  largest: {biggest} {shares[biggest]:.1%}")
    return "\n".join(lines)


if __name__ == "__main__":
    # Prints the fc6 share of the full model and of the scaled benchmark variants.
    print(f"{'width':>6} {'in_size':>7} {'classes':>7} {'params':>12} {'fc6 share':>9}")
    configs = [(1.0, 224, 1000), (0.5, 64, 500), (0.25, 32, 250), (0.125, 32, 125), (0.125, 32, 10)]
    for w, size, classes in configs:
        model = vgg16(num_classes=classes, width=w, in_size=size, device="meta")
        total = sum(p.numel() for p in model.parameters())
        print(f"{w:>6} {size:>7} {classes:>7} {total:>12,} {layer_shares(model)['classifier.fc6']:>9.2%}")
