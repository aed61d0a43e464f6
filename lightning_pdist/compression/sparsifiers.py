"""The sparsifying compressors: :class:`TopK`, :class:`DGC` (top-k on DGC's corrected momentum), :class:`RandomK`.

Wire format of TopK/DGC for one call (a DDP bucket of ``T`` tensors): ``[uint32 n][n bytes: the coded indices of
all T tensors, positions in the concatenation, sorted (codec.encode_indices)][Σk values, fp32 or fp16]``. The
receiver knows each ``k`` (``ceil(density·d)``: the ratio, and DGC's warm-up step, are the same on every rank), so
nothing else is sent. RandomK sends values only: its positions come from a seed every rank shares.
"""

from __future__ import annotations

import struct
import zlib
from typing import Hashable, Sequence

import torch
from torch import Tensor

from lightning_pdist.compression.base import Compressed, GatheredCompressor, ReducedCompressor, check_flag, check_ratio
from lightning_pdist.compression.codec import decode_indices, encode_indices, from_bytes, to_bytes
from lightning_pdist.compression.sparse import dgc_density, keep_count, local_clip, random_indices, topk_indices
from lightning_pdist.core.compression import CompressionState
from lightning_pdist.core.push_codec import SparsePush

__all__ = ["DGC", "RandomK", "TopK"]

_VALUE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


def _check_values(owner: str, values: str) -> str:
    if values not in _VALUE_DTYPES:
        raise ValueError(f"{owner}(values={values!r}): values must be 'fp32' or 'fp16' (the dtype values travel in)")
    return values


def _stable_key(key: Hashable) -> int:
    """The same int on every rank (``hash`` of a str is salted per process)."""
    return key if isinstance(key, int) else zlib.crc32(repr(key).encode())


def _offsets(xs: Sequence[Tensor]) -> list[int]:
    out = [0]
    for x in xs:
        out.append(out[-1] + x.numel())
    return out


class TopK(GatheredCompressor):
    """Top-k sparsification: per tensor the ``k = ceil(ratio·d)`` entries of largest ``|g + e|``.

    The aggregate is ``Σ_r sparse_r / N``; with ``error_feedback`` (default) ``e ← (g + e) − sparse_own``.
    Indices travel delta-coded and Zstandard-compressed (:mod:`~lightning_pdist.compression.codec`).

    Args:
        ratio: fraction of entries sent, in ``(0, 1]`` (0.01: 1 %).
        error_feedback: keep what was not sent and add it next step (default True; without it top-k's bias
            stalls training at small ratios).
        values: ``"fp32"`` (default) or ``"fp16"``: the dtype the values travel in.
    """

    name = "topk"

    def __init__(self, ratio: float = 0.01, error_feedback: bool = True, values: str = "fp32") -> None:
        owner = type(self).__name__
        self.ratio = check_ratio(owner, ratio)
        self.error_feedback = check_flag(owner, "error_feedback", error_feedback)
        self.values = _check_values(owner, values)

    def settings(self) -> dict:
        return {"ratio": self.ratio, "error_feedback": self.error_feedback, "values": self.values}

    def density(self, key: Hashable, state: CompressionState) -> float:
        return self.ratio

    def counts(self, xs: Sequence[Tensor], keys: Sequence[Hashable], state: CompressionState) -> list[int]:
        return [keep_count(self.density(k, state), x.numel()) for x, k in zip(xs, keys)]

    def compress(self, xs: Sequence[Tensor], keys: Sequence[Hashable], state: CompressionState, group=None) -> Compressed:
        """``(indices, values)`` of each tensor's top-k, coded into one byte string."""
        dtype = _VALUE_DTYPES[self.values]
        offsets, sent, own, values = _offsets(xs), [], [], []
        for x, k, off in zip(xs, self.counts(xs, keys, state), offsets):
            idx = topk_indices(x, k)
            vals = x.reshape(-1)[idx].to(dtype)
            dense = torch.zeros(x.numel(), dtype=torch.float32, device=x.device)
            dense[idx] = vals.float()
            sent.append(idx), own.append(dense.view(x.shape)), values.append(vals)
        coded = encode_indices(torch.cat([i.cpu() + o for i, o in zip(sent, offsets)]))
        payload = struct.pack("<I", len(coded)) + coded + to_bytes(torch.cat(values))
        return Compressed(payload, own, sent)

    def push_form(self, x: Tensor, key: Hashable, state: CompressionState, rank: int):
        """A push's ``(indices, values)``: this tensor's top-k (sorted positions, values in ``values``' dtype)."""
        idx = topk_indices(x, self.counts([x], [key], state)[0])
        vals = x.reshape(-1)[idx].to(_VALUE_DTYPES[self.values])
        own = torch.zeros(x.numel(), dtype=torch.float32, device=x.device)
        own[idx] = vals.float()
        return SparsePush(idx.cpu(), vals.cpu()), own, idx

    def decompress(self, payload: bytes, xs: Sequence[Tensor], keys: Sequence[Hashable],
                   state: CompressionState) -> list[Tensor]:  # fmt: skip
        """The dense tensors (shaped like ``xs``, fp32) a payload carries."""
        dtype = _VALUE_DTYPES[self.values]
        counts, offsets = self.counts(xs, keys, state), _offsets(xs)
        (n,) = struct.unpack_from("<I", payload)
        idx = decode_indices(payload[4:4 + n], sum(counts))
        vals = from_bytes(memoryview(payload)[4 + n:], dtype, sum(counts)).float()
        flat = torch.zeros(offsets[-1], dtype=torch.float32)
        flat[idx] = vals
        return [flat[a:b].view(x.shape).to(x.device) for x, a, b in zip(xs, offsets, offsets[1:])]

    def raw_payload_bytes(self, numels: Sequence[int]) -> int:
        """The payload with raw int32 indices (the coded indices' yardstick): ``Σ k·(4 + value bytes)``."""
        ks = [keep_count(self.ratio, d) for d in numels]
        return sum(ks) * (4 + (4 if self.values == "fp32" else 2))


