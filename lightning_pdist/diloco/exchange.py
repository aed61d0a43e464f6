"""The outer exchange of one fragment: the mean over the replicas of the pseudo-gradient and the float buffers.

Each replica contributes ``Δ_r = θ_global − θ_r`` (fp32) and its float buffers; everyone receives
``mean_r Δ_r = θ_global − mean_r θ_r`` and ``mean_r b_r``. The collective is started asynchronously (gloo work
handles) and waited for when the merge is due, so with ``overlap_steps = τ`` it runs during the next ``τ`` inner
steps. Bytes this rank sends (:mod:`lightning_pdist.core.accounting`), for ``n`` values on ``N`` ranks:

* full precision: one all-reduce of ``Δ`` and the buffers, ``2(N−1)/N · 4n`` (kind ``pseudo_grad_all_reduce``);
* ``int8``/``int4`` (:mod:`.quantize`): an all-gather of the codes and one fp32 scale per block,
  ``(N−1) · (codes + scales)`` (kind ``pseudo_grad_all_gather``), every rank dequantizes all ``N`` contributions
  (its own too, so every rank computes the same mean); the buffers still go by a full-precision all-reduce.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_pdist.core.accounting import CommMeter, all_gather_bytes, all_reduce_bytes
from lightning_pdist.core.collectives import group_size
from lightning_pdist.diloco.quantize import dequantize, quantize

__all__ = ["Exchange", "start_exchange"]


class Exchange:
    """One fragment's exchange in flight; :meth:`wait` returns ``(mean Δ, mean buffers)`` (once finished, again)."""

    def __init__(self, works: list, finish: Callable[[], tuple[Tensor, Tensor]]) -> None:
        self._works, self._finish = works, finish
        self._result: tuple[Tensor, Tensor] | None = None

    @classmethod
    def done(cls, mean_delta: Tensor, mean_buffers: Tensor) -> "Exchange":
        """An exchange whose result is known (one replica, or one restored from a checkpoint)."""
        out = cls([], lambda: (mean_delta, mean_buffers))
        out.wait()
        return out

    def wait(self) -> tuple[Tensor, Tensor]:
        if self._result is None:
            for work in self._works:
                work.wait()
            self._result = self._finish()
            self._works = []
        return self._result


def start_exchange(delta: Tensor, buffers: Tensor, quantize_to: str | None, meter: CommMeter | None,
                   group: dist.ProcessGroup | None = None) -> Exchange:  # fmt: skip
    """Start averaging ``delta`` and ``buffers`` (flat fp32) over ``group``; nothing blocks until ``wait``."""
    world = group_size(group)
    if world == 1:
        if quantize_to is not None:  # one replica still sees its own rounding
            codes, scales = quantize(delta, quantize_to)
            delta = dequantize(codes, scales, quantize_to, delta.numel())
        return Exchange.done(delta.clone(), buffers.clone())
    n = delta.numel()
    if quantize_to is None:
        vec = torch.cat([delta, buffers]).div_(world)  # divide first, as all_reduce_mean_ does
        works = [dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=group, async_op=True)]
        _count(meter, "pseudo_grad_all_reduce", all_reduce_bytes(vec.numel() * 4, world))
        return Exchange(works, lambda: (vec[:n], vec[n:]))
    codes, scales = quantize(delta, quantize_to)
    all_codes = [torch.empty_like(codes) for _ in range(world)]
    all_scales = [torch.empty_like(scales) for _ in range(world)]
    works = [dist.all_gather(all_codes, codes, group=group, async_op=True),
             dist.all_gather(all_scales, scales, group=group, async_op=True)]  # fmt: skip
    _count(meter, "pseudo_grad_all_gather", all_gather_bytes(codes.numel() + 4 * scales.numel(), world))
    bufs = buffers.div(world)
    if bufs.numel():
        works.append(dist.all_reduce(bufs, op=dist.ReduceOp.SUM, group=group, async_op=True))
        _count(meter, "buffer_all_reduce", all_reduce_bytes(bufs.numel() * 4, world))

    def finish() -> tuple[Tensor, Tensor]:
        parts = [dequantize(c, s, quantize_to, n) for c, s in zip(all_codes, all_scales)]
        return torch.stack(parts).mean(0), bufs

    return Exchange(works, finish)


def _count(meter: CommMeter | None, kind: str, nbytes: int) -> None:
    if meter is not None:
        meter.add(kind, nbytes)
