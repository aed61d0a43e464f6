"""Counted collectives: torch.distributed calls that also record the bytes this rank sends.

Every collective our strategies issue for training goes through here, so the per-step byte
count logged as ``pdist/comm_bytes`` is complete. The byte model is in
:mod:`lightning_pdist.core.accounting`.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from lightning_pdist.core.accounting import CommMeter, all_reduce_bytes, broadcast_bytes

__all__ = ["all_reduce_mean_", "all_reduce_sum_", "broadcast_", "group_size", "rank_world"]


def rank_world() -> tuple[int, int]:
    """(global rank, world size) of the default process group; ``(0, 1)`` if not initialized."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def group_size(process_group: dist.ProcessGroup | None = None) -> int:
    """World size of ``process_group`` (the default group if ``None``); 1 if not initialized."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(process_group)


def all_reduce_sum_(
    tensor: Tensor,
    process_group: dist.ProcessGroup | None = None,
    meter: CommMeter | None = None,
    kind: str = "all_reduce",
) -> Tensor:
    """Sum ``tensor`` over the group in place (ring all-reduce: ``2(N-1)/N·n`` bytes sent)."""
    world_size = group_size(process_group)
    if world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=process_group)
        if meter is not None:
            meter.add(kind, all_reduce_bytes(tensor.numel() * tensor.element_size(), world_size))
    return tensor


def all_reduce_mean_(
    tensor: Tensor,
    process_group: dist.ProcessGroup | None = None,
    meter: CommMeter | None = None,
    kind: str = "all_reduce",
) -> Tensor:
    """Average ``tensor`` over the group in place."""
    # Divide first, as PyTorch's allreduce_hook does, so low-precision sums cannot overflow.
    return all_reduce_sum_(tensor.div_(group_size(process_group)), process_group, meter, kind)


def broadcast_(
    tensor: Tensor,
    src: int = 0,
    process_group: dist.ProcessGroup | None = None,
    meter: CommMeter | None = None,
    kind: str = "broadcast",
) -> Tensor:
    """Broadcast ``tensor`` from global rank ``src`` in place (the source sends ``n`` bytes)."""
    world_size = group_size(process_group)
    if world_size > 1:
        dist.broadcast(tensor, src=src, group=process_group)
        if meter is not None:
            is_src = dist.get_rank() == src
            meter.add(kind, broadcast_bytes(tensor.numel() * tensor.element_size(), world_size, is_src))
    return tensor
