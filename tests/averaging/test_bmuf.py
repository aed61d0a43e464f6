"""Tier 3: BMUFStrategy in real 2-rank Lightning runs against the paper's equations."""

import pytest
import torch
from _helpers import SnapshotParams, TinyRegression, assert_matches_reference, fit, reference_replicas

from lightning_pdist import BMUFStrategy, LocalSGDStrategy


def _bmuf_reference(bm, blr, nesterov):
    def sync(flats, state):
        anchor = state.get("anchor", state.get("warm", _initial()))
        delta = state.get("delta", torch.zeros_like(anchor))
        g = torch.stack([anchor - w for w in flats]).mean(0)
        delta = bm * delta + blr * g
        w_g = anchor - delta
        start = w_g - bm * delta if nesterov else w_g
        state.update(anchor=start, delta=delta)
        return [start.clone() for _ in flats]

    return sync


def _initial():
    from _helpers import make_net

    return torch.cat([p.detach().reshape(-1) for p in make_net().parameters()])


@pytest.mark.parametrize("bm, blr, nesterov, warmup", [(0.5, 1.0, True, 0), (0.3, 1.2, False, 2)])
def test_every_rank_matches_reference_over_several_blocks(tmp_path, bm, blr, nesterov, warmup):
    """Each rank's parameters after every step equal a plain-torch BMUF over several blocks."""
    strategy = BMUFStrategy(period=3, block_momentum=bm, block_lr=blr, nesterov=nesterov, warmup_steps=warmup,
                            start_method="fork")
    fit(strategy, TinyRegression(), max_steps=11, callbacks=[SnapshotParams(tmp_path)])
    assert_matches_reference(tmp_path, reference_replicas(2, 11, _bmuf_reference(bm, blr, nesterov), 3, warmup), world=2)


def test_zero_momentum_unit_lr_equals_local_sgd():
    """BMUF(block_momentum=0, block_lr=1) ends exactly where LocalSGD with the same period does."""
    a, b = TinyRegression(), TinyRegression()
    fit(BMUFStrategy(period=3, block_momentum=0.0, block_lr=1.0, start_method="fork"), a, max_steps=9)
    fit(LocalSGDStrategy(period=3, start_method="fork"), b, max_steps=9)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


def test_default_block_momentum_resolves_against_world_size():
    """block_momentum=None becomes 1 - 1/world_size inside the run (0.5 for 2 ranks)."""
    from lightning.pytorch import Callback

    class Check(Callback):
        def on_train_end(self, trainer, pl_module):
            assert trainer.strategy.block_momentum == pytest.approx(0.5)

    fit(BMUFStrategy(period=2, start_method="fork"), TinyRegression(), max_steps=2, callbacks=[Check()])
