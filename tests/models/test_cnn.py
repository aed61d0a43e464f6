"""SmallCNN: shapes for the three image datasets, determinism, and argument checks."""

import pytest
import torch

from lightning_pdist.models import SmallCNN


@pytest.mark.parametrize(("channels", "size"), [(1, 8), (1, 28), (3, 32)])
def test_logits_shape_for_digits_mnist_and_cifar(channels, size):
    """Digits, MNIST and CIFAR-10 shaped inputs all give (B, num_classes) logits."""
    model = SmallCNN(in_channels=channels, num_classes=10, image_size=size)
    assert model(torch.rand(5, channels, size, size)).shape == (5, 10)
    assert model.example_input.shape == (1, channels, size, size)


def test_parameter_count_does_not_grow_with_image_size():
    """The 4x4 pooled head keeps the model the same size for 8x8 and 28x28 inputs."""
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(SmallCNN(image_size=8)) == count(SmallCNN(image_size=28))


def test_same_seed_gives_same_network():
    """Building under the same torch seed gives identical weights; another seed does not."""
    torch.manual_seed(3)
    a = SmallCNN()
    torch.manual_seed(3)
    b = SmallCNN()
    torch.manual_seed(4)
    c = SmallCNN()
    for pa, pb, pc in zip(a.parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb)
    assert not torch.equal(a.head.weight, c.head.weight)


def test_wrong_input_shape_raises():
    """An input that does not match in_channels and image_size raises, naming both shapes."""
    with pytest.raises(ValueError, match=r"SmallCNN.forward\(x=\(2, 1, 28, 28\)\): x must be \(B, 1, 8, 8\)"):
        SmallCNN()(torch.zeros(2, 1, 28, 28))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(in_channels=0), r"SmallCNN\(in_channels=0\): in_channels must be >= 1"),
        (dict(num_classes=1), r"num_classes=1\): num_classes must be >= 2"),
        (dict(image_size=3), r"image_size=3\): image_size must be >= 4"),
        (dict(width=0), r"width=0\): width must be >= 1"),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    """Each out-of-range argument raises a ValueError naming it, its value and the rule."""
    with pytest.raises(ValueError, match=message):
        SmallCNN(**kwargs)
