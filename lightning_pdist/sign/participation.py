"""Which tensors of a DDP bucket take part in a sign vote, when some parameters sit out a backward pass.

With ``DistributedDataParallel(find_unused_parameters=True)`` a backward pass may leave parameters
out: those of another optimizer, switched off by Lightning's ``toggle_optimizer`` (a GAN's
generator step), or a branch the forward did not take. DDP still hands the whole bucket to the
comm hook, and what it holds in their slots is not a gradient of this pass (measured with torch
2.13, gloo: zeros if ``p.grad`` is ``None``, otherwise a copy of the stale ``p.grad``). What DDP
does with the hook's result for them (also measured):

* ``gradient_as_bucket_view=False`` (default): a parameter unused on *every* rank keeps its
  ``.grad`` untouched; the hook's output for it is dropped.
* ``gradient_as_bucket_view=True``: a globally unused parameter whose ``.grad`` is defined gets the
  hook's output written into it.
* A parameter used on *some* ranks gets the hook's output; the others contributed their slot.

So a sign vote cannot read participation from the bucket, and must not guess: a tensor's sign
``sign(0) = +1`` or ``sign(stale)`` would vote, move Signum's momentum and the EF residual, and
count as agreement in the LLR statistics. The hook therefore learns it from autograd:
:class:`ParticipationTracker` registers a hook on each parameter's gradient, which fires before
DDP sees the gradient; the comm hook reads and clears the flags of its bucket's tensors. The
flags accumulate over ``no_sync`` micro-batches, as DDP's own ``local_used_map`` does.

Every rank sends its flags (one bit per tensor, :func:`flag_words` 32-bit words) in the vote's
all-to-all header, so all ranks agree on the tensors used anywhere (DDP's "globally used"):

* globally unused tensors do not vote, do not change momentum, residual, statistics or round
  counters, and the hook returns their slots unchanged, so ``.grad`` ends as DDP leaves it in
  both modes above;
* a rank that did not use a globally used tensor votes with a zero gradient (``sign(0) = +1``,
  its slot zeroed first so that no stale gradient votes), which is what DDP's average does with
  the same rank: it adds a zero.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

__all__ = ["ParticipationTracker", "coordinate_mask", "flag_words", "pack_flags", "unpack_flags", "used_runs"]


def flag_words(num_tensors: int) -> int:
    """32-bit header words that carry one flag per tensor: ``ceil(T / 32)``."""
    return (num_tensors + 31) // 32


def pack_flags(flags: Sequence[bool]) -> Tensor:
    """``T`` flags as ``ceil(T/32)`` int32 words: flag ``j`` is bit ``j % 32`` of word ``j // 32``."""
    words = torch.zeros(flag_words(len(flags)), dtype=torch.int32)
    for j, flag in enumerate(flags):
        if flag:
            words[j // 32] |= 1 << (j % 32) if j % 32 < 31 else -(2**31)
    return words


def unpack_flags(words: Tensor, num_tensors: int) -> Tensor:
    """Inverse of :func:`pack_flags` for a ``(rows, words)`` int32 tensor: ``(rows, T)`` bool."""
    bits = words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)
    return (bits & 1).bool().flatten(-2)[..., :num_tensors]


def coordinate_mask(lengths: Sequence[int], used: Tensor) -> Tensor:
    """``(d,)`` bool: the coordinates of the tensors flagged in ``used`` (``(T,)`` bool)."""
    return used.repeat_interleave(torch.tensor(list(lengths)))


def used_runs(
    lengths: Sequence[int], used: Tensor | None, start: int, stop: int, per_tensor: bool
) -> list[tuple[int, int, int]]:
    """``(column, first, stop)`` of the used coordinates in slice ``[start, stop)``, slice-relative.

    ``column`` is the tensor index with ``per_tensor`` (the ``tensor`` estimator's groups), else 0,
    and adjacent used tensors then merge into one run. ``used=None`` means every tensor.
    """
    runs: list[tuple[int, int, int]] = []
    offset = 0
    for j, length in enumerate(lengths):
        a, b = max(offset, start), min(offset + length, stop)
        offset += length
        if a >= b or (used is not None and not bool(used[j])):
            continue
        if not per_tensor and runs and runs[-1][2] == a - start:
            runs[-1] = (0, runs[-1][1], b - start)
        else:
            runs.append((j if per_tensor else 0, a - start, b - start))
    return runs


class ParticipationTracker:
    """Flags the parameters that received a gradient since the comm hook last read them.

    ``watch(parameters)`` registers one gradient hook per parameter (it returns the gradient
    unchanged); ``take(params)`` returns the flags of ``params`` and clears them.
    """

    def __init__(self) -> None:
        self.watched: set[int] = set()
        self.touched: set[int] = set()
        self.handles: list = []

    def watch(self, parameters: Iterable[Tensor]) -> None:
        for p in parameters:
            if p.requires_grad and id(p) not in self.watched:
                key = id(p)
                self.watched.add(key)
                self.handles.append(p.register_hook(lambda grad, key=key: self.touched.add(key)))

    def take(self, param_ids: Sequence[int], hook: str) -> list[bool]:
        missing = [j for j, key in enumerate(param_ids) if key not in self.watched]
        if missing:
            raise RuntimeError(
                f"{hook}: find_unused_parameters=True but tensors {missing} of this bucket are not watched; call "
                "state.watch(model.parameters()) before the first backward, so the vote knows which take part"
            )
        flags = [key in self.touched for key in param_ids]
        self.touched.difference_update(param_ids)
        return flags

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles, self.watched, self.touched = [], set(), set()
