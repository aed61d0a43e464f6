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

import errno
import os
import shutil
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
    except BaseException as err:
        written = temporary.stat().st_size if temporary.exists() else 0
        temporary.unlink(missing_ok=True)
        full = _full_disk(err, target.parent, written)
        if full is not None:
            raise full from err
        raise


def _full_disk(err: BaseException, folder: Path, written: int) -> OSError | None:
    """An ``OSError(ENOSPC)`` that says so when the save failed for lack of space, else None.

    On a full disk torch's zip writer fails with an opaque ``RuntimeError`` ("enforce fail at inline_container.cc
    ... unexpected pos"): the free space after removing the partial file tells what happened.
    """
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        free = shutil.disk_usage(folder).free
    elif isinstance(err, (OSError, RuntimeError)):
        free = shutil.disk_usage(folder).free
        if free > max(written, 1 << 20):  # room enough for what was written: not a full disk
            return None
    else:
        return None
    return OSError(errno.ENOSPC, f"No space left on device: the checkpoint could not be written to {folder} "
                                 f"({written:,} bytes written before it failed, {free:,} free now); the previous "
                                 "checkpoint there, if any, is intact")  # fmt: skip


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` whose saves go through :func:`safe_save`."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or not _is_local(path):  # Lightning's refusal / Lightning's remote write
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        safe_save(checkpoint, path)
