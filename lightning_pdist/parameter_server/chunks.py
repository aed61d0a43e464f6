"""Chunked sync steps (``chunk_bytes=``): each partition of a shard pushed, closed and pulled on its own (BytePS).

Without chunks a sync server answers a step's ``PUSHPULL`` only once every worker's whole shard arrived, so its
link carries the ``W`` pushes and then the ``W`` pulls, one after the other: a step takes about twice the time the
busiest link needs. With ``chunk_bytes = c`` the memory plan is cut into ``c``-byte partitions (``partition_bytes =
c``), and chunk ``j`` of a server is its ``j``-th partition, elements ``[a_j, b_j)`` of its shard. A worker sends its
chunks in order, each a ``PUSHPULL_CHUNK`` request on a connection of its own; the server closes chunk ``j`` as soon
as all ``W`` workers pushed it::

    mean_j = (1 / W) · Σ_w g_w[a_j:b_j]            (summed in arrival order, as the unchunked step)
    optimizer step on the pieces inside [a_j, b_j)  (each piece is a whole slice of one partition)

and answers each worker's request with ``x[a_j:b_j]``, while chunk ``j + 1``'s pushes still arrive: pushes in and
pulls out overlap, and a step takes about ``(1 + 1/k)`` times the link's time for ``k`` chunks per server.

Exactness: the optimizers are element-wise (:data:`~.shard.ELEMENTWISE_OPTIMIZERS`) and keep their state per piece,
and chunk boundaries are piece boundaries, so stepping the pieces of each chunk in a call of its own runs the same
operations on the same numbers as one call over all of them. The per-chunk sum adds the same gradients as the
unchunked step; float addition makes the result depend on the order pushes arrive in, exactly as without chunks (with
two workers ``a + b = b + a``: bit-identical). A step's version advances when its last chunk closes.

A push's payload is the compact gradient (present pieces of optimizer ``k`` only, in shard order); chunk ``j``'s part
of it is one contiguous range, ``compact[m(a_j):m(b_j)]``, where ``m(x)`` counts the present elements before ``x``.

Never imports Lightning.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_pdist.parameter_server.rules import BackupWorkerAggregator

__all__ = ["MAX_CHUNKS", "ChunkedStep", "chunk_bounds", "check_chunks"]

MAX_CHUNKS = 64  # per server: each chunk is one more connection per worker


def chunk_bounds(pieces: Sequence[tuple[int, int, int]], present: Sequence[bool], count: int) -> list[int]:
    """Offsets of each chunk's part in a compact push: ``count + 1`` values, from 0 to the compact length.

    ``pieces``: ``(start, stop, chunk)`` of optimizer ``k``'s pieces in shard order; ``present``: one flag per piece.
    """
    sizes = [0] * count
    for (start, stop, chunk), p in zip(pieces, present):
        if p:
            sizes[chunk] += stop - start
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    return bounds


def check_chunks(chunks: object, segments: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """INIT's ``chunks`` (elements per chunk) -> ``[(a_j, b_j)]``; each boundary must be a segment boundary.

    Raises:
        ValueError: naming the value and the rule.
    """
    numel = sum(s[-1] for s in segments)
    if (not isinstance(chunks, list) or not 1 <= len(chunks) <= MAX_CHUNKS
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in chunks)):  # fmt: skip
        shown = repr(chunks) if len(repr(chunks)) <= 80 else repr(chunks)[:77] + "..."
        raise ValueError(f"chunks={shown}: chunks must be a list of 1 to {MAX_CHUNKS} ints >= 1 (elements per chunk)")
    if sum(chunks) != numel:
        raise ValueError(f"chunks hold {sum(chunks)} elements; the segments hold {numel}")
    edges, at = set(), 0
    for s in segments:
        at += s[-1]
        edges.add(at)
    ranges, start = [], 0
    for n in chunks:
        if start + n not in edges:
            raise ValueError(f"chunk boundary {start + n} is inside a segment; chunks must end at segment boundaries")
        ranges.append((start, start + n))
        start += n
    return ranges


class ChunkedStep:
    """The chunks of one server's sync steps: per chunk, the workers' partial sums and the step it is on.

    Args:
        ranges: ``[(a_j, b_j)]``, the chunks' element ranges in the shard (:func:`check_chunks`).
        pieces: per optimizer, ``[(start, stop)]`` of its pieces in shard order (``ParameterShard.pieces``).
        num_workers: ``W``; every chunk closes on all ``W`` gradients (no backup workers).
        step: the step the server is on (its version).
    """

    def __init__(self, ranges: Sequence[tuple[int, int]], pieces: Sequence[Sequence[tuple[int, int]]],
                 num_workers: int, step: int = 0):  # fmt: skip
        self.ranges = list(ranges)
        self.pieces = [[(a, b, self.chunk_of(a)) for a, b in ps] for ps in pieces]
        self.num_workers = num_workers
        self.reset(step)

    def chunk_of(self, start: int) -> int:
        return next(j for j, (a, b) in enumerate(self.ranges) if a <= start < b)

    def reset(self, step: int) -> None:
        """Every chunk empty, on ``step`` (after INIT and SET_STATE)."""
        self.aggregators = [BackupWorkerAggregator(self.num_workers, 0, step=step) for _ in self.ranges]
        self.open: list[tuple[int, list[bool]] | None] = [None] * len(self.ranges)  # (optimizer, present) seen

    @property
    def count(self) -> int:
        return len(self.ranges)

    def bounds(self, optimizer: int, present: Sequence[bool]) -> list[int]:
        return chunk_bounds(self.pieces[optimizer], present, self.count)

    def expand(self, part: Tensor, chunk: int, optimizer: int, present: Sequence[bool]) -> Tensor:
        """Chunk ``chunk``'s gradient (chunk-sized, zeros where a piece is absent) from its part of a compact push."""
        a, b = self.ranges[chunk]
        full = torch.zeros(b - a, dtype=part.dtype)
        offset = 0
        for (start, stop, j), p in zip(self.pieces[optimizer], present):
            if p and j == chunk:
                full[start - a : stop - a] = part[offset : offset + stop - start]
                offset += stop - start
        return full

    def closed(self, chunk: int) -> int:
        """How many steps chunk ``chunk`` has closed (its version)."""
        return self.aggregators[chunk].step

    def lowest_open(self) -> int:
        """The first chunk of the open step not yet closed (0 between steps)."""
        steps = [a.step for a in self.aggregators]
        return steps.index(min(steps))
