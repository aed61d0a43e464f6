"""Point-to-point transport between pipeline stages: one framed tensor per activation or gradient.

Every message is two ``torch.distributed`` sends on the pipeline's process group: a fixed header
``int64[16]`` and the payload. The header carries what the receiver must check *before* it allocates:

====== =========================================================
index  field
====== =========================================================
0      magic (``0x5044``, "PD")
1      stream: 0 activations (forward), 1 gradients (backward), 2 evaluation
2      micro-batch id (checked against the schedule's expectation)
3      weight version id (vertical sync: the input stage's version)
4      dtype code (:data:`DTYPES`)
5      ndim (at most 8)
6..13  shape
====== =========================================================

Streams use distinct tags, so activations and gradients between the same two stages never pair
up wrongly; within a stream gloo and NCCL deliver in order. Sends are asynchronous (``isend``): a
stage keeps computing while its output travels, and a send's buffer stays referenced until the
peer has taken it (:meth:`P2P.reap`). Bytes sent (header and payload) go to the meter as
``pipeline_p2p``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_pdist.comm.accounting import CommMeter

__all__ = ["BACKWARD", "DTYPES", "EVAL", "FORWARD", "HEADER_LEN", "Message", "P2P"]

MAGIC = 0x5044
HEADER_LEN = 16
MAX_NDIM = 8
FORWARD, BACKWARD, EVAL = 0, 1, 2
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool)
_CODE = {dtype: i for i, dtype in enumerate(DTYPES)}


@dataclass
class Message:
    """A received tensor with the ids from its header."""

    tensor: Tensor
    microbatch: int
    version: int


@dataclass
class P2P:
    """Framed sends and receives between this rank and its pipeline neighbours.

    Args:
        group: process group holding the pipeline's stages (all ranks are global ranks).
        max_message_bytes: receives refuse a header announcing more payload than this, before
            allocating anything (a corrupt or hostile peer cannot make a stage allocate at will).
        meter: counts bytes this rank sends.
    """

    group: dist.ProcessGroup | None
    max_message_bytes: int = 1 << 31
    meter: CommMeter | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    wait_s: float = 0.0  # seconds spent blocked in recv (the stage's idle time, bubbles included)
    _pending: list[tuple[dist.Work, Tensor]] = field(default_factory=list)  # buffers stay alive until taken

    def send(self, tensor: Tensor, dst: int, stream: int, microbatch: int, version: int = 0, count: bool = True) -> None:
        """Post ``tensor`` to global rank ``dst`` without waiting for the peer to take it.

        ``count=False`` keeps the bytes off the meter (evaluation traffic is not training traffic).
        """
        if tensor.dtype not in _CODE:
            raise TypeError(f"pipeline p2p: cannot send dtype {tensor.dtype}; supported: {', '.join(map(str, DTYPES))}")
        if tensor.ndim > MAX_NDIM:
            raise ValueError(f"pipeline p2p: tensor of {tensor.ndim} dims; at most {MAX_NDIM}")
        payload = tensor.detach().contiguous()
        header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=self.device)
        header[:6] = torch.tensor([MAGIC, stream, microbatch, version, _CODE[payload.dtype], payload.ndim])
        header[6 : 6 + payload.ndim] = torch.tensor(payload.shape, dtype=torch.int64)
        tag = stream
        head_work = dist.isend(header, dst=dst, group=self.group, tag=tag)
        body_work = dist.isend(payload, dst=dst, group=self.group, tag=tag)
        self._pending += [(head_work, header), (body_work, payload)]
        if self.meter is not None and count:
            self.meter.add("pipeline_p2p", header.numel() * 8 + payload.numel() * payload.element_size())
        self.reap()

    def recv(self, src: int, stream: int, microbatch: int) -> Message:
        """Receive the next message of ``stream`` from global rank ``src``; it must be ``microbatch``."""
        start = time.perf_counter()
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        dist.recv(header, src=src, group=self.group, tag=stream)
        magic, got_stream, got_mb, version, code, ndim = (int(v) for v in header[:6])
        where = f"pipeline p2p from rank {src}"
        if magic != MAGIC or got_stream != stream:
            raise RuntimeError(f"{where}: bad header (magic {magic:#x}, stream {got_stream}); expected {MAGIC:#x}, {stream}")
        if not 0 <= code < len(DTYPES) or not 0 <= ndim <= MAX_NDIM:
            raise RuntimeError(f"{where}: bad header (dtype code {code}, ndim {ndim})")
        shape = [int(v) for v in header[6 : 6 + ndim]]
        dtype = DTYPES[code]
        if any(d < 0 for d in shape):
            raise RuntimeError(f"{where}: negative shape {shape}")
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        if nbytes > self.max_message_bytes:
            raise RuntimeError(f"{where}: message of {nbytes} bytes exceeds max_message_bytes={self.max_message_bytes}")
        if got_mb != microbatch:
            raise RuntimeError(f"{where}: got micro-batch {got_mb} on stream {stream}, the schedule expects {microbatch}")
        tensor = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(tensor, src=src, group=self.group, tag=stream)
        self.wait_s += time.perf_counter() - start
        return Message(tensor, got_mb, version)

    def reap(self) -> None:
        """Drop the buffers of sends the peers have taken."""
        self._pending = [p for p in self._pending if not p[0].is_completed()]

    def wait_all(self) -> None:
        """Block until every posted send has been taken (before teardown or a checkpoint)."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    @property
    def pending(self) -> int:
        return len(self._pending)
