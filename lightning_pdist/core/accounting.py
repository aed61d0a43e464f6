"""Byte accounting: how many bytes each rank *sends* per collective.

The model is the bandwidth-optimal algorithm for each collective on ``N`` ranks, for a payload
of ``n`` bytes (the full tensor each rank contributes or receives):

================  ==========================  ===============================================
collective        bytes sent per rank          why
================  ==========================  ===============================================
all-reduce        ``2 (N-1)/N · n``            ring: reduce-scatter then all-gather, each
                                               moves ``(N-1)/N · n``
all-gather        ``(N-1) · n_local``          ring: every rank forwards the other ``N-1``
                                               chunks of ``n_local`` bytes once
all-to-all        ``(N-1)/N · n``              each rank keeps its own ``1/N`` slice
reduce-scatter    ``(N-1)/N · n``
broadcast         ``n`` on the root, 0 else    the root sends one copy (tree/ring pipelines
                                               forward it, but the root's link carries ``n``)
point-to-point    ``n`` on the sender
================  ==========================  ===============================================

gloo implements all-reduce for large tensors as a ring (``allreduce_ring_chunked``), so the
model matches what crosses the wire up to message headers; the emulated-network benchmark
checks the logged figure against the kernel's ``tx_bytes`` of each rank's veth.

A :class:`CommMeter` is a per-process counter. The transport functions in
:mod:`lightning_pdist.core.collectives` add to it; the strategies read and reset the per-step
figure after every optimizer step and log it as ``pdist/comm_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "CommMeter",
    "all_gather_bytes",
    "all_reduce_bytes",
    "all_to_all_bytes",
    "broadcast_bytes",
    "reduce_scatter_bytes",
]


def all_reduce_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``nbytes``: ``2 (N-1)/N · n``."""
    return (2 * (world_size - 1) * nbytes) // world_size


def all_gather_bytes(local_nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-gather of ``local_nbytes`` per rank: ``(N-1) · n_local``."""
    return (world_size - 1) * local_nbytes


def all_to_all_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in an all-to-all of an ``nbytes`` buffer split in ``N`` slices."""
    return ((world_size - 1) * nbytes) // world_size


def reduce_scatter_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring reduce-scatter of ``nbytes``: ``(N-1)/N · n``."""
    return ((world_size - 1) * nbytes) // world_size


def broadcast_bytes(nbytes: int, world_size: int, is_src: bool) -> int:
    """Bytes one rank sends in a broadcast: ``n`` on the source, 0 elsewhere."""
    return nbytes if (is_src and world_size > 1) else 0


@dataclass
class CommMeter:
    """Counts the bytes this process sends, per optimizer step and in total.

    ``by_kind`` breaks the cumulative total down by the label passed to :meth:`add`
    (``"all_reduce"``, ``"sign_all_gather"``, ...), which the benchmarks report.
    """

    step_bytes: int = 0
    total_bytes: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, nbytes: int) -> None:
        """Record ``nbytes`` sent by this rank under the label ``kind``."""
        nbytes = int(nbytes)
        self.step_bytes += nbytes
        self.total_bytes += nbytes
        self.by_kind[kind] = self.by_kind.get(kind, 0) + nbytes

    def end_step(self) -> int:
        """Close the current step: return its byte count and start a new one at zero."""
        sent, self.step_bytes = self.step_bytes, 0
        return sent

    def state_dict(self) -> dict:
        return {"total_bytes": self.total_bytes, "by_kind": dict(self.by_kind)}

    def load_state_dict(self, state: dict) -> None:
        self.step_bytes = 0
        self.total_bytes = int(state.get("total_bytes", 0))
        self.by_kind = dict(state.get("by_kind", {}))
