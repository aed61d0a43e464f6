"""The bytes of a compressed parameter-server push, and the coded indices: shared by ``compression/`` and the PS.

A compressor (``compression/``) turns one tensor ``x`` of ``d`` elements that a worker pushes (a parameter slice
on one server) into one of three forms; the parameter server (``parameter_server/``) decodes it knowing only ``d``,
which its shard layout gives. Neither family imports the other: both import this file.

* :class:`SparsePush` ``(indices, values)``: top-k, DGC, random-k. ``x̂[indices] = values``, zero elsewhere.
* :class:`LevelsPush` ``(scale, divisor, levels)``: ``x̂ = scale·levels/divisor`` (QSGD ``divisor = s``; TernGrad,
  scaled sign ``divisor = 1``).
* :class:`DensePush` ``(values)``: all ``d`` values in fp16 or bf16.

Encoding (little-endian; each is self-delimiting once ``d`` is known, so a push of several slices is their
concatenation)::

    SPARSE  u8 1 | u8 value dtype | u32 k | u32 n | n bytes: coded indices | k values
    LEVELS  u8 2 | u8 level dtype | f32 scale | f32 divisor | u32 n | n bytes: Zstandard of d int8/int16 levels
    DENSE   u8 3 | u8 value dtype | d values                      (value dtype 0 fp32, 1 fp16, 2 bf16)

**Coded indices** (:func:`encode_indices`): sorted positions become gaps ``g_0 = i_0``, ``g_j = i_j − i_{j−1} − 1``,
stored as little-endian uint32, byte-shuffled (all low bytes, then all second bytes, ...) and Zstandard-compressed
(``zstandard``, level 3, content size in the frame header). ``docs/algorithms/compression.md`` says why zstd.

**Decoding is bounded before it allocates** (:func:`decode_push`, run by a server on bytes from the network):
``k ≤ d``; every length is checked against the bytes that are there; a Zstandard frame must declare exactly the
content size the header implies (zstd allocates what a frame declares, whatever ``max_output_size`` says);
positions must fall in ``[0, d)``; scale and divisor must be finite (divisor ``> 0``). Whatever is wrong raises
:class:`PushFormatError` (a ``ValueError``) naming the field, the value and the rule; nothing allocated exceeds
``4·d`` bytes per slice plus the input.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
import torch
import zstandard
from torch import Tensor

__all__ = ["DensePush", "LevelsPush", "PushFormatError", "SparsePush", "decode_indices", "decode_push", "unzstd_exact",
           "bytes_tensor", "encode_indices", "encode_push", "tensor_bytes", "zstd"]  # fmt: skip

SPARSE, LEVELS, DENSE = 1, 2, 3
_VALUE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # code = index
_LEVEL_DTYPES = (torch.int8, torch.int16)
_SPARSE_HEAD = struct.Struct("<BBII")
_LEVELS_HEAD = struct.Struct("<BBffI")
_DENSE_HEAD = struct.Struct("<BB")
_compressor = zstandard.ZstdCompressor(level=3, write_checksum=False, write_content_size=True, write_dict_id=False)
_decompressor = zstandard.ZstdDecompressor()


class PushFormatError(ValueError):
    """A compressed push that does not decode to the tensor its receiver expects."""


@dataclass
class SparsePush:
    indices: Tensor  # sorted, distinct, int64
    values: Tensor  # fp32, fp16 or bf16, one per index


@dataclass
class LevelsPush:
    scale: float
    divisor: float
    levels: Tensor  # int8 or int16, one per element


@dataclass
class DensePush:
    values: Tensor  # fp32, fp16 or bf16, one per element


def zstd(data: bytes) -> bytes:
    """``data`` Zstandard-compressed (level 3, the content size declared: :func:`unzstd_exact` checks it)."""
    return _compressor.compress(data)


def tensor_bytes(t: Tensor) -> bytes:
    """A tensor's raw little-endian bytes (fp32/fp16/bf16/int8/uint8/int16)."""
    t = t.detach().cpu().contiguous().reshape(-1)
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def bytes_tensor(data: bytes | memoryview, dtype: torch.dtype, count: int) -> Tensor:
    """``count`` values of ``dtype`` from ``data`` (a copy)."""
    np_dtype = {torch.float32: "<f4", torch.float16: "<f2", torch.bfloat16: "<i2", torch.int8: "i1", torch.uint8: "u1",
                torch.int16: "<i2"}[dtype]  # fmt: skip
    out = torch.from_numpy(np.frombuffer(data, dtype=np_dtype, count=count).copy())
    return out.view(torch.bfloat16) if dtype == torch.bfloat16 else out


