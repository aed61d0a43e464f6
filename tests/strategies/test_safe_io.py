"""A checkpoint save that fails half-way leaves the previous file intact (no space left on device)."""

from __future__ import annotations

import errno

import pytest
import torch

from lightning_pdist import LocalSGDStrategy
from lightning_pdist.strategies import safe_io
from lightning_pdist.strategies.safe_io import SafeCheckpointIO, safe_save


def test_a_failed_save_keeps_the_previous_checkpoint_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    safe_save({"step": 1, "w": torch.ones(3)}, path)

    def disk_full(obj, f):
        f.write(b"half a checkpoint")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safe_io.torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left on device"):
        SafeCheckpointIO().save_checkpoint({"step": 2}, path)
    monkeypatch.undo()
    assert torch.load(path)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_a_save_replaces_the_file_and_makes_its_folder(tmp_path):
    path = tmp_path / "a" / "b.ckpt"
    SafeCheckpointIO().save_checkpoint({"step": 1}, path)
    SafeCheckpointIO().save_checkpoint({"step": 2}, path)
    assert torch.load(path)["step"] == 2


def test_every_pdist_strategy_saves_through_it_unless_the_user_gives_a_plugin():
    assert isinstance(LocalSGDStrategy().checkpoint_io, SafeCheckpointIO)
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    mine = TorchCheckpointIO()
    assert LocalSGDStrategy(checkpoint_io=mine).checkpoint_io is mine
