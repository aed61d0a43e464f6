"""A job's own gloo group for Lightning's bookkeeping collectives, deliberately *not* torch's default group.

Lightning 2.6 runs ``torch.distributed.broadcast`` on the default group before every training batch
whenever ``torch.distributed.is_initialized()`` (``lightning-integration.md`` §0.3), which would hold
asynchronous processes in lockstep: parameter-server workers, Hogwild! processes. Those strategies therefore never
initialize the default group: the processes build a ``ProcessGroupGloo`` from a ``TCPStore`` and keep it to
themselves (or, where another strategy already initialized the default group in the same process, a gloo subgroup
of it), and the strategy routes ``barrier``/``broadcast``/``reduce``/``all_gather`` (checkpoint decisions,
``self.log(sync_dist=True)``, early stopping, metric syncing) through it
(:class:`~lightning_pdist.core.control_collectives.ControlGroupCollectives`). These only run where Lightning puts
them (setup, validation, checkpoints, the end), never per batch.

Never imports Lightning.
"""

from __future__ import annotations

import ipaddress
import os
import pickle
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["ControlGroup", "WorkerSilent"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}


class WorkerSilent(RuntimeError):
    """Members (named) did not report to :meth:`ControlGroup.exchange_flags` within its deadline."""


class ControlGroup:
    """``world_size`` processes (``noun``: "worker", "process") in one gloo group of their own; collectives on it
    are blocking. ``name`` keeps its store keys apart from other groups' (``pdist/<name>/``).

    Where the group comes from:

    * torch's default group already exists in this process (another strategy ran here before, in
      processes launched once for several Trainers): a new gloo group of the default group's ranks
      (``dist.new_group``, on the default group's store; no second store is bound on its port);
    * under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``): the agent's store at ``host:port``, keys under a
      prefix of this group's own;
    * otherwise: a ``TCPStore`` hosted by rank 0 at ``host:port`` (the job's ``MASTER_PORT``) and a
      ``ProcessGroupGloo`` over it. Every rank, rank 0 included, talks to the store through a client
      of its own, so rank 0 can stop the store while the group lives on. :meth:`close` stops it and
      only then lets any worker leave: a worker that went on to its next rendezvous on the same port
      (the next Trainer in this process, or torch's default group) could otherwise reach the old store
      and read the old group's keys.

    With ``world_size == 1`` there is no group; every collective returns its input.
    """

    _agent_groups = 0  # groups made on torchrun's agent store by this process (every worker makes them in step)
    _subgroups = 0  # groups made as subgroups of torch's default group by this process

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout: timedelta = timedelta(minutes=30),
                 name: str = "workers", noun: str = "worker"):  # fmt: skip
        self.rank, self.world_size, self.noun = rank, world_size, noun
        self.pg = None
        self._server: dist.TCPStore | None = None  # rank 0: the store's host
        self._client: dist.TCPStore | None = None  # None when the group lives on the default group's store
        if world_size == 1:
            return
        if dist.is_available() and dist.is_initialized():
            default = (dist.get_world_size(), dist.get_rank())
            if default != (world_size, rank):
                raise RuntimeError(
                    f"ControlGroup(rank={rank}, world_size={world_size}): torch's default group is already initialized "
                    f"in this process with world_size={default[0]}, rank={default[1]}; this group must have "
                    "the same ranks (run the same number of workers as the earlier strategy, or destroy that group)"
                )
            self.pg = dist.new_group(backend="gloo", timeout=timeout)
            ControlGroup._subgroups += 1
            default_store = dist.distributed_c10d._get_default_store()
            self._flags = dist.PrefixStore(f"pdist/flags/{ControlGroup._subgroups}/", default_store)
            self._introduce()
            return
        prefix = f"pdist/{name}/"
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun's agent already serves a store at MASTER_ADDR:MASTER_PORT: use it (binding a second store on
            # that port fails loudly). Keys get a prefix per group, so a later group never reads this one's keys.
            ControlGroup._agent_groups += 1
            run, restart = os.environ.get("TORCHELASTIC_RUN_ID", "run"), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            prefix += f"{run}/{restart}/{ControlGroup._agent_groups}/"
        elif rank == 0:
            self._server = dist.TCPStore(host, port, None, True, timeout=timeout, wait_for_workers=False,
                                         master_listen_fd=_ipv4_listener(host, port))  # fmt: skip
        else:
            _await_listener(host, port, timeout)
        self._client = dist.TCPStore(host, port, None, False, timeout=timeout, wait_for_workers=False)
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, self._client), rank, world_size, timeout)
        self._flags = dist.PrefixStore(prefix + "flags/", self._client)
        self._introduce()

    def _introduce(self) -> None:
        self._flags.set(f"who/{self.rank}", f"pid {os.getpid()} on host {socket.gethostname()}")
        self._last_flag: str | None = None

    # ------------------------------------------------------------------ named agreement
    def exchange_flags(self, tag: str, value: int, timeout: timedelta, what: str = "its flag") -> list[int]:
        """Every worker's small int ``value`` for ``tag`` (unique per call), through the group's store.

        A gloo collective that a stopped worker never joins fails after the group's timeout (30 minutes by default)
        without saying who is missing. Here every worker sets its key and waits at most ``timeout`` for the others';
        :class:`WorkerSilent` then names the workers whose key is missing (rank, pid, host). A few bytes per worker.
        """
        if self.pg is None or self.world_size == 1:
            return [int(value)]
        keys = [f"{tag}/{r}" for r in range(self.world_size)]
        self._flags.set(keys[self.rank], str(int(value)))
        try:
            self._flags.wait(keys, timeout)
        except (RuntimeError, dist.DistError):  # the store's timeout
            missing = [r for r in range(self.world_size) if not self._flags.check([keys[r]])]
            who = ", ".join(f"{self.noun} {r} ({self._who(r)})" for r in missing)
            raise WorkerSilent(f"{self.noun} {self.rank}: {who} did not report {what} within {timeout.total_seconds():g} s: "
                               f"stopped, hung or dead; every other {self.noun} is waiting for it") from None  # fmt: skip
        values = [int(v) for v in self._flags.multi_get(keys)]
        if self._last_flag is not None:  # every worker has read it: each set this tag's key after reading that one
            self._flags.delete_key(self._last_flag)
        self._last_flag = keys[self.rank]
        return values

    def _who(self, rank: int) -> str:
        try:
            return self._flags.get(f"who/{rank}").decode()
        except (RuntimeError, dist.DistError):
            return "pid and host unknown"

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

    def all_gather_object(self, obj: object) -> list[object]:
        """``obj`` of every worker, in rank order (pickled: only ever between the job's own workers)."""
        if self.pg is None:
            return [obj]
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        return [pickle.loads(t.numpy().tobytes()) for t in self.all_gather_varying(data)]

    def close(self, timeout: timedelta = timedelta(seconds=30)) -> None:
        """Leave the group. Rank 0 stops its store first; the others return once it has (a barrier).

        The barrier waits at most ``timeout`` (a worker that crashed elsewhere must not hang the others'
        teardown); a failed barrier is ignored, the group is dropped either way.
        """
        pg, self.pg = self.pg, None
        if pg is None:
            return
        if self._client is None:  # a subgroup of torch's default group
            dist.destroy_process_group(pg)
            return
        self._server = None  # rank 0: the last reference; the store stops here, its port is free
        try:
            options = dist.BarrierOptions()
            options.timeout = timeout
            pg.barrier(options).wait()
        except RuntimeError:
            pass
        self._client = None


