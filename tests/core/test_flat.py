"""Tier 1: the flat-vector helpers against plain torch."""

import math

import pytest
import torch

from lightning_pdist.core.flat import relative_distance


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_relative_distance_equals_the_flat_formula(dtype):
    """‖cat(tensors) − r‖ / ‖r‖, tensor by tensor, for fp32 and fp16 tensors against an fp32 reference."""
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 4, generator=g).to(dtype), torch.randn(5, generator=g).to(dtype)]
    reference = torch.randn(17, generator=g)
    flat = torch.cat([t.reshape(-1).float() for t in tensors])
    assert relative_distance(tensors, reference) == pytest.approx(float((flat - reference).norm() / reference.norm()))


def test_relative_distance_edges():
    """Equal vectors: 0; a zero reference: 0 against zeros, inf otherwise."""
    t = [torch.ones(4)]
    assert relative_distance(t, torch.ones(4)) == 0.0
    assert relative_distance([torch.zeros(4)], torch.zeros(4)) == 0.0
    assert math.isinf(relative_distance(t, torch.zeros(4)))
