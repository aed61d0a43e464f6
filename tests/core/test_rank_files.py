"""Per-rank checkpoint files: written by each rank, named by the main file, removed with it, never gathered."""

from __future__ import annotations

import torch
from pathlib import Path

from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import StrategyRegistry
import pytest
from torch.multiprocessing import ProcessRaisedException

from lightning_pdist import LocalSGDStrategy
from lightning_pdist.core import rank_files
from _helpers import TinyRegression, fit


def test_round_trip_and_the_reasons_a_file_is_missing(tmp_path):
    path = tmp_path / "sub" / "a.ckpt"
    rank_files.save({"x": torch.arange(3)}, path, 1, 2)  # makes the folder (Lightning does so on rank 0 only)
    manifest = rank_files.manifest(path, 2)
    assert manifest == {"world_size": 2, "files": ["a.ckpt.pdist-rank0-of-2", "a.ckpt.pdist-rank1-of-2"]}
    state, why = rank_files.load_own(path, {"rank_files": manifest}, 1, 2)
    assert torch.equal(state["x"], torch.arange(3)) and why == ""
    assert rank_files.load_own(path, {"rank_files": manifest}, 0, 2) == (None, f"{path.parent / manifest['files'][0]} "
                                                                        "(rank 0's part of the checkpoint) does not exist")
    assert "saved by 2 ranks but world_size is 4" in rank_files.load_own(path, {"rank_files": manifest}, 1, 4)[1]
    rank_files.remove(path, 1, 2)
    rank_files.remove(path, 1, 2)  # nothing left: no error
    assert not rank_files.path_for(path, 1, 2).endswith(".ckpt")  # ModelCheckpoint's scans never pick them up


def test_top_k_removes_each_ranks_file_with_its_checkpoint(tmp_path):
    """save_top_k=1 keeps one checkpoint: the rank files of the replaced ones go with them."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_top_k=1, monitor="step", mode="max", every_n_train_steps=2)
    fit(LocalSGDStrategy(period=3, start_method="fork"), TinyRegression(), max_steps=6, callbacks=[checkpoint],
        enable_checkpointing=True)  # fmt: skip
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["epoch=0-step=6.ckpt", "epoch=0-step=6.ckpt.pdist-rank0-of-2", "epoch=0-step=6.ckpt.pdist-rank1-of-2"]


def test_find_unused_parameters_variants_are_registered_for_every_ddp_strategy():
    for name in ("pdist_ddp", "local_sgd", "simuparallel_sgd", "bmuf", "easgd", "signsgd_mv", "it_signsgd"):
        for suffix in ("", "_fork", "_spawn"):
            entry = StrategyRegistry[f"{name}{suffix}_find_unused_parameters_true"]
            assert entry["init_params"]["find_unused_parameters"] is True
    assert StrategyRegistry["it_signsgd_find_unused_parameters_true"]["init_params"]["aggregation"] == "llr"
    for name in ("parameter_server", "pipeline"):  # no DistributedDataParallel, no switch
        assert f"{name}_find_unused_parameters_true" not in StrategyRegistry


class _UnusedBranch(TinyRegression):
    def __init__(self):
        super().__init__()
        self.extra = torch.nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x) + (self.extra(x) if batch_idx % 2 else 0)
        return torch.nn.functional.mse_loss(out, y)


def test_the_unused_parameter_error_names_our_variant_not_plain_ddp():
    with pytest.raises(ProcessRaisedException, match=r"strategy='bmuf_find_unused_parameters_true' or "
                                                     r"strategy=BMUFStrategy\(..., find_unused_parameters=True\)"):
        fit("bmuf_fork", _UnusedBranch(), max_steps=3)
    trainer = fit("bmuf_fork_find_unused_parameters_true", _UnusedBranch(), max_steps=3)
    assert not torch.equal(trainer.lightning_module.extra.weight, _UnusedBranch().extra.weight)  # it trained


def test_a_missing_rank_file_sends_every_rank_back_to_the_consensus(tmp_path):
    """Rank 1's file deleted: both ranks warn and resume from the consensus (not rank 0 alone from its own)."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=3)
    fit(LocalSGDStrategy(period=4, start_method="fork"), TinyRegression(), max_steps=3, callbacks=[checkpoint],
        enable_checkpointing=True)  # fmt: skip
    path = tmp_path / "epoch=0-step=3.ckpt"
    consensus = torch.load(path, weights_only=False)["state_dict"]
    Path(rank_files.path_for(path, 1, 2)).unlink()
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    fit(LocalSGDStrategy(period=4, start_method="fork"), TinyRegression(), max_steps=4, ckpt_path=str(path),
        callbacks=[_StartWeights(snaps)])  # fmt: skip
    for rank in range(2):
        start = torch.load(snaps / f"rank{rank}.pt")
        torch.testing.assert_close(start, torch.cat([v.reshape(-1) for v in consensus.values()]))


class _StartWeights(Callback):
    def __init__(self, folder):
        self.folder = folder

    def on_train_start(self, trainer, pl_module):
        torch.save(torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()]), self.folder / f"rank{trainer.global_rank}.pt")
