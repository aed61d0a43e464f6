"""Flat views of a model's state: the vector every averaging algorithm works on.

Averaging algorithms act on one vector ``w ∈ R^d`` that concatenates, in registration order,
every parameter and every floating-point buffer (BatchNorm running statistics, for instance)
of a module. Integer buffers (``num_batches_tracked``) are left alone: averaging a counter
is meaningless and every replica counts the same steps anyway.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["averaged_tensors", "flatten", "relative_distance", "unflatten_into_"]


def averaged_tensors(module: nn.Module) -> list[Tensor]:
    """Parameters then floating-point buffers of ``module``, in registration order."""
    params = [p for p in module.parameters()]
    buffers = [b for b in module.buffers() if torch.is_floating_point(b)]
    return params + buffers


def flatten(tensors: list[Tensor]) -> Tensor:
    """Concatenate ``tensors`` into one new fp32 vector of their total number of elements."""
    if not tensors:
        return torch.zeros(0)
    return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])


@torch.no_grad()
def unflatten_into_(vector: Tensor, tensors: list[Tensor]) -> None:
    """Copy consecutive slices of ``vector`` back into ``tensors`` (in place, keeping dtypes)."""
    total = sum(t.numel() for t in tensors)
    assert vector.numel() == total, f"vector has {vector.numel()} elements, tensors hold {total}"
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(vector[offset : offset + n].view_as(t))
        offset += n


@torch.no_grad()
def relative_distance(tensors: list[Tensor], reference: Tensor) -> float:
    """``‖w − r‖ / ‖r‖`` with ``w`` the concatenation of ``tensors`` and ``r`` a flat vector of as many elements.

    The replica divergence of the averaging family: ``w`` a rank's parameters and float buffers, ``r`` the mean of
    the replicas. Computed tensor by tensor against slices of ``reference`` (no flat copy of ``w``), in fp64 sums.
    ``inf`` when ``r`` is zero and ``w`` is not; 0 when both are.
    """
    total = sum(t.numel() for t in tensors)
    assert reference.numel() == total, f"reference has {reference.numel()} elements, tensors hold {total}"
    squares = []  # ‖w_j − r_j‖² per tensor; one host sync at the end
    offset = 0
    for t in tensors:
        part = reference[offset : offset + t.numel()]
        offset += t.numel()
        gap = t.detach().reshape(-1).to(part.dtype) - part
        squares.append(torch.linalg.vector_norm(gap, dtype=torch.float64) ** 2)
    diff = float(torch.stack(squares).sum()) if squares else 0.0
    ref = float(torch.linalg.vector_norm(reference, dtype=torch.float64) ** 2)
    if ref == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return (diff / ref) ** 0.5
