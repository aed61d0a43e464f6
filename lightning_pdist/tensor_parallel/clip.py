"""Gradient clipping over a mix of sharded (DTensor) and replicated (plain) gradients.

Under tensor parallelism a module holds both: torch's ``clip_grad_norm_`` / ``clip_grad_value_`` batch them in one
foreach call and fail ("got mixed torch.Tensor and DTensor"). The total norm is the same quantity as for the
unsharded model: ``||g||_2 = sqrt(sum_p ||g_p||_2^2)``, where a sharded gradient's norm is reduced over its shards
(DTensor does that) and a replicated one is already whole on every rank. Gradients are then scaled by
``min(1, max_norm / (||g|| + 1e-6))``, torch's rule.

:func:`install` makes a precision plugin use these two functions; everything else about the plugin is unchanged.
"""

from __future__ import annotations

from types import MethodType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_", "clip_grad_value_", "install"]


def _norm(g: torch.Tensor) -> torch.Tensor:
    if isinstance(g, DTensor) and g.device_mesh.ndim == 1 and g.placements[0].is_shard():
        # disjoint shards (Shard or the per-head _StridedShard): ||g||^2 is the sum of the shards' ||g_i||^2
        square = torch.linalg.vector_norm(g.to_local(), 2.0).square()
        dist.all_reduce(square, group=g.device_mesh.get_group())
        return square.sqrt()
    norm = torch.linalg.vector_norm(g, 2.0)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def clip_grad_norm_(parameters: Any, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ (2-norm) for parameters whose gradients may be DTensors; returns the norm."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    total = torch.linalg.vector_norm(torch.stack([_norm(g).float() for g in grads]), 2.0)
    coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    for g in grads:
        g.mul_(coef)
    return total


def clip_grad_value_(parameters: Any, clip_value: float) -> None:
    """torch.nn.utils.clip_grad_value_ for parameters whose gradients may be DTensors (each clamped on its own)."""
    for p in parameters:
        if p.grad is not None:
            p.grad.clamp_(-clip_value, clip_value)


def install(precision_plugin: Any) -> None:
    """Point ``precision_plugin``'s clip_grad_by_norm / clip_grad_by_value at the functions above."""

    def by_norm(self: Any, optimizer: Any, clip_val: float) -> None:
        clip_grad_norm_(self.main_params(optimizer), clip_val)

    def by_value(self: Any, optimizer: Any, clip_val: float) -> None:
        clip_grad_value_(self.main_params(optimizer), clip_val)

    precision_plugin.clip_grad_by_norm = MethodType(by_norm, precision_plugin)
    precision_plugin.clip_grad_by_value = MethodType(by_value, precision_plugin)
