"""Megatron's conjugate collectives as autograd functions over the tensor-parallel group, counted in bytes.

Megatron-LM (Shoeybi et al., 2019, ``megatron/core/tensor_parallel/mappings.py``) makes a sharded layer pair
exact with two operators that are each other's transpose:

* ``f`` = :func:`copy_to` before a column-parallel layer: identity forward, all-reduce of the input gradient
  backward (each rank's gradient is the part that flows through its columns; the input's gradient is their sum);
* ``g`` = :func:`reduce_from` after a row-parallel layer: all-reduce forward (sum of the partial products),
  identity backward.

Sequence parallelism (Korthikanti et al., 2022) replaces them, around the same layers, by the pair
all-gather / reduce-scatter along the sequence dimension: :func:`gather_seq` (all-gather forward,
reduce-scatter backward) before a column-parallel layer, :func:`scatter_seq` (reduce-scatter forward,
all-gather backward) after a row-parallel one. At the edges of a sequence-parallel region :func:`split_seq`
takes this rank's chunk (backward: all-gather) and :func:`gather_seq_replicated` gathers the chunks into the
replicated activation (backward: this rank's chunk of the gradient, which is the same on every rank).

These run on plain tensors: DTensor's dispatch is not on the hot path. gloo has no reduce-scatter; it is an
all-reduce of the whole tensor followed by taking this rank's chunk, and counted as the all-reduce it is.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from lightning_pdist.core.accounting import CommMeter, all_gather_bytes, all_reduce_bytes, reduce_scatter_bytes

__all__ = ["TPComm", "copy_to", "gather_seq", "gather_seq_replicated", "reduce_from", "scatter_seq", "split_seq"]


class TPComm:
    """The tensor-parallel process group of one rank, and the meter that counts its bytes while ``counting``.

    ``calls`` counts the collectives issued while ``counting``, by kind (``all_reduce``, ``all_gather``,
    ``reduce_scatter``), as the meter counts their bytes.
    """

    def __init__(self, group: dist.ProcessGroup, meter: CommMeter | None = None) -> None:
        self.group, self.meter, self.counting = group, meter, False
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.gloo = dist.get_backend(group) == "gloo"
        self.calls: Counter[str] = Counter()

    def _count(self, kind: str, nbytes: int) -> None:
        if self.counting and self.meter is not None:
            self.meter.add(f"tp_{kind}", nbytes)
            self.calls[kind] += 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        self._count("all_reduce", all_reduce_bytes(t.numel() * t.element_size(), self.size))
        dist.all_reduce(t, group=self.group)
        return t

    def sum_flat_(self, tensors: list[torch.Tensor]) -> None:
        """Sum ``tensors`` over the group in place, in one all-reduce of their concatenation."""
        if not tensors or self.size == 1:
            return
        flat = self.all_reduce(torch.cat([t.reshape(-1) for t in tensors]))
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        t = t.contiguous()
        self._count("all_gather", all_gather_bytes(t.numel() * t.element_size(), self.size))
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t, group=self.group)
        return torch.cat(parts, dim)

    def reduce_scatter(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        if self.gloo:  # no reduce-scatter in gloo: the whole tensor is all-reduced
            self._count("reduce_scatter", all_reduce_bytes(nbytes, self.size))
            dist.all_reduce(t, group=self.group)
            return t.chunk(self.size, dim)[self.rank].contiguous()
        self._count("reduce_scatter", reduce_scatter_bytes(nbytes, self.size))
        out = torch.empty_like(t.chunk(self.size, dim)[0]).contiguous()
        if dim != 0:
            t = t.movedim(dim, 0).contiguous()
            out = out.movedim(dim, 0).contiguous()
        dist.reduce_scatter_tensor(out, t, group=self.group)
        return out.movedim(0, dim) if dim != 0 else out

    def chunk(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(self.size, dim)[self.rank].contiguous()


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: TPComm) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.comm.all_reduce(grad.clone()), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: TPComm) -> torch.Tensor:
        return comm.all_reduce(x.clone())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: TPComm, dim: int, reduce_grad: bool) -> torch.Tensor:
        ctx.comm, ctx.dim, ctx.reduce_grad = comm, dim, reduce_grad
        return comm.all_gather(x, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.reduce_grad:
            return ctx.comm.reduce_scatter(grad.clone(), ctx.dim), None, None, None
        return ctx.comm.chunk(grad, ctx.dim), None, None, None


class _ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: TPComm, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        return comm.reduce_scatter(x.clone(), dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.comm.all_gather(grad, ctx.dim), None, None


class _SplitSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: TPComm, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        return comm.chunk(x, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.comm.all_gather(grad, ctx.dim), None, None


def copy_to(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    """Megatron's ``f``: identity forward, all-reduce of the gradient backward."""
    return _CopyTo.apply(x, comm)


def reduce_from(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    """Megatron's ``g``: all-reduce (sum) forward, identity backward."""
    return _ReduceFrom.apply(x, comm)


def gather_seq(x: torch.Tensor, comm: TPComm, dim: int) -> torch.Tensor:
    """Sequence-parallel ``f``: all-gather along ``dim`` forward, reduce-scatter of the gradient backward."""
    return _GatherSeq.apply(x, comm, dim, True)


def gather_seq_replicated(x: torch.Tensor, comm: TPComm, dim: int) -> torch.Tensor:
    """Leave a sequence-parallel region: all-gather forward; backward this rank's chunk of the (same) gradient."""
    return _GatherSeq.apply(x, comm, dim, False)


def scatter_seq(x: torch.Tensor, comm: TPComm, dim: int) -> torch.Tensor:
    """Sequence-parallel ``g``: reduce-scatter along ``dim`` forward, all-gather of the gradient backward."""
    return _ScatterSeq.apply(x, comm, dim)


def split_seq(x: torch.Tensor, comm: TPComm, dim: int) -> torch.Tensor:
    """Enter a sequence-parallel region: this rank's chunk forward, all-gather of the gradient backward."""
    return _SplitSeq.apply(x, comm, dim)