def _ipv4_listener(host: str, port: int) -> int | None:
    """A listening IPv4 socket on every interface at ``port`` for the store to take over, where ``host`` is an IPv4
    address (``None`` otherwise: torch then listens on IPv6 and IPv4).

    torch's own listener is an IPv6 socket, so every connection it accepts from an IPv4 client has an IPv4-mapped
    address (``::ffff:a.b.c.d``), which it names with ``getnameinfo``: a reverse DNS query that ``/etc/hosts`` never
    answers for a mapped address, one per connection accepted (three or more per group). A slow or rate-limited
    resolver turns them into seconds (this project's build machine answers about 25 in a burst, then waits out a 5 s
    timeout). An IPv4 listener's peers are plain IPv4 addresses, named from ``/etc/hosts`` where listed.
    """
    try:
        if ipaddress.ip_address(host).version != 4:
            return None
    except ValueError:  # a host name
        return None
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's listener: a restart reuses the port
        listener.bind(("0.0.0.0", port))
    except OSError:
        listener.close()
        raise
    return listener.detach()  # the store owns the descriptor from here (and closes it when it stops)


def _await_listener(host: str, port: int, timeout: timedelta) -> None:
    """Return once ``host:port`` accepts a connection (rank 0's store is up), trying every 10 ms, or at ``timeout``.

    torch's store client retries a refused connection after a back-off of 0.2-0.7 s, which a worker arriving before
    rank 0 pays on every group (one per Trainer). At the timeout this returns anyway: the store client then fails
    with torch's own message.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        try:
            socket.create_connection((host.strip("[]"), port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() >= deadline:
                return
            time.sleep(0.01)


def _opts(op: str) -> dist.AllreduceOptions:
    if op not in _OPS:
        raise ValueError(f"ControlGroup.all_reduce_(op={op!r}): op must be one of {', '.join(_OPS)}")
    options = dist.AllreduceOptions()
    options.reduceOp = _OPS[op]
    return options
