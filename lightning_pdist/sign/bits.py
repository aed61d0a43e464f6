"""One bit per coordinate: packing sign tensors into ``uint8`` and counting votes from packed rows.

Bit order is most significant bit first, as ``numpy.packbits``: coordinate ``8i + j`` is bit
``7 − j`` of byte ``i``. A set bit means ``+1`` (``x >= 0``, so ``sign(0) = +1``; see
:mod:`lightning_pdist.sign.vote`); padding bits at the end of the last byte are 0.

Speed matters here: on 2 CPU cores a naive torch pack (multiply by ``[128, …, 1]`` and sum) plus
a Python vote loop took 0.8 s for 25M coordinates (``machine-and-network.md`` §1), more than the
network time it saves. CPU tensors therefore go through ``numpy.packbits``/``unpackbits``
(vectorized C, zero-copy views of the tensors' memory); other devices use eight shift-and-or
passes over ``n/8`` bytes. ``python -m lightning_pdist.sign.bits`` times both.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "count_ones",
    "majority_bits",
    "mask_bits_",
    "pack_bits",
    "pack_signs",
    "packed_numel",
    "truth_table_bits",
    "unpack_bits",
    "unpack_signs",
    "vote_counts",
]

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
    bits = unpack_bits(packed, n)  # fresh memory, so the arithmetic below may run in place
    signs = bits.view(torch.int8) if dtype == torch.int8 else bits.to(dtype)
    return signs.mul_(2).sub_(1)  # in place: half the time of bits.to(dtype) * 2 - 1


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


def mask_bits_(packed: Tensor, start: int, stop: int) -> Tensor:
    """Zero, in place, every bit of each row outside coordinates ``start … stop−1``; return ``packed``.

    Args:
        packed: ``(..., B)`` ``uint8``.
        start: first coordinate kept, ``0 <= start <= stop``.
        stop: one past the last coordinate kept, ``<= 8·B``.
    """
    if not 0 <= start <= stop <= 8 * packed.shape[-1]:
        raise ValueError(f"mask_bits_(start={start}, stop={stop}): need 0 <= start <= stop <= 8 * {packed.shape[-1]}")
    first, last = start // 8, stop // 8  # the bytes holding coordinates start and stop
    packed[..., :first] = 0
    if start % 8:
        packed[..., first] &= 0xFF >> (start % 8)  # MSB first: coordinate 8i + j is bit 7 − j
    if last < packed.shape[-1]:
        if stop % 8:
            packed[..., last] &= (0xFF << (8 - stop % 8)) & 0xFF
            last += 1
        packed[..., last:] = 0
    return packed


# Set bits of every byte value, for popcount by table lookup where numpy (< 2.0) has no bitwise_count.
_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)


def count_ones(packed: Tensor) -> Tensor:
    """Set bits of each row of a packed tensor: ``(..., B)`` ``uint8`` → ``(...,)`` ``int64``."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"count_ones(packed.dtype={packed.dtype}): packed must be a uint8 tensor")
    if packed.device.type != "cpu":
        table = torch.from_numpy(_POPCOUNT).to(packed.device)
        return table[packed.long()].sum(-1, dtype=torch.int64)
    array = packed.detach().numpy()
    # numpy >= 2.0's bitwise_count is a SIMD popcount, 7x faster than the table lookup.
    ones = np.bitwise_count(array) if hasattr(np, "bitwise_count") else _POPCOUNT[array]
    return torch.from_numpy(ones.sum(-1, dtype=np.int64))


def truth_table_bits(rows: Tensor, table: Sequence[bool]) -> Tensor:
    """Apply a boolean function of the ``M`` rows bit by bit, on the packed bytes.

    Output bit ``n`` is ``table[p]`` with ``p = Σ_m bit_{m,n}·2^m`` (row ``m`` is bit ``m`` of the
    pattern index). Any per-coordinate vote whose weights do not vary within the rows, the
    majority vote and the LLR vote with pooled weights alike, is such a function of ``M`` bits,
    and evaluating it on packed bytes does ``O(B)`` byte operations per table node instead of
    unpacking ``M·8B`` bytes: about 30x less work for ``M = 2``.

    The function is evaluated by Shannon expansion on the highest row,
    ``f = (row & f|row=1) | (~row & f|row=0)``, recursively. Constant sub-tables cost nothing, and
    equal sub-tables are computed once (``memo``), which keeps threshold functions (every vote) at
    a few operations per row: the majority of two rows is ``row0 | row1``.

    Args:
        rows: ``(M, B)`` ``uint8``.
        table: ``2^M`` booleans (e.g. from :func:`~lightning_pdist.sign.vote.vote_table`).

    Returns:
        ``(B,)`` ``uint8`` (a new tensor; padding bits are computed like any other, mask them with
        :func:`mask_bits_`).
    """
    num_rows, num_bytes = rows.shape
    table = tuple(bool(v) for v in table)
    if len(table) != 2**num_rows:
        raise ValueError(f"truth_table_bits(len(table)={len(table)}): need 2**M = {2**num_rows} entries for M rows")
    memo: dict[tuple[bool, ...], Tensor | int] = {}
    ZEROS, ONES = 0x00, 0xFF  # constant sub-functions stay Python ints: no tensor work for them

    def expand(sub: tuple[bool, ...]) -> Tensor | int:
        if all(sub) or not any(sub):
            return ONES if sub[0] else ZEROS
        if sub not in memo:
            half = len(sub) // 2
            row = rows[half.bit_length() - 1]  # a sub-table of 2^k entries depends on rows 0 … k−1; split on k−1
            low, high = expand(sub[:half]), expand(sub[half:])
            if isinstance(high, int) and isinstance(low, int):  # (ONES, ZEROS): the other pair is constant
                memo[sub] = row if high == ONES else ~row
            elif isinstance(high, int):
                memo[sub] = row | low if high == ONES else ~row & low
            elif isinstance(low, int):
                memo[sub] = row & high if low == ZEROS else ~row | high
            else:
                memo[sub] = (row & high) | (~row & low)
        return memo[sub]

    out = expand(table)
    if isinstance(out, int):
        return torch.full((num_bytes,), out, dtype=torch.uint8, device=rows.device)
    return out.clone() if out._base is not None else out  # a row itself (f = row) is a view of rows


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
