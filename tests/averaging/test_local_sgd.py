"""Tier 3: LocalSGDStrategy in real 2-rank Lightning runs (fork launcher, gloo)."""

import pytest
import torch
from _helpers import SnapshotParams, TinyRegression, assert_matches_reference, fit, reference_replicas

from lightning_pdist import LocalSGDStrategy


def test_period_one_equals_lightning_ddp():
    """LocalSGDStrategy(period=1) ends with the same parameters as Lightning's "ddp" (1e-6)."""
    ddp_model, local_model = TinyRegression(), TinyRegression()
    fit("ddp_fork", ddp_model, max_steps=10)
    fit(LocalSGDStrategy(period=1, start_method="fork"), local_model, max_steps=10)
    for a, b in zip(ddp_model.parameters(), local_model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("period, warmup", [(3, 0), (2, 3)])
def test_every_rank_matches_reference_over_several_periods(tmp_path, period, warmup):
    """Each rank's parameters after every step equal a plain-torch local SGD (different data per rank)."""
    fit(LocalSGDStrategy(period=period, warmup_steps=warmup, start_method="fork"), TinyRegression(), max_steps=11,
        callbacks=[SnapshotParams(tmp_path)])

    def average(flats, state):
        mean = torch.stack(flats).mean(0)
        return [mean.clone() for _ in flats]

    assert_matches_reference(tmp_path, reference_replicas(2, 11, average, period, warmup), world=2)


def test_replicas_differ_between_syncs_and_agree_after(tmp_path):
    """Between averages the ranks really train apart; after an average they agree."""
    fit(LocalSGDStrategy(period=4, start_method="fork"), TinyRegression(), max_steps=8, callbacks=[SnapshotParams(tmp_path)])
    from _helpers import load_snapshot

    assert not torch.allclose(load_snapshot(tmp_path, 0, 3), load_snapshot(tmp_path, 1, 3))
    torch.testing.assert_close(load_snapshot(tmp_path, 0, 4), load_snapshot(tmp_path, 1, 4))


def test_fit_ends_with_the_average_even_mid_period(tmp_path):
    """A fit that stops mid-period leaves every rank holding the average of the replicas."""
    from _helpers import load_snapshot

    model = TinyRegression()
    fit(LocalSGDStrategy(period=4, start_method="fork"), model, max_steps=6, callbacks=[SnapshotParams(tmp_path)])
    mean = (load_snapshot(tmp_path, 0, 6) + load_snapshot(tmp_path, 1, 6)) / 2
    got = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(got, mean, atol=1e-6, rtol=0)
