"""VGG-16: exact ImageNet layer shapes, fc6's share in the scaled variants, and a CPU forward/backward pass."""

import pytest
import torch
from torch import nn

from lightning_pdist.models.vgg import VGG16, layer_shares, share_table, vgg16, vgg16_scaled

FC6_SHARE = 102_764_544 / 138_357_544  # 0.7427, algorithms-reference.md A6


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_full_vgg16_has_the_exact_reference_shapes():
    """On the meta device, width 1 at 224x224 gives 138,357,544 parameters in A6's 16 layers."""
    model = vgg16(device="meta")
    assert _count(model) == 138_357_544
    convs = [m for m in model.features if isinstance(m, nn.Conv2d)]
    assert len(convs) == 13
    assert all(c.kernel_size == (3, 3) and c.padding == (1, 1) and c.bias is not None for c in convs)
    assert [c.out_channels for c in convs] == [64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512, 512]
    fc = model.classifier
    assert (fc.fc6.weight.shape, fc.fc7.weight.shape, fc.fc8.weight.shape) == ((4096, 25088), (4096, 4096), (1000, 4096))
    shares = layer_shares(model)
    assert list(shares)[0] == "features.conv1_1" and list(shares)[-1] == "classifier.fc8"
    assert shares["classifier.fc6"] == pytest.approx(FC6_SHARE, abs=1e-12)
    assert model.classifier.fc6.weight.is_meta


@pytest.mark.parametrize("width, in_size", [(0.5, 64), (0.25, 32), (0.125, 32), (0.0625, 32)])
def test_scaled_variants_keep_fc6_share_within_two_points(width, in_size):
    """vgg16_scaled keeps fc6 at 74.3% +- 2 points (in fact +- 0.2) and fc6 stays the biggest layer."""
    model = vgg16_scaled(width=width, in_size=in_size, device="meta")
    shares = layer_shares(model)
    assert abs(shares["classifier.fc6"] - FC6_SHARE) < 0.002
    assert max(shares, key=shares.get) == "classifier.fc6"
    assert model.num_classes == round(1000 * width)


def test_keeping_1000_classes_at_small_width_would_break_the_share():
    """Without scaling num_classes, fc8 grows and fc6 drops below 65% at width 1/8: the rule matters."""
    assert layer_shares(vgg16(width=0.125, in_size=32, device="meta"))["classifier.fc6"] < 0.65


def test_input_size_changes_compute_not_parameters():
    """The 7x7 pooled grid fixes fc6's fan-in, so 32x32 and 224x224 inputs give the same model size."""
    assert _count(vgg16(width=0.25, in_size=32, device="meta")) == _count(vgg16(width=0.25, in_size=224, device="meta"))


def test_small_scaled_model_trains_one_step_on_cpu():
    """A width-1/16 model maps (2, 3, 32, 32) to finite logits and backprop reaches every parameter."""
    torch.manual_seed(0)
    model = vgg16_scaled(width=0.0625, in_size=32)
    logits = model(torch.randn(2, 3, 32, 32))
    assert logits.shape == (2, 62) and torch.isfinite(logits).all()
    nn.functional.cross_entropy(logits, torch.tensor([0, 1])).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert model.example_input.shape == (1, 3, 32, 32)


def test_share_table_prints_every_layer_and_the_largest():
    """share_table lists the 16 layers and ends with the total and fc6's share."""
    lines = share_table(vgg16(device="meta")).splitlines()
    assert len(lines) == 1 + 16 + 1
    assert lines[-1].split() == ["total", "138,357,544", "largest:", "classifier.fc6", "74.3%"]


def test_wrong_input_shape_raises():
    """An image of another size than in_size raises, naming both shapes."""
    with pytest.raises(ValueError, match=r"VGG16.forward\(x=\(1, 3, 64, 64\)\): x must be \(B, 3, 32, 32\)"):
        vgg16_scaled(width=0.0625)(torch.zeros(1, 3, 64, 64))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(num_classes=0), ValueError, r"VGG16\(num_classes=0\): num_classes must be >= 1"),
        (dict(width=0.0), ValueError, r"VGG16\(width=0.0\): width must be > 0"),
        (dict(in_size=16), ValueError, r"VGG16\(in_size=16\): in_size must be >= 32"),
        (dict(dropout=1.0), ValueError, r"VGG16\(dropout=1.0\): dropout must be in \[0, 1\)"),
        (dict(in_size=32.0), TypeError, r"VGG16\(in_size=32.0\): in_size must be an int"),
        (dict(width="1"), TypeError, r"VGG16\(width='1'\): width must be a float"),
    ],
)
def test_bad_arguments_raise(kwargs, error, match):
    """Each bad argument raises with its name, value and rule."""
    with pytest.raises(error, match=match):
        VGG16(device="meta", **kwargs)


def test_scaled_bad_width_raises():
    """vgg16_scaled checks its width before deriving num_classes from it."""
    with pytest.raises(ValueError, match=r"vgg16_scaled\(width=-1\): width must be > 0"):
        vgg16_scaled(width=-1)
    with pytest.raises(TypeError, match=r"vgg16_scaled\(width=None\): width must be a float"):
        vgg16_scaled(width=None)
