"""Sparsification math (torch only): top-k, random-k, DGC's momentum correction and sparsity warm-up.

Top-k (Aji & Heafield 2017; Stich et al. 2018 with error feedback): per tensor, ``k = ceil(ratio·d)`` entries of
largest ``|x|``, ``x = g + e``; after sending, ``e ← x − sparse(x)`` (the telescoping sum
``Σ_t sent_t + e_T = Σ_t g_t`` holds exactly, every subtraction being exact at the selected entries).

DGC (Lin, Han, Mao, Wang, Dally, *Deep Gradient Compression*, ICLR 2018), per tensor, on each rank:

* local gradient clipping: ``g ← g·min(1, c / (√N·‖g‖))`` (the threshold scaled by ``N^{-1/2}``, so that the sum over
  ``N`` ranks is clipped at about ``c``);
* momentum correction: ``u ← m·u + g``, ``v ← v + u``; send the top-k of ``|v|``;
* momentum factor masking: ``u ← u ⊙ ¬mask``, ``v ← v ⊙ ¬mask``;
* exponential sparsity warm-up: during ``warmup_steps`` the density rises in ``stages`` steps
  ``ratio^{(j+1)/(S+1)}`` (``ratio = 0.001``, ``S = 4``: 25 %, 6.3 %, 1.6 %, 0.4 %, then 0.1 %).

With ``m = 0`` and no warm-up, ``u = g`` and ``v`` is top-k's residual: DGC is top-k with error feedback.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["dgc_density", "keep_count", "local_clip", "random_indices", "topk_indices"]


def keep_count(ratio: float, numel: int) -> int:
    """``k = ceil(ratio·d)`` (at least 1 for a non-empty tensor, at most ``d``)."""
    return min(numel, max(1 if numel else 0, math.ceil(ratio * numel - 1e-12)))


def topk_indices(x: Tensor, k: int) -> Tensor:
    """Sorted flat indices of the ``k`` entries of largest ``|x|`` (ties: ``torch.topk``'s choice)."""
    flat = x.reshape(-1)
    if k >= flat.numel():
        return torch.arange(flat.numel(), device=x.device)
    return torch.topk(flat.abs(), k, sorted=False).indices.sort().values


def random_indices(numel: int, k: int, seed: int, key: int, step: int) -> Tensor:
    """Sorted indices of ``k`` of ``numel`` entries drawn from ``(seed, key, step)``: the same on every rank."""
    if k >= numel:
        return torch.arange(numel)
    generator = torch.Generator().manual_seed((seed * 1_000_003 + key * 7_919 + step) % (2**63))
    return torch.randperm(numel, generator=generator)[:k].sort().values


def local_clip(g: Tensor, clip: float | None, world_size: int) -> Tensor:
    """DGC's local gradient clipping at ``clip / √N`` (a copy; ``g`` itself when ``clip`` is None)."""
    if clip is None:
        return g
    norm = float(g.norm())
    limit = clip / math.sqrt(world_size)
    return g * (limit / norm) if norm > limit else g


def dgc_density(ratio: float, step: int, warmup_steps: int, stages: int) -> float:
    """The density at 0-based step ``step``: ``ratio^{(j+1)/(S+1)}`` in warm-up stage ``j``, then ``ratio``."""
    if step >= warmup_steps:
        return ratio
    stage = min(stages - 1, step * stages // warmup_steps)
    return ratio ** ((stage + 1) / (stages + 1))
