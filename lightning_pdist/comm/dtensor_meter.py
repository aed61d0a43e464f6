"""Count the bytes of every collective that DTensor issues (tensor parallelism) into a :class:`CommMeter`.

``torch.distributed.tensor`` turns a redistribution (partial sums to replicated, shards to replicated, ...) into
functional collectives (``_c10d_functional.all_reduce`` and friends) deep inside its dispatch, forward and
backward. :class:`DTensorCommMeter` is a ``TorchDispatchMode`` that sees each of them with the tensor actually
sent and adds the bytes this rank sends (:mod:`lightning_pdist.comm.accounting`'s ring model) to a meter. It is
the pattern of torch's own ``CommDebugMode``, without its module tracker (which fails on modules used twice,
such as ALBERT's shared block) and with byte counts.

gloo has no reduce-scatter: torch runs it as an all-reduce of the whole tensor, so on gloo a reduce-scatter is
counted as the all-reduce that crosses the wire (``model-parallel-notes.md``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_pdist.comm.accounting import CommMeter, all_gather_bytes, all_reduce_bytes, all_to_all_bytes
from lightning_pdist.comm.accounting import reduce_scatter_bytes

__all__ = ["DTensorCommMeter"]

_funcol = torch.ops._c10d_functional


def _group(name: Any) -> dist.ProcessGroup:
    return name if isinstance(name, dist.ProcessGroup) else dist.distributed_c10d._resolve_process_group(name)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class DTensorCommMeter(TorchDispatchMode):
    """While active, every functional collective adds this rank's sent bytes to ``meter`` under ``prefix + kind``.

    Kinds: ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all`` (``prefix`` defaults to ``"tp_"``).
    Collectives called directly through ``torch.distributed`` (not functional) are not seen: the strategies count
    those themselves where they call them.
    """

    def __init__(self, meter: CommMeter, prefix: str = "tp_"):
        super().__init__()
        self.meter, self.prefix = meter, prefix

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar the op into collectives first; we see those next
        packet = func._overloadpacket
        if packet in (_funcol.all_reduce, _funcol.all_reduce_):
            size = _group(args[2]).size()
            self.meter.add(self.prefix + "all_reduce", all_reduce_bytes(_nbytes(args[0]), size))
        elif packet == _funcol.all_gather_into_tensor:
            self.meter.add(self.prefix + "all_gather", all_gather_bytes(_nbytes(args[0]), args[1]))
        elif packet == _funcol.reduce_scatter_tensor:
            group = _group(args[3])
            nbytes = _nbytes(args[0])
            sent = all_reduce_bytes(nbytes, group.size()) if dist.get_backend(group) == "gloo" else (
                reduce_scatter_bytes(nbytes, group.size()))  # fmt: skip
            self.meter.add(self.prefix + "reduce_scatter", sent)
        elif packet == _funcol.all_to_all_single:
            self.meter.add(self.prefix + "all_to_all", all_to_all_bytes(_nbytes(args[0]), _group(args[3]).size()))
        elif packet in (_funcol.all_reduce_coalesced, _funcol.all_reduce_coalesced_):
            size = _group(args[2]).size()
            self.meter.add(self.prefix + "all_reduce", sum(all_reduce_bytes(_nbytes(t), size) for t in args[0]))
        elif packet == _funcol.all_gather_into_tensor_coalesced:
            self.meter.add(self.prefix + "all_gather", sum(all_gather_bytes(_nbytes(t), args[1]) for t in args[0]))
        return func(*args, **kwargs)
