"""How decentralized models move: point-to-point gloo messages on a process group of their own, no Lightning.

* :class:`NeighbourExchange` (D-PSGD): every rank posts non-blocking sends of its model to the ranks that mix it and
  non-blocking receives from the ranks it mixes; the caller starts it before the forward pass and waits after the
  backward pass, so the transfer overlaps the step's computation. Bytes: the model once per out-neighbour.
* :func:`average_with` and :class:`PassiveServer` (AD-PSGD): an active rank sends ``[EXCHANGE, index]`` and its
  vector to one passive rank and blocks for the reply ``(x_i + x_j)/2``; the passive rank answers from a thread of its
  own, holding the caller's lock while it reads and writes its model, so the pair's averaging is atomic with respect
  to the passive rank's optimizer steps. No collective and no barrier: a slow rank delays only the active rank
  waiting on it. Active ranks end with ``[STOP, 0]`` to each passive neighbour; the server thread ends once every one
  of them said so.

The group is the whole world in rank order, so global ranks are group ranks. On gloo the wire tensors live on CPU.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_pdist.core.accounting import CommMeter

__all__ = ["NeighbourExchange", "PassiveServer", "average_with", "send_stop"]

TAG_HEADER, TAG_MODEL, TAG_REPLY = 71, 72, 73
EXCHANGE, STOP = 0, 1
HEADER_BYTES = 16  # two int64


def _wire(vector: Tensor, group: dist.ProcessGroup) -> Tensor:
    return vector.detach().cpu() if dist.get_backend(group) == "gloo" else vector.detach()


class PendingExchange:
    """Sends and receives in flight; :meth:`wait` returns ``{source rank: its vector}`` (on the vector's device)."""

    def __init__(self, requests: list, received: dict[int, Tensor], keep: Tensor, device: torch.device) -> None:
        self._requests, self._received, self._keep, self._device = requests, received, keep, device

    def wait(self) -> dict[int, Tensor]:
        for request in self._requests:
            request.wait()
        self._requests = []
        return {j: t.to(self._device) for j, t in self._received.items()}


class NeighbourExchange:
    """D-PSGD's exchange: send this rank's model to ``send_to``, receive those of ``recv_from``."""

    def __init__(self, group: dist.ProcessGroup, send_to: list[int], recv_from: list[int], meter: CommMeter | None) -> None:
        self.group, self.send_to, self.recv_from, self.meter = group, list(send_to), list(recv_from), meter

    def start(self, vector: Tensor, kind: str = "gossip_model") -> PendingExchange:
        """Post the sends and receives of ``vector`` (counted now: ``numel·4`` bytes per out-neighbour)."""
        wire = _wire(vector, self.group)
        received = {j: torch.empty_like(wire) for j in self.recv_from}
        requests = [dist.irecv(received[j], src=j, group=self.group) for j in self.recv_from]
        requests += [dist.isend(wire, dst=k, group=self.group) for k in self.send_to]
        if self.meter is not None and self.send_to:
            self.meter.add(kind, wire.numel() * wire.element_size() * len(self.send_to))
        return PendingExchange(requests, received, wire, vector.device)


def average_with(partner: int, vector: Tensor, index: int, group: dist.ProcessGroup, meter: CommMeter | None) -> Tensor:
    """Active side of AD-PSGD's atomic pairwise average: returns ``(x_self + x_partner)/2`` (blocking)."""
    wire = _wire(vector, group)
    dist.send(torch.tensor([EXCHANGE, index], dtype=torch.int64), dst=partner, group=group, tag=TAG_HEADER)
    dist.send(wire, dst=partner, group=group, tag=TAG_MODEL)
    reply = torch.empty_like(wire)
    dist.recv(reply, src=partner, group=group, tag=TAG_REPLY)
    if meter is not None:
        meter.add("gossip_pair", HEADER_BYTES + wire.numel() * wire.element_size())
    return reply.to(vector.device)


def send_stop(partners: list[int], group: dist.ProcessGroup, meter: CommMeter | None) -> None:
    """Tell every passive partner this active rank will send nothing more."""
    for partner in partners:
        dist.send(torch.tensor([STOP, 0], dtype=torch.int64), dst=partner, group=group, tag=TAG_HEADER)
    if meter is not None and partners:
        meter.add("gossip_stop", HEADER_BYTES * len(partners))


class PassiveServer(threading.Thread):
    """Passive side of AD-PSGD: answers every active neighbour's request until each has sent STOP.

    ``tensors_for(index)`` gives the tensors a request averages (this rank's parameters of optimizer ``index`` and
    its float buffers); they are read and written under ``lock``, through ``.data`` so that a backward pass in
    flight on the main thread is not invalidated (it then sees a model mid-update: AD-PSGD's inconsistent read).
    """

    def __init__(self, group: dist.ProcessGroup, actives: list[int], tensors_for: Callable[[int], list[Tensor]],
                 lock: threading.RLock) -> None:  # fmt: skip
        super().__init__(name="pdist-adpsgd-passive", daemon=True)
        self.group, self.actives, self.tensors_for, self.lock = group, list(actives), tensors_for, lock
        self.error: BaseException | None = None
        self.served = 0
        self.stopped: set[int] = set()
        self._sent = 0
        self._sent_lock = threading.Lock()

    def take_sent(self) -> int:
        """Bytes sent since the last call (the replies)."""
        with self._sent_lock:
            sent, self._sent = self._sent, 0
        return sent

    def run(self) -> None:
        try:
            while len(self.stopped) < len(self.actives):
                header = torch.zeros(2, dtype=torch.int64)
                src = dist.recv(header, src=None, group=self.group, tag=TAG_HEADER)
                kind, index = (int(v) for v in header)
                if kind == STOP:
                    self.stopped.add(src)
                    continue
                self._serve(src, index)
        except BaseException as err:  # noqa: BLE001  (re-raised on the main thread by the strategy)
            self.error = err

    def _serve(self, src: int, index: int) -> None:
        tensors = self.tensors_for(index)
        device = "cpu" if dist.get_backend(self.group) == "gloo" or not tensors else tensors[0].device
        theirs = torch.empty(sum(t.numel() for t in tensors), dtype=torch.float32, device=device)
        dist.recv(theirs, src=src, group=self.group, tag=TAG_MODEL)
        with self.lock:  # read, average and write back atomically with respect to this rank's optimizer step
            mine = torch.cat([t.data.reshape(-1).to(torch.float32) for t in tensors]) if tensors else torch.zeros(0)
            average = mine.add_(theirs.to(mine.device)).mul_(0.5)
            offset = 0
            for t in tensors:
                t.data.copy_(average[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
        wire = _wire(average, self.group)
        dist.send(wire, dst=src, group=self.group, tag=TAG_REPLY)
        self.served += 1
        with self._sent_lock:
            self._sent += wire.numel() * wire.element_size()