def unzstd_exact(data: bytes | memoryview, size: int, what: str) -> bytes:
    """Exactly ``size`` bytes from one Zstandard frame that must declare that size (checked before allocating)."""
    data = bytes(data)
    if size == 0 and not data:
        return b""
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError:
        raise PushFormatError(f"{what}: not a Zstandard frame") from None
    if declared != size:
        raise PushFormatError(f"{what}: the frame declares {declared} bytes; {size} expected")
    try:
        return _decompressor.decompress(data, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as err:
        raise PushFormatError(f"{what}: {err}") from None


def encode_indices(indices: Tensor) -> bytes:
    """Sorted, distinct, non-negative int64 ``indices`` (< 2**32) as a coded byte string (empty for none)."""
    idx = indices.detach().cpu().numpy().astype(np.int64, copy=False)
    if idx.size == 0:
        return b""
    gaps = np.diff(idx, prepend=-1) - 1
    shuffled = gaps.astype("<u4").view(np.uint8).reshape(-1, 4).T
    return zstd(np.ascontiguousarray(shuffled).tobytes())


def decode_indices(data: bytes | memoryview, count: int, limit: int | None = None) -> Tensor:
    """The ``count`` sorted int64 indices :func:`encode_indices` coded into ``data``; all ``< limit`` if given."""
    if count == 0:
        if len(data):
            raise PushFormatError(f"indices: {len(data)} bytes for 0 indices")
        return torch.zeros(0, dtype=torch.int64)
    raw = np.frombuffer(unzstd_exact(data, 4 * count, "indices"), dtype=np.uint8)
    gaps = np.ascontiguousarray(raw.reshape(4, count).T).view("<u4").reshape(-1).astype(np.int64)
    idx = np.cumsum(gaps + 1) - 1  # at most count·2^32: no int64 overflow for any count that fits in memory
    if limit is not None and idx[-1] >= limit:
        raise PushFormatError(f"indices: position {int(idx[-1])} is outside the tensor of {limit} elements")
    return torch.from_numpy(idx)


def encode_push(push: SparsePush | LevelsPush | DensePush) -> bytes:
    """The bytes of one compressed tensor (see the module docstring)."""
    if isinstance(push, SparsePush):
        coded = encode_indices(push.indices)
        code = _VALUE_DTYPES.index(push.values.dtype)
        return _SPARSE_HEAD.pack(SPARSE, code, push.indices.numel(), len(coded)) + coded + tensor_bytes(push.values)
    if isinstance(push, LevelsPush):
        code = _LEVEL_DTYPES.index(push.levels.dtype)
        coded = zstd(tensor_bytes(push.levels))
        return _LEVELS_HEAD.pack(LEVELS, code, push.scale, push.divisor, len(coded)) + coded
    if isinstance(push, DensePush):
        return _DENSE_HEAD.pack(DENSE, _VALUE_DTYPES.index(push.values.dtype)) + tensor_bytes(push.values)
    raise TypeError(f"encode_push({push!r}): not a SparsePush, LevelsPush or DensePush")


def _take(data: memoryview, offset: int, n: int, what: str) -> memoryview:
    if n > len(data) - offset:
        raise PushFormatError(f"{what}: {n} bytes needed at offset {offset}; the push has {len(data) - offset} left")
    return data[offset:offset + n]


def decode_push(data: bytes | bytearray | memoryview, numel: int, offset: int = 0) -> tuple[Tensor, int]:
    """``(x̂ as fp32, offset after it)`` of the tensor of ``numel`` elements encoded at ``data[offset:]``."""
    data = memoryview(data).cast("B")
    form = _take(data, offset, 1, "form")[0]
    if form == SPARSE:
        _, code, k, n = _SPARSE_HEAD.unpack(_take(data, offset, _SPARSE_HEAD.size, "sparse header"))
        if code >= len(_VALUE_DTYPES):
            raise PushFormatError(f"value dtype code {code}: must be 0 (fp32), 1 (fp16) or 2 (bf16)")
        if k > numel:
            raise PushFormatError(f"k={k}: a sparse push of a tensor of {numel} elements carries at most {numel} entries")
        at = offset + _SPARSE_HEAD.size
        coded = _take(data, at, n, "coded indices")
        size = _VALUE_DTYPES[code].itemsize * k
        values = _take(data, at + n, size, "values")
        idx = decode_indices(coded, k, numel)
        if k > 1 and not bool((idx[1:] > idx[:-1]).all()):  # gaps are >= 0, so this holds; checked all the same
            raise PushFormatError("indices: not strictly increasing")
        out = torch.zeros(numel, dtype=torch.float32)
        out[idx] = bytes_tensor(values, _VALUE_DTYPES[code], k).float()
        return out, at + n + size
    if form == LEVELS:
        _, code, scale, divisor, n = _LEVELS_HEAD.unpack(_take(data, offset, _LEVELS_HEAD.size, "levels header"))
        if code >= len(_LEVEL_DTYPES):
            raise PushFormatError(f"level dtype code {code}: must be 0 (int8) or 1 (int16)")
        if not math.isfinite(scale):
            raise PushFormatError(f"scale={scale}: must be finite")
        if not (math.isfinite(divisor) and divisor > 0):
            raise PushFormatError(f"divisor={divisor}: must be a finite number > 0")
        at = offset + _LEVELS_HEAD.size
        dtype = _LEVEL_DTYPES[code]
        raw = unzstd_exact(_take(data, at, n, "coded levels"), dtype.itemsize * numel, "levels")
        levels = bytes_tensor(raw, dtype, numel)
        return levels.float() * (scale / divisor), at + n
    if form == DENSE:
        _, code = _DENSE_HEAD.unpack(_take(data, offset, _DENSE_HEAD.size, "dense header"))
        if code >= len(_VALUE_DTYPES):
            raise PushFormatError(f"value dtype code {code}: must be 0 (fp32), 1 (fp16) or 2 (bf16)")
        at = offset + _DENSE_HEAD.size
        size = _VALUE_DTYPES[code].itemsize * numel
        return bytes_tensor(_take(data, at, size, "values"), _VALUE_DTYPES[code], numel).float(), at + size
    raise PushFormatError(f"form {form}: must be 1 (sparse), 2 (levels) or 3 (dense)")
