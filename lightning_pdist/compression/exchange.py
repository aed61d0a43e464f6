"""The two ways compressed payloads cross the wire (gloo and NCCL alike), each with the step's non-finite flags.

* :func:`gather_payloads`: variable-length byte payloads (the sparse and quantized compressors). One all-gather of
  every rank's ``(length, non-finite flag)`` (two int64), then one ``all_to_all_single`` with uneven splits in which
  each rank sends its own payload to each other rank: an all-gather of unequal sizes (gloo's ``allgather`` needs
  equal sizes; nothing is padded, nothing densified). Bytes this rank sends: ``(N − 1)·(16 + n_own)``.
* :func:`reduce_values`: a dense vector every rank can add (random-k's shared positions, fp16/bf16 values): one
  all-reduce of the vector with one more element counting the non-finite ranks. Bytes: ``2(N − 1)/N·(n + 1)·b``.

Either returns ``None`` on every rank when some rank flagged non-finite input, before anything was decoded.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_pdist.core.accounting import CommMeter, all_gather_bytes, all_reduce_bytes

__all__ = ["gather_payloads", "gather_wire_bytes", "reduce_values"]


def _size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def gather_wire_bytes(payload_len: int, world_size: int) -> int:
    """Bytes one rank sends in :func:`gather_payloads` for a payload of ``payload_len`` bytes."""
    return all_gather_bytes(16, world_size) + all_gather_bytes(payload_len, world_size)


def gather_payloads(payload: bytes, nonfinite: bool, group: dist.ProcessGroup | None, meter: CommMeter | None,
                    kind: str) -> list[bytes] | None:  # fmt: skip
    """Every rank's payload, in rank order (``None`` on every rank if some rank flagged non-finite input)."""
    world_size = _size(group)
    if world_size == 1:
        return None if nonfinite else [payload]
    header = torch.tensor([len(payload), int(nonfinite)], dtype=torch.int64)
    headers = [torch.empty_like(header) for _ in range(world_size)]
    dist.all_gather(headers, header, group=group)
    if meter is not None:
        meter.add(kind, gather_wire_bytes(len(payload), world_size))
    if any(int(h[1]) for h in headers):
        return None
    sizes = [int(h[0]) for h in headers]
    own = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
    out = torch.empty(sum(sizes), dtype=torch.uint8)
    dist.all_to_all_single(out, own.repeat(world_size), output_split_sizes=sizes,
                           input_split_sizes=[len(payload)] * world_size, group=group)  # fmt: skip
    data = out.numpy().tobytes()
    offsets = [sum(sizes[:r]) for r in range(world_size + 1)]
    return [data[offsets[r]:offsets[r + 1]] for r in range(world_size)]


def reduce_values(values: Tensor, nonfinite: bool, group: dist.ProcessGroup | None, meter: CommMeter | None,
                  kind: str) -> Tensor | None:  # fmt: skip
    """``Σ_r values_r / N`` (divided before the sum, as DDP does), or ``None`` if some rank flagged non-finite input."""
    world_size = _size(group)
    vec = torch.cat([values.reshape(-1) / world_size, values.new_full((1,), float(nonfinite))])
    if world_size > 1:
        dist.all_reduce(vec, group=group)
        if meter is not None:
            meter.add(kind, all_reduce_bytes(vec.numel() * vec.element_size(), world_size))
    if float(vec[-1]) != 0.0:
        return None
    return vec[:-1]
