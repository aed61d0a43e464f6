"""A checkpoint save that fails half-way leaves the previous file intact (no space left on device)."""

from __future__ import annotations

import errno

import pytest
import torch

from lightning_pdist import LocalSGDStrategy
from lightning_pdist.core import safe_io
from lightning_pdist.core.safe_io import SafeCheckpointIO, safe_save


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


def test_a_real_full_filesystem_keeps_the_previous_checkpoint(tmp_path):
    """On a 1 MiB tmpfs: a 400 kB checkpoint fits, a second save of 800 kB hits ENOSPC; the first file is intact and
    no temporary is left (the temporary is written beside the target, on the same filesystem)."""
    import subprocess

    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {made.stderr.strip()}")
    try:
        path = mount / "last.ckpt"
        SafeCheckpointIO().save_checkpoint({"w": torch.ones(100_000)}, path)
        # torch's zip writer fails with an opaque RuntimeError on a full disk; the user gets ENOSPC, said plainly
        with pytest.raises(OSError, match=r"No space left on device: the checkpoint could not be written to .*the "
                                          r"previous checkpoint there, if any, is intact") as failure:  # fmt: skip
            SafeCheckpointIO().save_checkpoint({"w": torch.ones(200_000)}, path)
        assert failure.value.errno == errno.ENOSPC
        assert torch.load(path)["w"].numel() == 100_000
        assert sorted(p.name for p in mount.iterdir()) == ["last.ckpt"]
    finally:
        subprocess.run(["umount", str(mount)], check=False)
