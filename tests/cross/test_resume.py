"""Tier 3: a run stopped mid-period and resumed from its checkpoint ends where an uninterrupted run does."""

import pytest
import torch
from _helpers import SnapshotParams, TinyRegression, fit, load_snapshot
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_pdist import BMUFStrategy, EASGDStrategy, LocalSGDStrategy, PdistStrategy, SimuParallelSGDStrategy
from lightning_pdist.core import rank_files

from tests.conformance.strategies import STRATEGIES as COLUMNS

STRATEGIES = {
    "local_sgd": lambda: LocalSGDStrategy(period=2, warmup_steps=1, start_method="fork"),
    "simuparallel_sgd": lambda: SimuParallelSGDStrategy(start_method="fork"),
    "bmuf": lambda: BMUFStrategy(period=2, block_momentum=0.5, start_method="fork"),
    "easgd": lambda: EASGDStrategy(period=2, alpha=0.3, start_method="fork"),
    "pdist_ddp": lambda: PdistStrategy(start_method="fork"),
}
# The sign, parameter-server, pipeline and TP strategies resume exactly in their own suites (tests/<family>/) and
# in the conformance matrix, which runs every column of the one list (tests/conformance/strategies.py).
assert set(STRATEGIES) <= set(COLUMNS)


def _model():
    # 24 samples, 2 ranks, batch 4: 3 steps per epoch, so the epoch-end checkpoint (step 3) is mid-period.
    return TinyRegression(lr=0.05, momentum=0.9, n=24)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_resume_mid_period_is_exact(tmp_path, name):
    """Both ranks end with the uninterrupted run's parameters after resuming from step 3 of 8."""
    plain, ckpt_run, resumed = tmp_path / "plain", tmp_path / "ckpt", tmp_path / "resumed"
    for d in (plain, ckpt_run, resumed):
        d.mkdir()
    fit(STRATEGIES[name](), _model(), max_steps=8, callbacks=[SnapshotParams(plain)])
    # Saved at validation end (with the consensus model swapped in): Lightning 2.6 resumes such
    # checkpoints with the exact data order; train-epoch-end and mid-epoch ones replay other batches.
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=False)
    fit(STRATEGIES[name](), _model(), max_steps=8, callbacks=[SnapshotParams(ckpt_run), checkpoint],
        enable_checkpointing=True, limit_val_batches=1)
    first = tmp_path / "ckpts" / "epoch=0-step=3.ckpt"
    assert first.exists(), sorted(p.name for p in (tmp_path / "ckpts").iterdir())
    stored = torch.load(first, weights_only=False)
    assert stored["pdist"]["strategy"] == type(STRATEGIES[name]()).__name__
    fit(STRATEGIES[name](), _model(), max_steps=8, callbacks=[SnapshotParams(resumed)], ckpt_path=str(first),
        limit_val_batches=1)
    for rank in range(2):
        expected = load_snapshot(plain, rank, 8)
        torch.testing.assert_close(load_snapshot(ckpt_run, rank, 8), expected, atol=1e-6, rtol=0)
        torch.testing.assert_close(load_snapshot(resumed, rank, 8), expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(load_snapshot(resumed, 0, "final"), load_snapshot(plain, 0, "final"), atol=1e-6, rtol=0)


def test_checkpoint_state_dict_holds_the_consensus_model(tmp_path):
    """Mid-period, `state_dict` in the checkpoint is the average of the replicas (local SGD)."""
    snaps = tmp_path / "s"
    snaps.mkdir()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=True)
    fit(LocalSGDStrategy(period=2, start_method="fork"), _model(), max_steps=3, callbacks=[SnapshotParams(snaps), checkpoint],
        enable_checkpointing=True)
    stored = torch.load(tmp_path / "ckpts" / "epoch=0-step=3.ckpt", weights_only=False)
    flat = torch.cat([v.reshape(-1) for k, v in stored["state_dict"].items()])
    mean = (load_snapshot(snaps, 0, 3) + load_snapshot(snaps, 1, 3)) / 2
    torch.testing.assert_close(flat, mean, atol=1e-6, rtol=0)
    # Each rank's own replica is in its own file; the main file holds none of them.
    assert stored["pdist"]["rank_files"]["world_size"] == 2 and "replicas" not in stored["pdist"]
    for rank in range(2):
        own = torch.load(rank_files.path_for(tmp_path / "ckpts" / "epoch=0-step=3.ckpt", rank, 2), weights_only=False)
        torch.testing.assert_close(torch.cat([v.reshape(-1) for v in own["model"].values()]), load_snapshot(snaps, rank, 3))
