"""Vote statistics of the sign hooks: ties, this worker's disagreements with the vote, the learned LLR weights.

Counted from what a vote already holds (no extra collective per vote; a few byte operations per bucket):

* **Disagreements**: coordinates where the sign this rank sent (of its gradient, Signum momentum or ``g + e``)
  differs from the voted ``U``: the XOR of its packed signs with the gathered packed vote, counted by popcount.
  Its share is what IT-signSGD's ``worker`` estimator learns from (``p``), for every aggregation.
* **Ties**: coordinates whose signs split evenly, ``Σ_m Y_m = 0`` (even ``M`` only; the vote then goes to ``+1``).
  Each rank counts them in its own slice of the sharded vote, where it holds every worker's bits.
* **LLR weights** (IT-signSGD): per worker, the observation-weighted mean over buckets and columns of the weight
  ``w = log((1 − p)/p)`` its statistics give (:func:`~lightning_pdist.sign.llr.weight_sums`).

:func:`take_vote_diagnostics` turns the counts since its last call into rates; it is called on every rank at the
same points (a strategy's logged steps). Slices are per rank, so the tie count (and the per-coordinate LLR
statistics, also sharded) are summed over the ranks there: one all-reduce of ``2 + M + 1`` fp64 numbers at most,
not counted as training traffic (like evaluation traffic, it is not the algorithm's).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_pdist.sign.llr import weight_sums
from lightning_pdist.sign.vote import tie_table
from lightning_pdist.sign.bits import count_ones, mask_bits_, pack_bits, truth_table_bits, unpack_signs

__all__ = ["MAX_LOGGED_WEIGHTS", "VoteStats", "count_disagreements", "count_ties", "take_vote_diagnostics"]

#: Up to this many workers each LLR weight is logged (``pdist/sign/llr_weight/rank{r}``); above, the min and max.
MAX_LOGGED_WEIGHTS = 8
# Truth tables are evaluated on packed bytes up to this many workers (as the vote itself: sign_hooks).
_MAX_TABLE_WORKERS = 12


@dataclass
class VoteStats:
    """Counts since the last :func:`take_vote_diagnostics` (this rank's; never checkpointed)."""

    rounds: int = 0  # bucket votes counted
    coordinates: int = 0  # coordinates this rank voted on
    disagreements: int = 0  # of those, where its sign differed from U
    slice_coordinates: int = 0  # coordinates of this rank's slices of the votes
    ties: int = 0  # of those, where the workers' signs split evenly

    def add(self, coordinates: int, disagreements: int, slice_coordinates: int, ties: int) -> None:
        self.rounds += 1
        self.coordinates += coordinates
        self.disagreements += disagreements
        self.slice_coordinates += slice_coordinates
        self.ties += ties

    def reset(self) -> None:
        self.rounds = self.coordinates = self.disagreements = self.slice_coordinates = self.ties = 0


def _ones(packed: Tensor) -> int:
    """Set bits of a flat packed tensor."""
    return int(count_ones(packed.reshape(1, -1))[0])


def _keep_bits(keep: Tensor, num_bytes: int) -> Tensor:
    """``keep`` (n,) bool packed and zero-padded to ``num_bytes`` bytes."""
    packed = pack_bits(keep.cpu()).to(keep.device)
    return torch.nn.functional.pad(packed, (0, num_bytes - packed.numel()))


def count_disagreements(own: Tensor, vote: Tensor, numel: int, keep: Tensor | None) -> tuple[int, int]:
    """``(coordinates, disagreements)`` of one bucket: this rank's packed signs against the packed vote.

    Args:
        own: ``(M, C)`` ``uint8``: the packed signs this rank sent, zero padding past the bucket's ``d``.
        vote: ``(M, C)`` ``uint8``: the gathered packed vote, zero padding and zero outside the vote.
        numel: the bucket's ``d``.
        keep: ``(d,)`` bool, the coordinates in the vote (``None``: all ``d``).
    """
    differs = (own ^ vote).reshape(-1)  # (M·C,): 0 in the padding of both
    if keep is None:
        return numel, _ones(differs)
    return int(keep.sum()), _ones(differs & _keep_bits(keep, differs.numel()))


def count_ties(rows: Tensor, n_local: int, keep: Tensor | None) -> tuple[int, int]:
    """``(coordinates, ties)`` of this rank's slice: where the ``M`` workers' signs split evenly.

    Args:
        rows: ``(M, C)`` ``uint8``: every worker's packed signs for this rank's slice (from the all-to-all).
        n_local: the slice's coordinates (``<= 8C``; the rest is padding).
        keep: ``(n_local,)`` bool, the slice's coordinates in the vote (``None``: all).
    """
    world_size = rows.shape[0]
    counted = n_local if keep is None else int(keep.sum())
    if world_size % 2 or not counted:
        return counted, 0
    if world_size <= _MAX_TABLE_WORKERS:
        ties = mask_bits_(truth_table_bits(rows, _tie_table(world_size)), 0, n_local)  # (C,)
        if keep is not None:
            ties &= _keep_bits(keep, ties.numel())
        return counted, _ones(ties)
    split = unpack_signs(rows, n_local).sum(0, dtype=torch.int32) == 0  # (n_local,)
    return counted, int((split if keep is None else split & keep).sum())


@functools.lru_cache(maxsize=None)
def _tie_table(world_size: int) -> tuple[bool, ...]:
    return tuple(tie_table(world_size).tolist())


def take_vote_diagnostics(state, process_group: dist.ProcessGroup | None = None,
                          device: torch.device | str | None = None) -> dict[str, float]:  # fmt: skip
    """The ``pdist/sign/*`` rates since the last call, from ``state`` (a :class:`SignSGDState`); resets its counts.

    Collective when the world size is even or the LLR statistics are per coordinate (one small all-reduce):
    call it on every rank at the same points (``device``: where the process group's tensors live). Empty on one
    rank or before any vote.

    Keys: ``pdist/sign/disagreement`` (this rank's share of coordinates whose sign differed from the vote),
    ``pdist/sign/tie_rate`` (even world sizes: the share of all coordinates whose signs split evenly) and, for
    IT-signSGD, ``pdist/sign/llr_weight/rank{r}`` for each worker (``pdist/sign/llr_weight_min``/``_max`` above
    :data:`MAX_LOGGED_WEIGHTS` workers).
    """
    stats: VoteStats = state.stats
    world_size = state.world_size or 1
    if world_size == 1 or not stats.rounds:
        return {}
    out = {"pdist/sign/disagreement": stats.disagreements / max(stats.coordinates, 1)}
    llr = state.llr
    weighted = mass = None
    if llr is not None:
        states = [s for b in state.buckets.values() for s in ([b.llr] if b.llr is not None else []) + list(b.groups.values())]
        sums = [weight_sums(s, llr) for s in states]
        if sums:
            weighted, mass = torch.stack([w for w, _ in sums]).sum(0), torch.stack([t for _, t in sums]).sum()
    sharded = llr is not None and llr.estimator == "coordinate" and weighted is not None
    if world_size % 2 == 0 or sharded:
        # Slices are per rank: sum the tie counts (and sharded LLR statistics) over the ranks.
        parts = [float(stats.ties), float(stats.slice_coordinates)]
        if sharded:
            parts += [*weighted.tolist(), float(mass)]
        total = torch.tensor(parts, dtype=torch.float64, device=device)
        dist.all_reduce(total, group=process_group)
        total = total.cpu()
        if world_size % 2 == 0:
            out["pdist/sign/tie_rate"] = float(total[0] / max(float(total[1]), 1.0))
        if sharded:
            weighted, mass = total[2:-1], total[-1]
    if weighted is not None and float(mass) > 0:
        weights = (weighted / mass).tolist()
        if world_size <= MAX_LOGGED_WEIGHTS:
            out.update({f"pdist/sign/llr_weight/rank{r}": w for r, w in enumerate(weights)})
        else:
            out["pdist/sign/llr_weight_min"], out["pdist/sign/llr_weight_max"] = min(weights), max(weights)
    stats.reset()
    return out