class DGC(TopK):
    """Deep Gradient Compression (Lin et al., ICLR 2018): top-k of momentum-corrected, accumulated gradients.

    ``u ← m·u + clip(g)``, ``v ← v + u``, send top-k of ``|v|``, then clear ``u`` and ``v`` where sent
    (:mod:`~lightning_pdist.compression.sparse` has the rules). The momentum lives here, so the user's optimizer is
    plain SGD without momentum. With ``momentum=0``, no clipping and no warm-up it is :class:`TopK` with error
    feedback.

    Args:
        ratio: final density, in ``(0, 1]`` (paper: 0.001).
        momentum: ``m`` in ``[0, 1)`` (0.9, the paper's).
        clip: local clipping threshold ``c`` (None: off), applied at ``c/√N`` per tensor.
        warmup_steps: steps of exponential sparsity warm-up (0: none; the paper uses the first epochs).
        warmup_stages: stages of the warm-up (4).
        values: ``"fp32"`` or ``"fp16"``.
    """

    name = "dgc"

    def __init__(self, ratio: float = 0.001, momentum: float = 0.9, clip: float | None = None, warmup_steps: int = 0,
                 warmup_stages: int = 4, values: str = "fp32") -> None:  # fmt: skip
        super().__init__(ratio, True, values)
        owner = type(self).__name__
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0.0 <= momentum < 1.0:
            raise ValueError(f"{owner}(momentum={momentum!r}): momentum must be a number in [0, 1)")
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip <= 0):
            raise ValueError(f"{owner}(clip={clip!r}): clip must be None or a number > 0")
        for name, value, low in (("warmup_steps", warmup_steps, 0), ("warmup_stages", warmup_stages, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{owner}({name}={value!r}): {name} must be an int >= {low}")
        self.momentum, self.clip = float(momentum), clip
        self.warmup_steps, self.warmup_stages = warmup_steps, warmup_stages

    def settings(self) -> dict:
        return {"ratio": self.ratio, "momentum": self.momentum, "clip": self.clip, "warmup_steps": self.warmup_steps,
                "warmup_stages": self.warmup_stages, "values": self.values}  # fmt: skip

    def density(self, key: Hashable, state: CompressionState) -> float:
        return dgc_density(self.ratio, self.step_of(state, key), self.warmup_steps, self.warmup_stages)

    def _u(self, g: Tensor, key: Hashable, state: CompressionState, world_size: int) -> Tensor:
        g = local_clip(g.detach().float(), self.clip, world_size)
        return state.buffer("momentum", key, g) * self.momentum + g

    def prepare(self, g: Tensor, key: Hashable, state: CompressionState, world_size: int) -> Tensor:
        return state.buffer("residual", key, g) + self._u(g, key, state, world_size)  # v + u

    def commit(self, key, state, g, x, own, sent, world_size) -> None:
        u = self._u(g, key, state, world_size).reshape(-1)
        v = x.reshape(-1).clone()
        u[sent], v[sent] = 0.0, 0.0  # momentum factor masking
        state.tensors["momentum"][key], state.tensors["residual"][key] = u.view(x.shape), v.view(x.shape)
        steps = state.extra.setdefault("steps", {})
        steps[key] = steps.get(key, 0) + 1


class RandomK(ReducedCompressor):
    """Random-k sparsification: per tensor ``k = ceil(ratio·d)`` positions drawn from a seed all ranks share.

    Every rank draws the same positions (from ``(seed, parameter, step)``), so only the ``k`` values travel, in one
    all-reduce. With ``error_feedback`` (default) the values are sent as they are and ``e`` keeps the rest; without
    it they are scaled by ``d/k``, which makes the compressor unbiased (``E[C(x)] = x``).

    Args:
        ratio: fraction of entries sent, in ``(0, 1]``.
        seed: the shared seed (an int).
        error_feedback: default True.
    """

    name = "randomk"

    def __init__(self, ratio: float = 0.01, seed: int = 0, error_feedback: bool = True) -> None:
        owner = type(self).__name__
        self.ratio = check_ratio(owner, ratio)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"{owner}(seed={seed!r}): seed must be an int >= 0")
        self.seed = seed
        self.error_feedback = check_flag(owner, "error_feedback", error_feedback)

    def settings(self) -> dict:
        return {"ratio": self.ratio, "seed": self.seed, "error_feedback": self.error_feedback}

    def positions(self, xs: Sequence[Tensor], keys: Sequence[Hashable], state: CompressionState) -> list[Tensor]:
        return [random_indices(x.numel(), keep_count(self.ratio, x.numel()), self.seed, _stable_key(k),
                               self.step_of(state, k)).to(x.device) for x, k in zip(xs, keys)]  # fmt: skip

    def _scale(self, x: Tensor, idx: Tensor) -> float:
        return 1.0 if self.error_feedback else x.numel() / idx.numel()

    def compress(self, xs: Sequence[Tensor], keys: Sequence[Hashable], state: CompressionState, group=None) -> Compressed:
        sent = self.positions(xs, keys, state)
        vals = [x.reshape(-1)[i] * self._scale(x, i) for x, i in zip(xs, sent)]
        own = []
        for x, i, v in zip(xs, sent, vals):
            dense = torch.zeros(x.numel(), dtype=torch.float32, device=x.device)
            dense[i] = v
            own.append(dense.view(x.shape))
        return Compressed(torch.cat(vals) if vals else torch.zeros(0), own, sent)

    def push_form(self, x: Tensor, key: Hashable, state: CompressionState, rank: int):
        """A push's ``(indices, values)``: a server does not draw the positions, so they travel (coded) with the values."""
        compressed = self.compress([x], [key], state)
        idx = compressed.sent[0]
        return SparsePush(idx.cpu(), x.reshape(-1)[idx].cpu() * self._scale(x, idx)), compressed.own[0], idx

    def decompress_sum(self, summed: Tensor, xs, keys, state) -> list[Tensor]:
        out, start = [], 0
        for x, i in zip(xs, self.positions(xs, keys, state)):
            dense = torch.zeros(x.numel(), dtype=torch.float32, device=x.device)
            dense[i] = summed[start:start + i.numel()]
            start += i.numel()
            out.append(dense.view(x.shape))
        return out
