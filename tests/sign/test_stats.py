"""Tier 1: the vote statistics counted on packed bytes equal plain counts on ±1 signs."""

import pytest
import torch

from lightning_pdist.sign.bits import pack_bits
from lightning_pdist.sign.stats import VoteStats, count_disagreements, count_ties, take_vote_diagnostics


def _packed_rows(signs: torch.Tensor, num_bytes: int) -> torch.Tensor:
    """(M, n) ±1 → (M, num_bytes) packed, zero-padded."""
    packed = pack_bits(signs > 0)
    return torch.nn.functional.pad(packed, (0, num_bytes - packed.shape[1]))


@pytest.mark.parametrize("world_size", [2, 3, 4, 14])
@pytest.mark.parametrize("with_keep", [False, True])
def test_count_ties_on_packed_rows(world_size, with_keep):
    """Ties = coordinates whose M signs sum to 0 (none for odd M), within the slice's n_local and the kept ones;
    packed truth tables up to 12 workers, unpacked signs above."""
    g = torch.Generator().manual_seed(world_size)
    n_local = 45  # not a multiple of 8: the last byte is part padding
    signs = torch.randint(0, 2, (world_size, n_local), generator=g) * 2 - 1
    keep = torch.rand(n_local, generator=g) > 0.3 if with_keep else None
    split = signs.sum(0) == 0
    want = int((split & keep).sum()) if with_keep else int(split.sum())
    counted, ties = count_ties(_packed_rows(signs, 7), n_local, keep)
    assert (counted, ties) == (int(keep.sum()) if with_keep else n_local, want)
    if world_size % 2 == 0:
        assert ties > 0


@pytest.mark.parametrize("with_keep", [False, True])
def test_count_disagreements_on_packed_bytes(with_keep):
    """This rank's signs against the vote, by XOR and popcount, equal the plain count; coordinates outside the vote
    (zero vote bits) are not counted."""
    g = torch.Generator().manual_seed(0)
    world_size, chunk, numel = 3, 4, 90  # 3 slices of 32 coordinates, the last one part padding
    own = torch.randint(0, 2, (numel,), generator=g) * 2 - 1
    vote = torch.randint(0, 2, (numel,), generator=g) * 2 - 1
    keep = torch.rand(numel, generator=g) > 0.4 if with_keep else None
    vote_bits = (vote > 0) & (keep if with_keep else True)  # outside the vote its bits are 0
    pad = lambda b: torch.nn.functional.pad(pack_bits(b), (0, world_size * chunk - (numel + 7) // 8)).view(world_size, chunk)  # noqa: E731
    counted, differs = count_disagreements(pad(own > 0), pad(vote_bits), numel, keep)
    mask = keep if with_keep else torch.ones(numel, dtype=torch.bool)
    assert (counted, differs) == (int(mask.sum()), int(((own != vote) & mask).sum()))


def test_nothing_to_report_on_one_rank_or_before_a_vote():
    """No vote (one rank, or none since the last call): no keys, no collective."""

    class State:
        stats, world_size, llr, buckets = VoteStats(), 1, None, {}

    assert take_vote_diagnostics(State()) == {}
    State.world_size = 2
    assert take_vote_diagnostics(State()) == {}
