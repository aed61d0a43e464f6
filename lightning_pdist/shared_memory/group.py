"""The Hogwild! processes' own gloo group, for Lightning's bookkeeping only (never per step).

Lightning 2.6 broadcasts on torch's default group before every training batch whenever it is initialized
(``lightning-integration.md`` §0.3): Hogwild! processes would move in lockstep, one collective per step. So the
default group is never initialized here; the processes build a ``ProcessGroupGloo`` over a ``TCPStore`` hosted by
rank 0 on the job's ``MASTER_PORT`` (under torchrun: the agent's store; where torch's default group already exists in
the process: a gloo subgroup of it) and Lightning's ``barrier``/``broadcast``/``reduce`` go through it: at setup,
validation, checkpoints and the end of fit. The same pattern as the parameter server's workers' group (a family
never imports another, so this is its own copy, reduced to what Hogwild! needs).

Never imports Lightning.
"""

from __future__ import annotations

import os
import pickle
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["ControlGroup"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class ControlGroup:
    """``world_size`` processes in one gloo group of their own; every call is blocking. One process: no group."""

    _agent_groups = 0

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout: timedelta = timedelta(minutes=30)):
        self.rank, self.world_size = rank, world_size
        self.pg = None
        self._server: dist.TCPStore | None = None
        self._client: dist.TCPStore | None = None
        if world_size == 1:
            return
        if dist.is_available() and dist.is_initialized():
            if (dist.get_world_size(), dist.get_rank()) != (world_size, rank):
                raise RuntimeError(f"ControlGroup(rank={rank}, world_size={world_size}): torch's default group exists "
                                   f"here with world_size={dist.get_world_size()}, rank={dist.get_rank()}; destroy it "
                                   "or run the same number of processes")  # fmt: skip
            self.pg = dist.new_group(backend="gloo", timeout=timeout)
            return
        prefix = "pdist/hogwild/"
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's agent serves MASTER_PORT
            ControlGroup._agent_groups += 1
            prefix += f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{ControlGroup._agent_groups}/"
        elif rank == 0:
            self._server = dist.TCPStore(host, port, None, True, timeout=timeout, wait_for_workers=False)
        else:
            _await_listener(host, port, timeout)
        self._client = dist.TCPStore(host, port, None, False, timeout=timeout, wait_for_workers=False)
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, self._client), rank, world_size, timeout)

    def barrier(self) -> None:
        if self.pg is not None:
            self.pg.barrier().wait()

    def all_reduce_(self, tensor: Tensor, op: str = "sum") -> Tensor:
        """In place; ``op`` in ``sum``, ``max``, ``min``."""
        if self.pg is not None:
            options = dist.AllreduceOptions()
            options.reduceOp = _OPS[op]
            self.pg.allreduce([tensor], options).wait()
        return tensor

    def all_gather(self, tensor: Tensor) -> list[Tensor]:
        if self.pg is None:
            return [tensor]
        tensor = tensor.contiguous()
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self.pg.allgather([out], [tensor]).wait()
        return out

    def all_gather_varying(self, tensor: Tensor) -> list[Tensor]:
        """Tensors of equal ``ndim`` but possibly different shapes (pads, gathers, trims): torchmetrics' sync."""
        if self.pg is None:
            return [tensor]
        shapes = self.all_gather(torch.tensor(tensor.shape, dtype=torch.int64))
        if tensor.ndim == 0 or all(torch.equal(s, shapes[0]) for s in shapes):
            return self.all_gather(tensor)
        biggest = torch.stack(shapes).max(0).values
        padded = torch.zeros(tuple(biggest.tolist()), dtype=tensor.dtype, device=tensor.device)
        padded[tuple(slice(0, n) for n in tensor.shape)] = tensor
        return [g[tuple(slice(0, int(n)) for n in s)] for g, s in zip(self.all_gather(padded), shapes)]

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        """``obj`` from ``src`` on every process (pickled: only ever between the job's own processes)."""
        if self.pg is None:
            return obj
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if self.rank == src else None
        size = torch.tensor([data.numel() if data is not None else 0], dtype=torch.int64)
        self.pg.broadcast(size, src).wait()
        if data is None:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        self.pg.broadcast(data, src).wait()
        return obj if self.rank == src else pickle.loads(data.numpy().tobytes())

    def close(self, timeout: timedelta = timedelta(seconds=30)) -> None:
        """Leave the group: rank 0 stops its store, then a barrier (at most ``timeout``) lets every process go."""
        pg, self.pg = self.pg, None
        if pg is None:
            return
        if self._client is None:  # a subgroup of torch's default group
            dist.destroy_process_group(pg)
            return
        self._server = None  # rank 0: the last reference; the store stops, its port is free for the next group
        try:
            options = dist.BarrierOptions()
            options.timeout = timeout
            pg.barrier(options).wait()
        except RuntimeError:
            pass
        self._client = None


def _await_listener(host: str, port: int, timeout: timedelta) -> None:
    """Return once ``host:port`` accepts a connection (rank 0's store is up), trying every 10 ms, or at ``timeout``."""
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        try:
            socket.create_connection((host.strip("[]"), port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() >= deadline:
                return
            time.sleep(0.01)
