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

from lightning_pdist.core.push_codec import bytes_tensor as from_bytes  # one byte layout and one zstd setting,
from lightning_pdist.core.push_codec import decode_indices, encode_indices, unzstd_exact, zstd  # shared with the PS
from lightning_pdist.core.push_codec import tensor_bytes as to_bytes

__all__ = ["decode_indices", "encode_indices", "from_bytes", "to_bytes", "unzstd", "zstd"]


def unzstd(data: bytes, size: int) -> bytes:
    """Exactly ``size`` bytes from a rank's level stream; a frame declaring another size is refused before any
    allocation (zstandard allocates what a frame declares, whatever ``max_output_size`` says)."""
    return unzstd_exact(data, size, "a gathered level stream")
