"""The quantizing compressors: :class:`QSGD`, :class:`TernGrad`, :class:`Sign` (EF-sign), :class:`FP16`, :class:`BF16`.

Wire formats per call (``T`` tensors): QSGD ``T × [fp32 norm]`` + ``[uint32 n][n bytes: Zstandard of the int8 (int16
above 127 levels) signed levels]``; TernGrad ``T × [fp32 scale]`` + 2-bit packed levels (``ceil(d/4)`` bytes);
Sign ``T × [fp32 scale]`` + 1-bit packed signs (``ceil(d/8)`` bytes). FP16/BF16 all-reduce the values in half
precision (2 bytes per entry).
"""

from __future__ import annotations

import struct
from typing import Hashable, Sequence

import torch
from torch import Tensor

from lightning_pdist.compression.base import Compressed, GatheredCompressor, ReducedCompressor, check_flag
from lightning_pdist.compression.codec import from_bytes, to_bytes, unzstd, zstd
from lightning_pdist.compression.quantize import pack_bits, qsgd_levels, scaled_sign, terngrad_levels, unpack_bits
from lightning_pdist.core.compression import CompressionState
from lightning_pdist.core.push_codec import DensePush, LevelsPush

__all__ = ["BF16", "FP16", "QSGD", "Sign", "TernGrad"]


def _check_seed(owner: str, seed: object) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"{owner}(seed={seed!r}): seed must be an int >= 0")
    return seed


class _Scaled(GatheredCompressor):
    """Per tensor one fp32 scale and integer levels; ``own = scale·levels/divisor``."""

    divisor = 1.0

    def levels_of(self, x: Tensor, generator: torch.Generator | None) -> tuple[float, Tensor]:
        raise NotImplementedError

    def encode_levels(self, levels: Tensor) -> bytes:
        raise NotImplementedError

    def decode_levels(self, data: bytes, count: int) -> Tensor:
        raise NotImplementedError

    def values_of(self, scale: float, levels: Tensor) -> Tensor:
        return levels.float() * (scale / self.divisor)

    def compress(self, xs: Sequence[Tensor], keys: Sequence[Hashable], state: CompressionState, group=None) -> Compressed:
        seed = getattr(self, "seed", None)
        generator = self._generator(state, group, seed) if seed is not None else None
        scales, levels, own = [], [], []
        for x in xs:
            scale, lv = self.levels_of(x, generator)
            scale = struct.unpack("<f", struct.pack("<f", scale))[0]  # what receivers read: every rank decodes alike
            scales.append(scale), levels.append(lv.cpu()), own.append(self.values_of(scale, lv).view(x.shape))
        if generator is not None:
            state.extra["pending_generator"] = generator.get_state()
        body = self.encode_levels(torch.cat(levels) if levels else torch.zeros(0, dtype=torch.int32))
        return Compressed(struct.pack(f"<{len(xs)}f", *scales) + body, own)

    #: the dtype levels travel in, in a push (:class:`~lightning_pdist.core.push_codec.LevelsPush`)
    push_dtype = torch.int8

    def push_form(self, x: Tensor, key: Hashable, state: CompressionState, rank: int):
        """A push's ``(scale, divisor, levels)``, Zstandard-coded by the push codec."""
        seed = getattr(self, "seed", None)
        generator = self._generator(state, None, seed, rank) if seed is not None else None
        scale, lv = self.levels_of(x, generator)
        scale = struct.unpack("<f", struct.pack("<f", scale))[0]  # the fp32 the server reads
        if generator is not None:
            state.extra["pending_generator"] = generator.get_state()
        return LevelsPush(scale, self.divisor, lv.cpu().to(self.push_dtype)), self.values_of(scale, lv), None

    def decompress(self, payload: bytes, xs: Sequence[Tensor], keys, state) -> list[Tensor]:
        scales = struct.unpack_from(f"<{len(xs)}f", payload)
        levels = self.decode_levels(payload[4 * len(xs):], sum(x.numel() for x in xs))
        out, start = [], 0
        for x, scale in zip(xs, scales):
            out.append(self.values_of(scale, levels[start:start + x.numel()]).view(x.shape).to(x.device))
            start += x.numel()
        return out


