"""Point-to-point transport between pipeline stages: one framed message per activation or gradient.

A *frame* is one ``torch.distributed`` send of bytes: a fixed 128-byte header (``int64[16]``) followed
by the payload. The header carries what the receiver checks before it trusts or allocates anything:

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
14     kind: 0 data, 1 announce (the next frame on this stream has this shape)
====== =========================================================

A receive must know its size before it is posted, so both ends remember the shape of the last frame
on each ``(peer, stream)``. While shapes repeat (every micro-batch of a batch, every step), a transfer
is **one** frame of ``128 + payload`` bytes. When the shape changes (the first message, an epoch's
short last batch), the sender first sends an *announce* frame of the old size whose header carries the
new shape; the receiver checks the announced size against ``max_message_bytes`` before allocating the
larger frame. (A separate header message per transfer cost a second rendezvous on the critical path:
measured 1.7x slower steps on loopback with two processes on two cores.)

**Receives posted ahead.** Over gloo (TCP) a send's bytes leave only after the receiver has posted its
receive (the receiver announces it is ready, then the sender's background thread writes the data): a
receive posted at the moment the data is needed costs a round trip between the two processes' gloo
threads, and the whole transfer, on the critical path. :meth:`P2P.post` posts the next frame's receive
(``irecv`` of the size the last frame on that stream had, which is also the size of an announce) as
soon as the caller knows that frame will come, so it travels while the stage computes; :meth:`P2P.recv`
then only waits for it. The executor posts a stream's next micro-batch when it takes the current one
and when a batch is admitted, never past the micro-batches admitted (no receive is left posted at a
drain). Off by default (``post_ahead=False``): measured on this 2-core machine (8 x Linear(512), batch 64, m = 4,
gloo, loopback, quiet; off and on alternating in one launch, two runs of 5 and 7 rounds: the ``ours (late)`` /
``ours (ahead)`` rows of docs/results/pipeline_post_ahead_run1.json and pipeline_post_ahead.json) it lengthened the
2-process step in 11 of the 12 rounds (more CPU per step: the posted receive's bytes land while the stage computes, on
a core the stage needs) and the 4-process step in 9 of 12. An earlier A/B under other load had found the 4-process
step shorter (a neighbour's gloo thread no longer needs a core at the moment of the receive); on a quiet machine no
rule on ranks per core holds up. ``PipelineStrategy(post_ahead=True)`` turns it on.

Streams use distinct tags, so activations and gradients between the same two stages never pair up
wrongly; within a stream gloo and NCCL deliver in order. Sends are asynchronous (``isend``): a stage
keeps computing while its output travels, and a send's buffer stays referenced until the caller
knows the peer has taken it and calls :meth:`P2P.release` (gloo's send handles report completion only
once waited on, so polling cannot tell; waiting on a send the peer has not reached yet could deadlock
across Lightning's per-step barrier). Bytes sent (frames, headers included) go to the meter as
``pipeline_p2p``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_pdist.core.accounting import CommMeter

__all__ = ["BACKWARD", "DTYPES", "EVAL", "FORWARD", "HEADER_BYTES", "HEADER_LEN", "Message", "P2P"]

MAGIC = 0x5044
HEADER_LEN = 16
HEADER_BYTES = HEADER_LEN * 8
MAX_NDIM = 8
DATA, ANNOUNCE = 0, 1
FORWARD, BACKWARD, EVAL = 0, 1, 2
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool)
_CODE = {dtype: i for i, dtype in enumerate(DTYPES)}
_ITEMSIZE = [torch.empty(0, dtype=d).element_size() for d in DTYPES]

Meta = tuple[int, tuple[int, ...]]  # (dtype code, shape)


@dataclass
class Message:
    """A received tensor with the ids from its header."""

    tensor: Tensor
    microbatch: int
    version: int


def _nbytes(meta: Meta | None) -> int:
    return 0 if meta is None else math.prod(meta[1]) * _ITEMSIZE[meta[0]]


@dataclass
class P2P:
    """Framed sends and receives between this rank and its pipeline neighbours.

    Args:
        group: process group holding the pipeline's stages (all ranks are global ranks).
        max_message_bytes: a header announcing more payload than this is refused before anything is
            allocated (a corrupt or hostile peer cannot make a stage allocate at will).
        meter: counts bytes this rank sends.
        device: where frames live (the GPU for NCCL).
    """

    group: dist.ProcessGroup | None
    max_message_bytes: int = 1 << 31
    meter: CommMeter | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    wait_s: float = 0.0  # seconds spent blocked in recv (the stage's idle time, bubbles included)
    post_ahead: bool = False  # the executor posts receives ahead (P2P.post); off: measured slower (above)
    # (peer, stream, micro-batch) -> the send's handles, whose buffers stay alive until released
    _pending: dict[tuple[int, int, int], list[tuple[dist.Work, Tensor]]] = field(default_factory=dict)
    _sent: dict[tuple[int, int], Meta] = field(default_factory=dict)  # shape of the last frame per (peer, stream)
    _received: dict[tuple[int, int], Meta] = field(default_factory=dict)
    # (peer, stream) -> (micro-batch, the posted receive, its frame): the next frame's receive, posted ahead
    _posted: dict[tuple[int, int], tuple[int, dist.Work, Tensor]] = field(default_factory=dict)

    def _frame(self, kind: int, stream: int, microbatch: int, version: int, meta: Meta, payload: Tensor | None, size: int) -> Tensor:
        code, shape = meta
        fields = [MAGIC, stream, microbatch, version, code, len(shape), *shape]
        header = torch.tensor(fields + [0] * (HEADER_LEN - len(fields)), dtype=torch.int64)
        header[14] = kind
        if payload is None:  # an announce: the header, then zeros up to the size the receiver expects
            frame = torch.zeros(HEADER_BYTES + size, dtype=torch.uint8, device=self.device)
        else:
            frame = torch.empty(HEADER_BYTES + size, dtype=torch.uint8, device=self.device)
            frame[HEADER_BYTES:] = payload.reshape(-1).view(torch.uint8)
        frame[:HEADER_BYTES] = header.view(torch.uint8).to(self.device)
        return frame

    def send(self, tensor: Tensor, dst: int, stream: int, microbatch: int, version: int = 0, count: bool = True) -> None:
        """Post ``tensor`` to global rank ``dst`` without waiting for the peer to take it.

        ``count=False`` keeps the bytes off the meter (evaluation traffic is not training traffic).
        """
        if tensor.dtype not in _CODE:
            raise TypeError(f"pipeline p2p: cannot send dtype {tensor.dtype}; supported: {', '.join(map(str, DTYPES))}")
        if tensor.ndim > MAX_NDIM:
            raise ValueError(f"pipeline p2p: tensor of {tensor.ndim} dims; at most {MAX_NDIM}")
        payload = tensor.detach().contiguous()
        meta: Meta = (_CODE[payload.dtype], tuple(payload.shape))
        frames = []
        previous = self._sent.get((dst, stream))
        if previous != meta:  # the receiver expects the old size: announce the new shape in a frame of that size
            frames.append(self._frame(ANNOUNCE, stream, microbatch, version, meta, None, _nbytes(previous)))
            self._sent[(dst, stream)] = meta
        frames.append(self._frame(DATA, stream, microbatch, version, meta, payload, _nbytes(meta)))
        handles = self._pending.setdefault((dst, stream, microbatch), [])
        for frame in frames:
            handles.append((dist.isend(frame, dst=dst, group=self.group, tag=stream), frame))
            if self.meter is not None and count:
                self.meter.add("pipeline_p2p", frame.numel())

    def post(self, src: int, stream: int, microbatch: int) -> None:
        """Post the receive of the next frame of ``stream`` from ``src`` (it will carry ``microbatch``) now; the
        caller guarantees that frame will be sent. A receive already posted there is left as it is."""
        if (src, stream) in self._posted:
            return
        frame = torch.empty(HEADER_BYTES + _nbytes(self._received.get((src, stream))), dtype=torch.uint8, device=self.device)
        self._posted[(src, stream)] = (microbatch, dist.irecv(frame, src=src, group=self.group, tag=stream), frame)

    def recv(self, src: int, stream: int, microbatch: int) -> Message:
        """Receive the next message of ``stream`` from global rank ``src``; it must be ``microbatch``."""
        start = time.perf_counter()
        where = f"pipeline p2p from rank {src}"
        expected = self._received.get((src, stream))
        posted = self._posted.pop((src, stream), None)
        if posted is not None:
            if posted[0] != microbatch:
                raise RuntimeError(f"{where}: a receive was posted for micro-batch {posted[0]} on stream {stream}, "
                                   f"the schedule now expects {microbatch}")  # fmt: skip
            posted[1].wait()
            frame = posted[2]
        else:
            frame = self._recv_frame(src, stream, _nbytes(expected))
        kind, meta, got_mb, version = self._parse(frame, stream, where)
        if kind == ANNOUNCE:
            self._received[(src, stream)] = expected = meta
            frame = self._recv_frame(src, stream, _nbytes(meta))
            kind, meta, got_mb, version = self._parse(frame, stream, where)
        if kind != DATA or meta != expected:
            raise RuntimeError(f"{where}: expected a data frame of shape {expected}, got kind {kind} with {meta}")
        if got_mb != microbatch:
            raise RuntimeError(f"{where}: got micro-batch {got_mb} on stream {stream}, the schedule expects {microbatch}")
        code, shape = meta
        tensor = frame[HEADER_BYTES:].view(DTYPES[code]).view(shape)
        self.wait_s += time.perf_counter() - start
        return Message(tensor, got_mb, version)

    def _recv_frame(self, src: int, stream: int, size: int) -> Tensor:
        frame = torch.empty(HEADER_BYTES + size, dtype=torch.uint8, device=self.device)
        dist.recv(frame, src=src, group=self.group, tag=stream)
        return frame

    def _parse(self, frame: Tensor, stream: int, where: str) -> tuple[int, Meta, int, int]:
        """(kind, meta, micro-batch, version) of a frame's header, every field checked."""
        header = frame[:HEADER_BYTES].cpu().view(torch.int64).tolist()
        magic, got_stream, got_mb, version, code, ndim = header[:6]
        if magic != MAGIC or got_stream != stream:
            raise RuntimeError(f"{where}: bad header (magic {magic:#x}, stream {got_stream}); expected {MAGIC:#x}, {stream}")
        if not 0 <= code < len(DTYPES) or not 0 <= ndim <= MAX_NDIM or header[14] not in (DATA, ANNOUNCE):
            raise RuntimeError(f"{where}: bad header (dtype code {code}, ndim {ndim}, kind {header[14]})")
        shape = tuple(header[6 : 6 + ndim])
        if any(d < 0 for d in shape):
            raise RuntimeError(f"{where}: negative shape {list(shape)}")
        nbytes = math.prod(shape) * _ITEMSIZE[code]
        if nbytes > self.max_message_bytes:
            raise RuntimeError(f"{where}: message of {nbytes} bytes exceeds max_message_bytes={self.max_message_bytes}")
        return header[14], (code, shape), got_mb, version

    def release(self, dst: int, stream: int, upto: int) -> None:
        """Wait for (and drop) the sends to ``dst`` on ``stream`` of micro-batches ``<= upto``; the caller
        guarantees the peer has already received them, so this returns at once."""
        for key in [k for k in self._pending if k[0] == dst and k[1] == stream and k[2] <= upto]:
            for work, _ in self._pending.pop(key):
                work.wait()

    def wait_all(self) -> None:
        """Block until every posted send has been taken (when every peer is known to receive them)."""
        for handles in self._pending.values():
            for work, _ in handles:
                work.wait()
        self._pending.clear()

    @property
    def posted(self) -> int:
        """Receives posted ahead and not yet taken."""
        return len(self._posted)

    @property
    def pending(self) -> int:
        """Sends not yet released."""
        return len(self._pending)
