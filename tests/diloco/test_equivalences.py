"""Tier 3: DiLoCo's degenerate cases against their baselines in real 2-rank runs, and against plain torch."""

import torch
from _diloco_reference import diloco_reference, heavy_ball
from _helpers import SnapshotParams, TinyRegression, fit, load_snapshot

from lightning_pdist import BMUFStrategy, DiLoCoStrategy, LocalSGDStrategy, PdistStrategy


def _params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_h1_outer_sgd_lr1_equals_pdist_ddp():
    """H=1, outer SGD(lr=1, momentum=0), inner SGD: every step is the synchronous DDP step."""
    a, b = TinyRegression(), TinyRegression()
    fit(PdistStrategy(start_method="fork"), a, max_steps=8)
    fit(DiLoCoStrategy(sync_every=1, outer_optimizer="sgd", outer_lr=1.0, outer_momentum=0.0, start_method="fork"), b,
        max_steps=8)  # fmt: skip
    torch.testing.assert_close(_params(b), _params(a), atol=1e-6, rtol=0)


def test_outer_sgd_lr1_equals_local_sgd_period_h(tmp_path):
    """Outer SGD(lr=1, momentum=0) with H=3 equals local SGD with period 3, every replica after every step."""
    snaps = {k: tmp_path / k for k in ("diloco", "local")}
    for d in snaps.values():
        d.mkdir()
    fit(DiLoCoStrategy(sync_every=3, outer_optimizer="sgd", outer_lr=1.0, outer_momentum=0.0, start_method="fork"),
        TinyRegression(momentum=0.5), max_steps=9, callbacks=[SnapshotParams(snaps["diloco"])])  # fmt: skip
    fit(LocalSGDStrategy(period=3, start_method="fork"), TinyRegression(momentum=0.5), max_steps=9,
        callbacks=[SnapshotParams(snaps["local"])])  # fmt: skip
    for t in range(1, 10):
        for r in range(2):
            torch.testing.assert_close(load_snapshot(snaps["diloco"], r, t), load_snapshot(snaps["local"], r, t),
                                       atol=1e-6, rtol=0)  # fmt: skip


def test_heavy_ball_outer_step_equals_bmuf_block_momentum(tmp_path):
    """Outer SGD(lr=ζ, momentum=η) (no Nesterov) is BMUF(block_lr=ζ, block_momentum=η, nesterov=False), round for
    round (the card's "where they coincide"); both equal the plain-torch DiLoCo."""
    snaps = {k: tmp_path / k for k in ("diloco", "bmuf")}
    for d in snaps.values():
        d.mkdir()
    fit(DiLoCoStrategy(sync_every=3, outer_optimizer="sgd", outer_lr=0.8, outer_momentum=0.5, start_method="fork"),
        TinyRegression(), max_steps=9, callbacks=[SnapshotParams(snaps["diloco"])])  # fmt: skip
    fit(BMUFStrategy(period=3, block_momentum=0.5, block_lr=0.8, nesterov=False, start_method="fork"), TinyRegression(),
        max_steps=9, callbacks=[SnapshotParams(snaps["bmuf"])])  # fmt: skip
    history, _ = diloco_reference(2, 9, H=3, outer=heavy_ball(0.8, 0.5))
    for t in range(1, 10):
        for r in range(2):
            torch.testing.assert_close(load_snapshot(snaps["diloco"], r, t), history[t][r], atol=1e-6, rtol=0)
            torch.testing.assert_close(load_snapshot(snaps["bmuf"], r, t), history[t][r], atol=1e-6, rtol=0)
