"""Block-wise integer quantization of Streaming DiLoCo's outer gradients (CPU reference, any tensor shape).

The flat pseudo-gradient is cut into blocks of :data:`BLOCK` values; each block keeps one fp32 scale
``s = max|x| / q_max`` and integer codes ``round(x / s)`` clamped to ``[-q_max, q_max]`` (``q_max`` = 127 for int8,
7 for int4), stored biased by ``q_max`` as unsigned bytes, two codes per byte for int4. Dequantization is
``s · code``. Per element the error is at most ``s/2``; values that are integer multiples of their block's ``s``
round-trip exactly (0 in particular). Douillard et al. (Streaming DiLoCo, arXiv 2501.18512) send 4-bit floats
(E3M0); uniform int4 with a per-block scale is the integer counterpart, with the same 4 bits a value.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["BLOCK", "QMAX", "code_bytes", "dequantize", "quantize"]

#: Values per scale.
BLOCK = 64
#: Largest code magnitude per format.
QMAX = {"int8": 127, "int4": 7}


def _blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def code_bytes(numel: int, fmt: str) -> tuple[int, int]:
    """(bytes of codes, bytes of scales) that :func:`quantize` makes of ``numel`` values."""
    padded = _blocks(numel) * BLOCK
    return (padded if fmt == "int8" else padded // 2), 4 * _blocks(numel)


@torch.no_grad()
def quantize(x: Tensor, fmt: str) -> tuple[Tensor, Tensor]:
    """``(codes uint8, scales fp32)`` of the flat tensor ``x`` (see the module docstring)."""
    qmax = QMAX[fmt]
    n = x.numel()
    padded = torch.zeros(_blocks(n) * BLOCK, dtype=torch.float32, device=x.device)
    padded[:n] = x.reshape(-1)
    blocks = padded.view(-1, BLOCK)
    scales = blocks.abs().amax(dim=1) / qmax
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = (torch.round(blocks / safe[:, None]).clamp_(-qmax, qmax) + qmax).to(torch.uint8).reshape(-1)
    if fmt == "int4":
        codes = codes[0::2] | (codes[1::2] << 4)
    return codes, scales


@torch.no_grad()
def dequantize(codes: Tensor, scales: Tensor, fmt: str, numel: int) -> Tensor:
    """The fp32 vector of ``numel`` values that ``quantize`` encoded as ``codes`` and ``scales``."""
    qmax = QMAX[fmt]
    if fmt == "int4":
        codes = torch.stack([codes & 0x0F, codes >> 4], dim=1).reshape(-1)
    values = (codes.to(torch.float32) - qmax).view(-1, BLOCK) * scales[:, None]
    return values.reshape(-1)[:numel]
