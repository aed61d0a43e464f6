"""Seeded stratified splits and the per-rank RankBatchSampler."""

import math

import pytest
import torch

from lightning_pdist.data.sampling import (
    RankBatchSampler,
    RankShardSampler,
    default_steps_per_epoch,
    rank_shards,
    shard_sizes,
    stratified_split,
)


def _epoch(sampler: RankBatchSampler, epoch: int) -> list[list[int]]:
    sampler.set_epoch(epoch)
    return list(sampler)


def test_stratified_split_partitions_and_keeps_class_shares():
    """Train and val partition the indices, and each class sends round(fraction * n_c) samples to val."""
    labels = torch.tensor([0] * 50 + [1] * 30 + [2] * 7)
    train, val = stratified_split(labels, 0.2, seed=0)
    assert sorted(torch.cat([train, val]).tolist()) == list(range(len(labels)))
    assert [int((labels[val] == c).sum()) for c in range(3)] == [10, 6, 1]


def test_stratified_split_is_seeded():
    """The same seed gives the same split; another seed gives another."""
    labels = torch.arange(200) % 10
    assert torch.equal(stratified_split(labels, 0.25, 3)[1], stratified_split(labels, 0.25, 3)[1])
    assert not torch.equal(stratified_split(labels, 0.25, 3)[1], stratified_split(labels, 0.25, 4)[1])


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1])
def test_stratified_split_rejects_fraction(fraction):
    """val_fraction outside (0, 1) raises, naming the value."""
    with pytest.raises(ValueError, match=rf"val_fraction={fraction}\): val_fraction must be in \(0, 1\)"):
        stratified_split(torch.arange(10), fraction, 0)


@pytest.mark.parametrize(
    ("n", "sizes", "expected"), [(100, [1, 1], [50, 50]), (10, [1, 2], [3, 7]), (7, [1, 1, 1], [3, 2, 2])]
)
def test_shard_sizes_are_proportional_and_sum_to_n(n, sizes, expected):
    """Shards follow the batch sizes with largest-remainder rounding and cover every sample."""
    assert shard_sizes(n, sizes) == expected


def test_ranks_get_disjoint_shards_their_own_batch_size_and_equal_steps():
    """Each rank yields only its own batch size, from a shard disjoint from the others, for the same step count."""
    n, sizes = 1000, [8, 16, 40]
    samplers = [RankBatchSampler(n, sizes, rank, seed=7) for rank in range(3)]
    steps = math.ceil(n / sum(sizes))
    seen = []
    for rank, sampler in enumerate(samplers):
        batches = _epoch(sampler, 0)
        assert len(sampler) == len(batches) == steps
        assert all(len(b) == sizes[rank] for b in batches)
        seen.append({i for b in batches for i in b})
        assert seen[-1] <= set(rank_shards(n, sizes, 7)[rank].tolist())
    assert not (seen[0] & seen[1]) and not (seen[0] & seen[2]) and not (seen[1] & seen[2])


def test_one_epoch_covers_about_one_pass():
    """With the default step count every rank sees all of its shard in each epoch, and samples cycle only after it."""
    n, sizes = 1000, [8, 16, 40]
    for rank in range(3):
        sampler = RankBatchSampler(n, sizes, rank, seed=0)
        indices = [i for b in _epoch(sampler, 0) for i in b]
        shard = rank_shards(n, sizes, 0)[rank].tolist()
        assert set(indices) == set(shard)
        assert len(set(indices[: len(shard)])) == len(shard)  # no repeat within the first pass


def test_epochs_are_deterministic_and_differ():
    """The same (seed, epoch, rank) gives the same batches; another epoch reshuffles."""
    a, b = RankBatchSampler(300, [10, 20], 1, seed=3), RankBatchSampler(300, [10, 20], 1, seed=3)
    assert _epoch(a, 2) == _epoch(b, 2)
    assert _epoch(a, 2) != _epoch(a, 3)
    assert _epoch(a, 0) == _epoch(a, 0)


def test_set_epoch_reaches_the_inner_sampler_lightning_calls():
    """Lightning calls set_epoch on batch_sampler.sampler only; that alone reorders the batches."""
    a, b = RankBatchSampler(300, [10, 20], 0), RankBatchSampler(300, [10, 20], 0)
    a.sampler.set_epoch(5)
    assert list(a) == _epoch(b, 5)


def test_steps_per_epoch_override_cycles_the_shard():
    """A fixed steps_per_epoch larger than the shard allows is filled by fresh permutations of the same shard."""
    sampler = RankBatchSampler(40, [4, 4], 0, seed=0, steps_per_epoch=12)
    batches = _epoch(sampler, 0)
    assert len(batches) == 12 and all(len(b) == 4 for b in batches)
    indices = [i for b in batches for i in b]
    assert set(indices) == set(rank_shards(40, [4, 4], 0)[0].tolist())
    assert len(set(indices[:20])) == 20  # first full pass has no repeats


def test_default_steps_per_epoch_uses_the_mean_batch():
    """steps = ceil(N / sum(batch_sizes)) = ceil(N / (world_size * mean batch))."""
    assert default_steps_per_epoch(1437, [16, 32, 48, 32]) == math.ceil(1437 / 128)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(batch_sizes=[]), r"batch_sizes=\[\]\): batch_sizes must be a non-empty list of ints >= 1"),
        (dict(batch_sizes=[4, 0]), r"batch_sizes=\[4, 0\]\): batch_sizes must be"),
        (dict(rank=2), r"rank=2\): rank must be in \[0, 2\)"),
        (dict(num_samples=5), r"num_samples=5\): num_samples must be >= sum\(batch_sizes\) = 8"),
        (dict(seed=-1), r"seed=-1\): seed must be >= 0"),
        (dict(steps_per_epoch=0), r"steps_per_epoch=0\): steps_per_epoch must be >= 1"),
    ],
)
def test_rank_batch_sampler_rejects_bad_arguments(kwargs, message):
    """Each bad argument raises a ValueError naming it, its value and the rule."""
    args = dict(num_samples=100, batch_sizes=[4, 4], rank=0) | kwargs
    with pytest.raises(ValueError, match=message):
        RankBatchSampler(**args)


def test_rank_shard_sampler_rejects_empty_shard():
    """An empty shard raises instead of yielding nothing."""
    with pytest.raises(ValueError, match=r"RankShardSampler\(rank=3\): the shard is empty"):
        RankShardSampler(torch.empty(0, dtype=torch.int64), 4, 0, 3)
