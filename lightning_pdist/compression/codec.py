"""Bytes on the wire: the coded index stream of the sparse compressors, and dense values as bytes.

**Indices** (TopK, DGC; the coder lives in :mod:`lightning_pdist.core.push_codec`, which the parameter server's
compressed pushes share): a rank's selected positions, sorted, become gaps ``g_0 = i_0``, ``g_j = i_j − i_{j−1} − 1``
(non-negative; at density ``ρ`` they are about geometric with mean ``1/ρ − 1``); the gaps are stored as
little-endian uint32 and *byte-shuffled* (all low bytes, then all second bytes, ...), so the high bytes, nearly all
zero, form long runs; the result is compressed with Zstandard (``zstandard``, the reference libzstd binding,
maintained by Meta's zstd authors, level 3, no checksum, no dictionary). At ratio 0.01 a gap needs about
``log2(e/ρ) ≈ 8`` bits of entropy; byte-shuffled zstd gets within a few bits of that, against 32 bits for raw int32
indices. Zstandard over an arithmetic coder (constriction) because it needs no probability model, is
deterministic across platforms and versions (the format is frozen, RFC 8878), and decodes at GB/s on any CPU.

**Values**: fp32 or fp16, raw (their low bits are noise; an entropy coder gains nothing on them).
"""

from __future__ import annotations

import numpy as np
import torch
import zstandard
from torch import Tensor

from lightning_pdist.core.push_codec import decode_indices, encode_indices  # one coder: the PS's pushes use it too
from lightning_pdist.core.push_codec import unzstd_exact

__all__ = ["decode_indices", "encode_indices", "from_bytes", "to_bytes"]

_LEVEL = 3
_compressor = zstandard.ZstdCompressor(level=_LEVEL, write_checksum=False, write_content_size=True, write_dict_id=False)


def zstd(data: bytes) -> bytes:
    """``data`` Zstandard-compressed (the quantizers' level streams)."""
    return _compressor.compress(data)


def unzstd(data: bytes, size: int) -> bytes:
    """Exactly ``size`` bytes from a rank's level stream; a frame declaring another size is refused before any
    allocation (zstandard allocates what a frame declares, whatever ``max_output_size`` says)."""
    return unzstd_exact(data, size, "a gathered level stream")


def to_bytes(tensor: Tensor) -> bytes:
    """A tensor's raw little-endian bytes (int8/uint8/fp16/fp32/int16)."""
    t = tensor.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def from_bytes(data: bytes | memoryview, dtype: torch.dtype, count: int) -> Tensor:
    """``count`` values of ``dtype`` from ``data`` (a copy)."""
    np_dtype = {torch.float32: "<f4", torch.float16: "<f2", torch.int8: "i1", torch.uint8: "u1",
                torch.int16: "<i2"}[dtype]  # fmt: skip
    return torch.from_numpy(np.frombuffer(data, dtype=np_dtype, count=count).copy())
