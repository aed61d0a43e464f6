"""Checkpoint writes that never destroy the previous file: temporary file in the same folder, fsync, rename.

Lightning's ``_atomic_save`` (through fsspec's local transaction) writes the new checkpoint to a file
made by ``tempfile.mkstemp()`` (usually ``/tmp``) and moves it over the target. When ``/tmp`` is on
another filesystem the move is a copy into the target itself, so a save that fails half-way ("No
space left on device") leaves the target truncated: the previous ``last.ckpt`` is gone and the new
one is not there. Here, for local paths, the bytes go to ``{path}.tmp-{pid}`` next to the target,
are flushed to disk, and ``os.replace`` swaps them in (atomic on one filesystem); any failure removes
the temporary file and leaves the target as it was. It also streams ``torch.save`` into the file
instead of building the whole checkpoint in memory first. Remote paths (``s3://`` ...) keep
Lightning's write.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import _atomic_save, get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

__all__ = ["SafeCheckpointIO", "safe_save"]


def _is_local(path: Any) -> bool:
    return "://" not in str(path) or str(path).startswith("file://")


def safe_save(obj: Any, path: Any) -> None:
    """``torch.save(obj, path)`` such that ``path`` holds either its old content or the complete new one.

    Makes the folder first (Lightning makes it on rank 0 only, and rank files are written on every rank).
    """
    if not _is_local(path):
        fs = get_filesystem(path)
        fs.makedirs(os.path.dirname(str(path)), exist_ok=True)
        _atomic_save(obj, path)
        return
    target = Path(str(path).removeprefix("file://"))
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` whose saves go through :func:`safe_save`."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or not _is_local(path):  # Lightning's refusal / Lightning's remote write
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        safe_save(checkpoint, path)
