"""The two compressor bases: payloads gathered (sparse, quantized) or values all-reduced (random-k, fp16/bf16).

Each step, per call of :meth:`~lightning_pdist.core.compression.Compressor.mean` (a DDP bucket, a model delta):

1. ``x = prepare(g)``: ``g + e`` with error feedback (``e`` the rank's residual, 0 without), DGC's ``v``;
2. ``compress(xs) -> Compressed(payload, own)``: the bytes this rank sends, and ``own``, the dense tensors the
   receivers will decode from them (``decompress(payload) == own`` exactly);
3. the exchange (:mod:`.exchange`), with every rank's non-finite flag: if some rank's ``x`` was not finite nothing
   below happens and the state is left as it was (random generators included);
4. ``aggregate``: ``Σ_r decompress(payload_r) / N`` in rank order (each term divided first, as DDP divides before it
   sums, so a lossless setting gives DDP's bits on two ranks);
5. ``commit``: ``e ← x − own`` (error feedback) and the per-key step counts.

A parameter-server push (:meth:`_EFCompressor.compress_push`) runs 1, the compressor's ``push_form`` (one
:mod:`~lightning_pdist.core.push_codec` form per tensor, which a server decodes without this family) and 5 on the
worker; the server decodes and applies its rule. Steps 3 and 4 are the server's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_pdist.compression.exchange import gather_payloads, reduce_values
from lightning_pdist.core.accounting import CommMeter
from lightning_pdist.core.compression import CompressionState, Compressor
from lightning_pdist.core.push_codec import DensePush, LevelsPush, SparsePush, encode_push

__all__ = ["Compressed", "GatheredCompressor", "ReducedCompressor", "check_ratio"]


@dataclass
class Compressed:
    """What :meth:`compress` returns: the wire bytes (or the vector to all-reduce) and the dense ``own`` decode."""

    payload: bytes | Tensor
    own: list[Tensor]
    sent: list[Tensor] | None = None  # the positions sent, per tensor (the sparse compressors)


def check_ratio(owner: str, ratio: float) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 < float(ratio) <= 1.0:
        raise ValueError(f"{owner}(ratio={ratio!r}): ratio must be a number in (0, 1] (the fraction of entries sent)")
    return float(ratio)


def check_flag(owner: str, name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}({name}={value!r}): {name} must be True or False")
    return value


def _rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


class _EFCompressor(Compressor):
    """Error feedback and the step protocol shared by both bases."""

    def prepare(self, g: Tensor, key: Hashable, state: CompressionState, world_size: int) -> Tensor:
        """The tensor to compress: ``g + e`` with error feedback, else ``g`` (fp32; the state is not changed)."""
        x = g.detach().float()
        if self.error_feedback:
            x = x + state.buffer("residual", key, x)
        return x

    def commit(self, key: Hashable, state: CompressionState, g: Tensor, x: Tensor, own: Tensor,
               sent: Tensor | None, world_size: int) -> None:  # fmt: skip
        """After a finite exchange: ``e ← x − own`` and this key's step count."""
        if self.error_feedback:
            state.tensors["residual"][key] = (x - own).reshape(x.shape)
        steps = state.extra.setdefault("steps", {})
        steps[key] = steps.get(key, 0) + 1

    def step_of(self, state: CompressionState, key: Hashable) -> int:
        return state.extra.get("steps", {}).get(key, 0)

    def _generator(self, state: CompressionState, group: dist.ProcessGroup | None, seed: int,
                   rank: int | None = None) -> torch.Generator:  # fmt: skip
        """The rank's own sampling generator (``seed + rank``), its state kept in ``state`` (checkpointed)."""
        generator = torch.Generator()
        saved = state.extra.get("generator")
        if saved is None:
            generator.manual_seed(seed * 1_000_003 + (_rank(group)[0] if rank is None else rank))
        else:
            generator.set_state(saved)
        return generator

    def push_form(self, x: Tensor, key: Hashable, state: CompressionState,
                  rank: int) -> tuple[SparsePush | LevelsPush | DensePush, Tensor, Tensor | None]:  # fmt: skip
        """``(push form, x̂, positions sent or None)`` of one tensor ``x`` a worker pushes to a parameter server."""
        raise NotImplementedError

    def compress_push(self, g: Tensor, key: Hashable, state: CompressionState, rank: int,
                      world_size: int) -> tuple[bytes, Tensor]:  # fmt: skip
        """A parameter-server push: ``x = prepare(g)``, its push form's bytes, then ``commit`` (``e ← x − x̂``) here."""
        x = self.prepare(g, key, state, world_size)
        form, own, sent = self.push_form(x, key, state, rank)
        if "pending_generator" in state.extra:
            state.extra["generator"] = state.extra.pop("pending_generator")
        self.commit(key, state, g, x, own.reshape(x.shape), sent, world_size)
        return encode_push(form), own.reshape(g.shape)

    def mean(self, tensors: Sequence[Tensor], keys: Sequence[Hashable], state: CompressionState,
             group: dist.ProcessGroup | None, meter: CommMeter | None, kind: str) -> list[Tensor] | None:  # fmt: skip
        rank, world_size = _rank(group)
        xs = [self.prepare(g, k, state, world_size) for g, k in zip(tensors, keys)]
        nonfinite = not all(bool(torch.isfinite(x).all()) for x in xs)
        packed = self.compress(xs, keys, state, group)
        nonfinite = nonfinite or not all(bool(torch.isfinite(o).all()) for o in packed.own)
        out = self.exchange(packed, xs, keys, state, nonfinite, group, meter, kind)
        if out is None:
            state.extra.pop("pending_generator", None)
            return None
        if "pending_generator" in state.extra:
            state.extra["generator"] = state.extra.pop("pending_generator")
        for i, (g, k, x, own) in enumerate(zip(tensors, keys, xs, packed.own)):
            self.commit(k, state, g, x, own, packed.sent[i] if packed.sent else None, world_size)
        return [o.to(g.dtype).reshape(g.shape) for o, g in zip(out, tensors)]


class GatheredCompressor(_EFCompressor):
    """Payloads are bytes of any length, gathered by every rank (:func:`~.exchange.gather_payloads`)."""

    def exchange(self, packed: Compressed, xs: list[Tensor], keys: Sequence[Hashable], state: CompressionState,
                 nonfinite: bool, group, meter, kind) -> list[Tensor] | None:  # fmt: skip
        payloads = gather_payloads(packed.payload, nonfinite, group, meter, kind)
        if payloads is None:
            return None
        rank, world_size = _rank(group)
        decoded = [packed.own if r == rank else self.decompress(p, xs, keys, state) for r, p in enumerate(payloads)]
        return self.aggregate(decoded, world_size)

    def aggregate(self, decoded: list[list[Tensor]], world_size: int) -> list[Tensor]:
        """``Σ_r decoded_r / N`` per tensor, in rank order."""
        out = [torch.zeros_like(t) for t in decoded[0]]
        for per_rank in decoded:
            for acc, t in zip(out, per_rank):
                acc.add_(t / world_size)
        return out


class ReducedCompressor(_EFCompressor):
    """Payloads are dense vectors every rank adds in place (:func:`~.exchange.reduce_values`)."""

    def exchange(self, packed: Compressed, xs: list[Tensor], keys: Sequence[Hashable], state: CompressionState,
                 nonfinite: bool, group, meter, kind) -> list[Tensor] | None:  # fmt: skip
        summed = reduce_values(packed.payload, nonfinite, group, meter, kind)
        return None if summed is None else self.decompress_sum(summed, xs, keys, state)