class QSGD(_Scaled):
    """QSGD (Alistarh et al., NeurIPS 2017): stochastic rounding to ``levels`` levels of ``|x|/‖x‖₂``, per tensor.

    Unbiased; ``E‖Q(x) − x‖² ≤ min(d/s², √d/s)·‖x‖²``. Levels travel as int8 (int16 above 127), Zstandard-coded
    (the paper's Elias coding plays the same role: most levels are 0 or 1).

    Args:
        levels: ``s >= 1`` (16: 4 bits of magnitude).
        error_feedback: default False (QSGD is unbiased; feedback is allowed).
        seed: the rounding generator's seed (each rank adds its rank).
    """

    name = "qsgd"

    def __init__(self, levels: int = 16, error_feedback: bool = False, seed: int = 0) -> None:
        owner = type(self).__name__
        if isinstance(levels, bool) or not isinstance(levels, int) or not 1 <= levels <= 32767:
            raise ValueError(f"{owner}(levels={levels!r}): levels must be an int in [1, 32767]")
        self.levels, self.divisor = levels, float(levels)
        self.error_feedback = check_flag(owner, "error_feedback", error_feedback)
        self.seed = _check_seed(owner, seed)

    def settings(self) -> dict:
        return {"levels": self.levels, "error_feedback": self.error_feedback, "seed": self.seed}

    @property
    def _dtype(self) -> torch.dtype:
        return torch.int8 if self.levels <= 127 else torch.int16

    push_dtype = _dtype

    def levels_of(self, x, generator):
        return qsgd_levels(x, self.levels, generator)

    def encode_levels(self, levels: Tensor) -> bytes:
        coded = zstd(to_bytes(levels.to(self._dtype)))
        return struct.pack("<I", len(coded)) + coded

    def decode_levels(self, data: bytes, count: int) -> Tensor:
        (n,) = struct.unpack_from("<I", data)
        width = 1 if self._dtype == torch.int8 else 2
        return from_bytes(unzstd(data[4:4 + n], width * count), self._dtype, count).to(torch.int32)


class TernGrad(_Scaled):
    """TernGrad (Wen et al., NeurIPS 2017): ``max|x|·sign(x)·Bernoulli(|x|/max|x|)``, 2 bits per entry.

    Unbiased; ``E‖T(x) − x‖² = max|x|·‖x‖₁ − ‖x‖²``. Per tensor scaling (the paper's layer-wise ternarizing).

    Args:
        error_feedback: default False.
        seed: the rounding generator's seed (each rank adds its rank).
    """

    name = "terngrad"

    def __init__(self, error_feedback: bool = False, seed: int = 0) -> None:
        self.error_feedback = check_flag(type(self).__name__, "error_feedback", error_feedback)
        self.seed = _check_seed(type(self).__name__, seed)

    def settings(self) -> dict:
        return {"error_feedback": self.error_feedback, "seed": self.seed}

    def levels_of(self, x, generator):
        return terngrad_levels(x, generator)

    def encode_levels(self, levels: Tensor) -> bytes:
        return to_bytes(pack_bits(levels + 1, 2))

    def decode_levels(self, data: bytes, count: int) -> Tensor:
        return unpack_bits(from_bytes(data, torch.uint8, (count + 3) // 4), 2, count) - 1


class Sign(_Scaled):
    """Scaled sign, 1 bit per entry: ``(‖x‖₁/d)·sign(x)`` with ``sign(0) = +1``, averaged over the ranks.

    With ``error_feedback=True`` (default) this is EF-signSGD (Karimireddy et al., ICML 2019); without, scaled
    signSGD (biased). The majority *vote* of signs is the ``sign`` family's (``SignSGDStrategy``).

    Args:
        error_feedback: default True.
    """

    name = "sign"

    def __init__(self, error_feedback: bool = True) -> None:
        self.error_feedback = check_flag(type(self).__name__, "error_feedback", error_feedback)

    def settings(self) -> dict:
        return {"error_feedback": self.error_feedback}

    def levels_of(self, x, generator):
        scale, bits = scaled_sign(x)
        return scale, bits.to(torch.int32) * 2 - 1

    def encode_levels(self, levels: Tensor) -> bytes:
        return to_bytes(pack_bits((levels > 0).to(torch.uint8), 1))

    def decode_levels(self, data: bytes, count: int) -> Tensor:
        return unpack_bits(from_bytes(data, torch.uint8, (count + 7) // 8), 1, count) * 2 - 1


class FP16(ReducedCompressor):
    """Half-precision all-reduce (torch's ``fp16_compress_hook`` arithmetic): divide, cast, sum, cast back.

    Args:
        error_feedback: keep the rounding error ``x − half(x)`` (default False: it is below fp16's precision).
    """

    name = "fp16"
    dtype = torch.float16

    def __init__(self, error_feedback: bool = False) -> None:
        self.error_feedback = check_flag(type(self).__name__, "error_feedback", error_feedback)

    def settings(self) -> dict:
        return {"error_feedback": self.error_feedback}

    def compress(self, xs: Sequence[Tensor], keys, state, group=None) -> Compressed:
        halves = [x.reshape(-1).to(self.dtype) for x in xs]
        own = [h.float().view(x.shape) for h, x in zip(halves, xs)]
        return Compressed(torch.cat(halves) if halves else torch.zeros(0, dtype=self.dtype), own)

    def push_form(self, x: Tensor, key, state, rank: int):
        """A push's values in half precision."""
        half = x.reshape(-1).to(self.dtype)
        return DensePush(half.cpu()), half.float(), None

    def decompress_sum(self, summed: Tensor, xs, keys, state) -> list[Tensor]:
        out, start = [], 0
        for x in xs:
            out.append(summed[start:start + x.numel()].float().view(x.shape))
            start += x.numel()
        return out


class BF16(FP16):
    """bfloat16 all-reduce (torch's ``bf16_compress_hook``): fp32's range, 8 bits of mantissa."""

    name = "bf16"
    dtype = torch.bfloat16
