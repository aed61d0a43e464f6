"""One bit per coordinate: packing sign tensors into ``uint8`` and counting votes from packed rows.

Bit order is most significant bit first, as ``numpy.packbits``: coordinate ``8i + j`` is bit
``7 − j`` of byte ``i``. A set bit means ``+1`` (``x >= 0``, so ``sign(0) = +1``; see
:mod:`lightning_pdist.algorithms.sign`); padding bits at the end of the last byte are 0.

Speed matters here: on 2 CPU cores a naive torch pack (multiply by ``[128, …, 1]`` and sum) plus
a Python vote loop took 0.8 s for 25M coordinates (``machine-and-network.md`` §1), more than the
network time it saves. CPU tensors therefore go through ``numpy.packbits``/``unpackbits``
(vectorized C, zero-copy views of the tensors' memory); other devices use eight shift-and-or
passes over ``n/8`` bytes. ``python -m lightning_pdist.comm.bits`` times both.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

__all__ = ["majority_bits", "pack_bits", "pack_signs", "packed_numel", "unpack_bits", "unpack_signs", "vote_counts"]

_SHIFTS = (7, 6, 5, 4, 3, 2, 1, 0)


def packed_numel(n: int) -> int:
    """Bytes that hold ``n`` bits: ``ceil(n / 8)``."""
    return (n + 7) // 8


def _pack_bits_torch(bits: Tensor) -> Tensor:
    n = bits.shape[-1]
    pad = (-n) % 8
    b = bits.to(torch.uint8)
    if pad:
        b = torch.nn.functional.pad(b, (0, pad))
    b = b.reshape(*b.shape[:-1], -1, 8)  # (..., ceil(n/8), 8)
    out = b[..., 0] << 7
    for j in range(1, 8):
        out |= b[..., j] << _SHIFTS[j]
    return out  # (..., ceil(n/8))


def _unpack_bits_torch(packed: Tensor, n: int) -> Tensor:
    shifts = torch.tensor(_SHIFTS, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(-1) >> shifts) & 1  # (..., B, 8)
    return bits.reshape(*packed.shape[:-1], -1)[..., :n].to(torch.bool)  # (..., n)


def pack_bits(bits: Tensor) -> Tensor:
    """Pack a boolean tensor along its last dimension, 8 bits per byte.

    Args:
        bits: ``(..., n)`` bool.

    Returns:
        ``(..., ceil(n/8))`` ``uint8`` (a new tensor).
    """
    if bits.dtype != torch.bool:
        raise TypeError(f"pack_bits(bits.dtype={bits.dtype}): bits must be a bool tensor")
    if bits.device.type != "cpu":
        return _pack_bits_torch(bits)
    return torch.from_numpy(np.packbits(bits.detach().numpy(), axis=-1))


def unpack_bits(packed: Tensor, n: int) -> Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` bits of each row.

    Args:
        packed: ``(..., B)`` ``uint8`` with ``8·B >= n``; need not be contiguous.
        n: bits per row to return.

    Returns:
        ``(..., n)`` bool.
    """
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_bits(packed.dtype={packed.dtype}): packed must be a uint8 tensor")
    if not 0 <= n <= 8 * packed.shape[-1]:
        raise ValueError(
            f"unpack_bits(n={n}): n must be in [0, 8 * {packed.shape[-1]}] for rows of {packed.shape[-1]} bytes"
        )
    if packed.device.type != "cpu":
        return _unpack_bits_torch(packed, n)
    bits = np.unpackbits(packed.numpy(), axis=-1, count=n)  # (..., n) uint8 0/1
    return torch.from_numpy(bits).view(torch.bool)


_NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)


def pack_signs(x: Tensor) -> Tensor:
    """Pack ``sign(x)`` (``x >= 0`` → bit 1) of a flat or batched tensor along its last dimension."""
    if x.device.type == "cpu" and x.dtype in _NUMPY_FLOATS:
        # numpy's SIMD comparison is ~4x faster than torch's on one CPU thread (bf16 has no numpy type).
        return torch.from_numpy(np.packbits(x.detach().numpy() >= 0, axis=-1))
    return pack_bits(x >= 0)


def unpack_signs(packed: Tensor, n: int, dtype: torch.dtype = torch.int8) -> Tensor:
    """Unpack to ``±1`` of ``dtype``: ``(..., B)`` ``uint8`` → ``(..., n)``."""
    bits = unpack_bits(packed, n)
    return bits.to(dtype) * 2 - 1


def vote_counts(packed: Tensor, n: int) -> Tensor:
    """Per-coordinate number of ``+1`` votes across the rows of a packed sign matrix.

    Unpacks to one byte per vote and sums the rows: ``M·n`` bytes of scratch, ``O(M·n)`` work,
    vectorized over coordinates. In ``uint8`` while ``M < 256`` (no overflow), else ``int32``.

    Args:
        packed: ``(M, B)`` ``uint8``, one worker per row.
        n: coordinates per row.

    Returns:
        ``(n,)`` counts in ``[0, M]``.
    """
    if packed.dim() != 2:
        raise ValueError(
            f"vote_counts(packed.shape={tuple(packed.shape)}): packed must be a 2-D (workers, bytes) tensor"
        )
    bits = unpack_bits(packed, n).view(torch.uint8)  # (M, n)
    dtype = torch.uint8 if packed.shape[0] < 256 else torch.int32
    return bits.sum(0, dtype=dtype)  # (n,)


def majority_bits(packed: Tensor, n: int) -> Tensor:
    """The majority vote as bits: ``Σ_m Y_m >= 0`` ⇔ ``2·count >= M`` (ties to ``+1``).

    Args:
        packed: ``(M, B)`` ``uint8`` sign rows.
        n: coordinates per row.

    Returns:
        ``(n,)`` bool, True for ``+1``.
    """
    num_workers = packed.shape[0]
    # count >= ceil(M/2) instead of 2·count >= M: no doubling, so no uint8 overflow.
    return vote_counts(packed, n) >= (num_workers + 1) // 2


def _benchmark(numel: int = 4 * 1024 * 1024, repeats: int = 10) -> dict[str, float]:
    """Milliseconds per call of pack and unpack of ``numel`` signs, numpy and torch paths."""
    import time

    x = torch.randn(numel)

    def timed(fn) -> float:
        fn()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) / repeats * 1e3

    bits = x >= 0
    packed = pack_bits(bits)
    return {
        "numel": numel,
        "threads": torch.get_num_threads(),
        "pack_signs_ms": timed(lambda: pack_signs(x)),
        "unpack_bits_ms": timed(lambda: unpack_bits(packed, numel)),
        "unpack_signs_int8_ms": timed(lambda: unpack_signs(packed, numel)),
        "torch_pack_bits_ms": timed(lambda: _pack_bits_torch(bits)),
        "torch_unpack_bits_ms": timed(lambda: _unpack_bits_torch(packed, numel)),
    }


if __name__ == "__main__":
    import json

    torch.set_num_threads(1)
    print(json.dumps(_benchmark(), indent=2))
