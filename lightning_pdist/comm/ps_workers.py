"""The workers' own gloo group for Lightning's bookkeeping collectives, deliberately *not* the default group.

Lightning 2.6 runs ``torch.distributed.broadcast`` on the default group before every training batch
whenever ``torch.distributed.is_initialized()`` (``lightning-integration.md`` §0.3), which would hold
asynchronous parameter-server workers in lockstep. A parameter-server run therefore never initializes
the default group: the workers build a ``ProcessGroupGloo`` from a ``TCPStore`` and keep it to
themselves, and the strategy routes ``barrier``/``broadcast``/``reduce``/``all_gather`` (checkpoint
decisions, ``self.log(sync_dist=True)``, early stopping, metric syncing) through it. These only run where
Lightning puts them (setup, validation, checkpoints, the end), never per batch.

Never imports Lightning.
"""

from __future__ import annotations

import pickle
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["WorkerGroup"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}


class WorkerGroup:
    """``world_size`` workers joined through a ``TCPStore`` at ``host:port`` (rank 0 hosts it).

    With ``world_size == 1`` there is no store and no group; every collective returns its input.
    """

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout: timedelta = timedelta(minutes=30)):
        self.rank, self.world_size = rank, world_size
        self.store: dist.TCPStore | None = None
        self.pg = None
        if world_size > 1:
            self.store = dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout)
            self.pg = dist.ProcessGroupGloo(dist.PrefixStore("pdist/workers/", self.store), rank, world_size, timeout)

    # ------------------------------------------------------------------ key-value
    def publish(self, key: str, value: str) -> None:
        if self.store is not None:
            self.store.set(key, value)

    def lookup(self, key: str) -> str:
        assert self.store is not None
        return self.store.get(key).decode()

    # ------------------------------------------------------------------ collectives
    def barrier(self) -> None:
        if self.pg is not None:
            self.pg.barrier().wait()

    def all_reduce_(self, tensor: Tensor, op: str = "sum") -> Tensor:
        """In place; ``op`` in ``sum``, ``max``, ``min``, ``product``."""
        if self.pg is not None:
            self.pg.allreduce([tensor], _opts(op)).wait()
        return tensor

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        """Same-shape tensors from every worker, in rank order."""
        if self.pg is None:
            return [tensor]
        tensor = tensor.contiguous()
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self.pg.allgather([out], [tensor]).wait()
        return out

    def all_gather_varying(self, tensor: Tensor) -> list[Tensor]:
        """Tensors of equal ``ndim`` but possibly different shapes (pads, gathers, trims)."""
        if self.pg is None:
            return [tensor]
        shape = torch.tensor(tensor.shape, dtype=torch.int64)
        shapes = self.all_gather(shape)
        if tensor.ndim == 0 or all(torch.equal(s, shapes[0]) for s in shapes):
            return self.all_gather(tensor)
        biggest = torch.stack(shapes).max(0).values
        padded = torch.zeros(tuple(biggest.tolist()), dtype=tensor.dtype, device=tensor.device)
        padded[tuple(slice(0, n) for n in tensor.shape)] = tensor
        return [g[tuple(slice(0, int(n)) for n in s)] for g, s in zip(self.all_gather(padded), shapes)]

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        """``obj`` from ``src`` on every worker (pickled: only ever between the job's own workers)."""
        if self.pg is None:
            return obj
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if self.rank == src else None
        size = torch.tensor([data.numel() if data is not None else 0], dtype=torch.int64)
        self.pg.broadcast(size, src).wait()
        if data is None:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        self.pg.broadcast(data, src).wait()
        return obj if self.rank == src else pickle.loads(data.numpy().tobytes())

    def close(self) -> None:
        self.pg = None
        self.store = None


def _opts(op: str) -> dist.AllreduceOptions:
    if op not in _OPS:
        raise ValueError(f"WorkerGroup.all_reduce_(op={op!r}): op must be one of {', '.join(_OPS)}")
    options = dist.AllreduceOptions()
    options.reduceOp = _OPS[op]
    return options
