"""Seeded splits and per-rank batch sampling for heterogeneous workers.

Lightning's default path shards the training set with a ``DistributedSampler``: every rank gets the same
number of samples and the same batch size. Heterogeneous workers (a fast GPU beside a slow one) want their
own batch sizes, but collective algorithms still need every rank to take the same number of steps per
epoch, or the ranks that finish early hang in the next all-reduce. :class:`RankBatchSampler` gives each
rank its own batch size and a fixed, shared ``steps_per_epoch``.

The rule, with ``b_r`` the batch size of rank ``r`` and ``N`` training samples::

    shard_r         disjoint, |shard_r| proportional to b_r      (fixed for the whole run, seeded by seed)
    steps_per_epoch ceil(N / sum_r b_r)                          (= ceil(N / (world_size * mean batch)))
    epoch e, rank r a permutation of shard_r seeded by (seed, e, r), cycled if steps * b_r > |shard_r|

so one epoch still processes about ``N`` samples in total, and each rank sees about its whole shard once
per epoch. Using the *mean* batch size (rather than the max) keeps the epoch at one pass over the data; the
max would shorten the epoch and leave most of each small-batch shard unseen.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import BatchSampler, Sampler


def mix_seed(*keys: int) -> int:
    """A well-mixed 63-bit seed from non-negative integer keys, e.g. ``(seed, epoch, rank)``."""
    return int(np.random.SeedSequence([int(k) for k in keys]).generate_state(1, dtype=np.uint64)[0] >> 1)


def stratified_split(labels: torch.Tensor, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split sample indices into train and validation, keeping each class's share in both.

    Each class ``c`` with ``n_c`` samples puts ``round(val_fraction * n_c)`` of them (a seeded random
    choice) into validation. Works for tiny datasets, unlike a split that needs ``n_val >= num_classes``.

    Args:
        labels: ``(N,)`` integer class labels.
        val_fraction: share of each class that goes to validation, in ``(0, 1)``.
        seed: seeds the per-class shuffles; the same seed gives the same split.

    Returns:
        ``(train_idx, val_idx)``: sorted int64 index tensors that partition ``range(N)``.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"stratified_split(val_fraction={val_fraction}): val_fraction must be in (0, 1)")
    labels = torch.as_tensor(labels).reshape(-1)
    g = torch.Generator().manual_seed(mix_seed(seed))
    train, val = [], []
    for c in torch.unique(labels).tolist():  # sorted, so the draw order is fixed
        idx = torch.nonzero(labels == c).reshape(-1)
        idx = idx[torch.randperm(len(idx), generator=g)]
        n_val = int(round(val_fraction * len(idx)))
        val.append(idx[:n_val])
        train.append(idx[n_val:])
    return torch.cat(train).sort().values, torch.cat(val).sort().values


def shard_sizes(num_samples: int, batch_sizes: Sequence[int]) -> list[int]:
    """Split ``num_samples`` into one shard size per rank, proportional to ``batch_sizes``.

    Largest-remainder rounding, so the sizes sum to ``num_samples`` exactly; ties go to the lower rank.
    """
    total = sum(batch_sizes)
    exact = [num_samples * b / total for b in batch_sizes]
    sizes = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(sizes)), key=lambda r: (-(exact[r] - sizes[r]), r))
    for r in by_remainder[: num_samples - sum(sizes)]:
        sizes[r] += 1
    return sizes


def rank_shards(num_samples: int, batch_sizes: Sequence[int], seed: int) -> list[torch.Tensor]:
    """Disjoint index shards, one per rank, sized by :func:`shard_sizes` from one seeded permutation."""
    g = torch.Generator().manual_seed(mix_seed(seed))
    perm = torch.randperm(num_samples, generator=g)
    return list(torch.split(perm, shard_sizes(num_samples, batch_sizes)))


def default_steps_per_epoch(num_samples: int, batch_sizes: Sequence[int]) -> int:
    """``ceil(num_samples / sum(batch_sizes))``: one epoch is about one pass over the data in total."""
    return math.ceil(num_samples / sum(batch_sizes))


def epoch_indices(shard: torch.Tensor, count: int, seed: int, epoch: int, rank: int) -> torch.Tensor:
    """``count`` indices from ``shard`` for one epoch: seeded permutations of the shard, cycled as needed.

    Within one pass over the shard no index repeats; a rank that needs more than its shard starts a fresh
    permutation (sampling with replacement across passes).
    """
    g = torch.Generator().manual_seed(mix_seed(seed, epoch, rank))
    passes = math.ceil(count / len(shard))
    return torch.cat([shard[torch.randperm(len(shard), generator=g)] for _ in range(passes)])[:count]


class RankShardSampler(Sampler[int]):
    """This rank's sample indices for one epoch: ``num_samples`` draws from its own shard.

    Args:
        shard: this rank's indices into the dataset, disjoint from every other rank's.
        num_samples: indices yielded per epoch (``steps_per_epoch * batch_size`` of this rank).
        seed: base seed; the epoch's order is seeded by ``(seed, epoch, rank)``.
        rank: this process's rank, part of the seed.
    """

    def __init__(self, shard: torch.Tensor, num_samples: int, seed: int, rank: int):
        if len(shard) == 0:
            raise ValueError(f"RankShardSampler(rank={rank}): the shard is empty; every rank needs at least one sample")
        self.shard, self.num_samples, self.seed, self.rank = shard, num_samples, seed, rank
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order ``__iter__`` yields (Lightning calls this every epoch)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        return iter(epoch_indices(self.shard, self.num_samples, self.seed, self.epoch, self.rank).tolist())

    def __len__(self) -> int:
        return self.num_samples


class RankBatchSampler(BatchSampler):
    """Batches of this rank's own size, from its own disjoint shard, in lockstep with every other rank.

    Every rank builds the same shards (from ``seed``) and keeps its own; rank ``r`` yields
    ``steps_per_epoch`` batches of ``batch_sizes[r]`` indices. See the module docstring for the rule.

    Lightning must not wrap this sampler in a ``DistributedSampler`` (it would try, and fail, to inject one):
    set ``Trainer(use_distributed_sampler=False)``. Lightning's fit loop calls ``set_epoch`` on
    ``batch_sampler.sampler`` (a :class:`RankShardSampler`), never on the batch sampler itself;
    :meth:`set_epoch` here forwards for code that calls it directly.

    Args:
        num_samples: size of the dataset the indices point into.
        batch_sizes: one batch size per rank; ``len(batch_sizes)`` is the world size. Larger batches go to
            faster workers; each rank's shard grows with its batch size, so every rank sees its shard about
            once per epoch.
        rank: this process's rank, in ``[0, len(batch_sizes))``.
        seed: seeds the shard assignment (fixed for the run) and each epoch's order.
        steps_per_epoch: batches per epoch on every rank; ``None`` means ``ceil(num_samples / sum(batch_sizes))``.
            Larger values cycle through fresh permutations of each shard.
    """

    def __init__(
        self,
        num_samples: int,
        batch_sizes: Sequence[int],
        rank: int,
        seed: int = 0,
        steps_per_epoch: int | None = None,
    ):
        batch_sizes = list(batch_sizes)
        if not batch_sizes or any(not isinstance(b, int) or b < 1 for b in batch_sizes):
            raise ValueError(
                f"RankBatchSampler(batch_sizes={batch_sizes}): batch_sizes must be a non-empty list of ints >= 1"
            )
        if not 0 <= rank < len(batch_sizes):
            n = len(batch_sizes)
            raise ValueError(f"RankBatchSampler(rank={rank}): rank must be in [0, {n}) for {n} batch sizes")
        if num_samples < sum(batch_sizes):
            raise ValueError(
                f"RankBatchSampler(num_samples={num_samples}): num_samples must be >= sum(batch_sizes) = "
                f"{sum(batch_sizes)}, so that one step never repeats a sample on a rank"
            )
        if seed < 0:
            raise ValueError(f"RankBatchSampler(seed={seed}): seed must be >= 0")
        if steps_per_epoch is not None and steps_per_epoch < 1:
            raise ValueError(
                f"RankBatchSampler(steps_per_epoch={steps_per_epoch}): steps_per_epoch must be >= 1 or None"
            )
        self.batch_sizes, self.rank, self.seed = batch_sizes, rank, seed
        self.world_size = len(batch_sizes)
        self.steps_per_epoch = steps_per_epoch or default_steps_per_epoch(num_samples, batch_sizes)
        shard = rank_shards(num_samples, batch_sizes, seed)[rank]
        sampler = RankShardSampler(shard, self.steps_per_epoch * batch_sizes[rank], seed, rank)
        super().__init__(sampler, batch_size=batch_sizes[rank], drop_last=False)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose batches ``__iter__`` yields."""
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return self.steps_per_epoch
