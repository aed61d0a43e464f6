"""Quantization math (torch only): QSGD, TernGrad, scaled sign, and the bit packing they put on the wire.

* QSGD (Alistarh, Grubic, Li, Tomioka, Vojnovic, NeurIPS 2017), ``s`` levels: ``Q(x)_i = ‖x‖₂·sign(x_i)·ξ_i/s`` with
  ``ξ_i = ⌊s|x_i|/‖x‖₂⌋ + Bernoulli(frac)``; unbiased, ``E‖Q(x) − x‖² ≤ min(d/s², √d/s)·‖x‖²`` (their Lemma 3.1).
* TernGrad (Wen et al., NeurIPS 2017): ``T(x)_i = s·sign(x_i)·b_i``, ``s = max|x|``, ``b_i ~ Bernoulli(|x_i|/s)``;
  unbiased, ``E‖T(x) − x‖² = s‖x‖₁ − ‖x‖²``.
* Scaled sign (EF-signSGD, Karimireddy et al., ICML 2019): ``C(x) = (‖x‖₁/d)·sign(x)``, ``sign(0) = +1``; biased,
  meant for error feedback.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["pack_bits", "qsgd_levels", "scaled_sign", "terngrad_levels", "unpack_bits"]


def qsgd_levels(x: Tensor, levels: int, generator: torch.Generator) -> tuple[float, Tensor]:
    """``(‖x‖₂, signed integer levels in [−s, s])``: ``Q(x) = norm·levels/s``."""
    flat = x.reshape(-1).float()
    norm = float(flat.norm())
    if norm == 0.0:
        return 0.0, torch.zeros_like(flat, dtype=torch.int32)
    scaled = flat.abs() / norm * levels
    low = scaled.floor()
    up = torch.rand(flat.shape, generator=generator, device=flat.device) < (scaled - low)
    return norm, ((low + up.float()) * torch.where(flat < 0, -1.0, 1.0)).to(torch.int32)


def terngrad_levels(x: Tensor, generator: torch.Generator) -> tuple[float, Tensor]:
    """``(max|x|, ternary levels in {−1, 0, 1})``: ``T(x) = scale·levels``."""
    flat = x.reshape(-1).float()
    scale = float(flat.abs().max()) if flat.numel() else 0.0
    if scale == 0.0:
        return 0.0, torch.zeros_like(flat, dtype=torch.int32)
    keep = torch.rand(flat.shape, generator=generator, device=flat.device) < flat.abs() / scale
    return scale, (keep.float() * torch.where(flat < 0, -1.0, 1.0)).to(torch.int32)


def scaled_sign(x: Tensor) -> tuple[float, Tensor]:
    """``(‖x‖₁/d, bits)``, bit 1 for ``x ≥ 0``: ``C(x) = scale·(2·bits − 1)``."""
    flat = x.reshape(-1).float()
    return (float(flat.abs().mean()) if flat.numel() else 0.0), (flat >= 0)


def pack_bits(values: Tensor, width: int) -> Tensor:
    """Non-negative ints ``< 2**width`` (``width`` in 1, 2, 4, 8) packed ``8/width`` per byte (uint8, little end first)."""
    per = 8 // width
    v = values.reshape(-1).to(torch.uint8)
    pad = (-v.numel()) % per
    if pad:
        v = torch.cat([v, v.new_zeros(pad)])
    v = v.view(-1, per)
    shifts = torch.arange(per, dtype=torch.uint8, device=v.device) * width
    return (v << shifts).sum(dim=1, dtype=torch.uint8) if per > 1 else v.reshape(-1)


def unpack_bits(packed: Tensor, width: int, count: int) -> Tensor:
    """Inverse of :func:`pack_bits`: ``count`` int64 values."""
    per = 8 // width
    shifts = torch.arange(per, dtype=torch.uint8) * width
    mask = (1 << width) - 1
    out = (packed.reshape(-1, 1) >> shifts) & mask
    return out.reshape(-1)[:count].to(torch.int64)
