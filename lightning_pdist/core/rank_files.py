"""Per-rank checkpoint files: the state only one rank holds, written by that rank next to the checkpoint.

An averaging strategy's replicas or a sign vote's residuals differ per rank, and an exact resume
needs every rank's own. Gathering them (``all_gather_object``) made every rank hold ``N`` copies
of model and optimizer at save time and grew the checkpoint with ``N``. Instead, for a checkpoint
``path`` and world size ``N``, rank ``r`` writes its own state to::

    {path}.pdist-rank{r}-of-{N}

(:func:`~lightning_pdist.core.safe_io.safe_save`: a partly written file never replaces a good one)
and the main file records their names under ``checkpoint["pdist"]["rank_files"]``. Memory at save
time is one rank's state whatever ``N`` is, the main file is the size of a plain DDP checkpoint, and
``LightningModule.load_from_checkpoint`` reads the main file alone. The names do not end in
``.ckpt``, so ``ModelCheckpoint``'s scans never mistake them for checkpoints; the strategy's
``remove_checkpoint`` deletes them with the main file. Resuming needs the files where the main file
is and the same world size; otherwise the strategy warns and resumes every rank from the consensus.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
import torch.distributed as dist
from lightning.fabric.utilities.cloud_io import get_filesystem

from lightning_pdist.core.safe_io import safe_save

__all__ = ["agree_on_rank_state", "load_own", "manifest", "path_for", "remove", "save", "save_rank_files"]


def path_for(checkpoint_path: Any, rank: int, world_size: int) -> str:
    """Where rank ``rank`` of ``world_size`` keeps its state for the checkpoint at ``checkpoint_path``."""
    return f"{checkpoint_path}.pdist-rank{rank}-of-{world_size}"


def manifest(checkpoint_path: Any, world_size: int) -> dict:
    """What the main file records: the world size and every rank's file name (relative to the main file)."""
    return {"world_size": world_size, "files": [os.path.basename(path_for(checkpoint_path, r, world_size))
                                                for r in range(world_size)]}  # fmt: skip


def save(state: dict, checkpoint_path: Any, rank: int, world_size: int) -> None:
    """Write this rank's ``state`` (atomically: an interrupted save leaves any older file intact)."""
    safe_save(state, path_for(checkpoint_path, rank, world_size))


def remove(checkpoint_path: Any, rank: int, world_size: int) -> None:
    """Delete this rank's file for ``checkpoint_path`` if there is one."""
    path = path_for(checkpoint_path, rank, world_size)
    fs = get_filesystem(path)
    if fs.exists(path):
        fs.rm(path)


def load_own(checkpoint_path: Any, pdist_state: dict | None, rank: int, world_size: int) -> tuple[dict | None, str]:
    """This rank's state for the checkpoint, or ``(None, why not)``."""
    entry = (pdist_state or {}).get("rank_files")
    if entry is None:
        return None, "the checkpoint names no per-rank files (it was saved after fit ended, or by another strategy)"
    if entry["world_size"] != world_size:
        return None, f"the checkpoint was saved by {entry['world_size']} ranks but world_size is {world_size}"
    path = os.path.join(os.path.dirname(str(checkpoint_path)), entry["files"][rank])
    fs = get_filesystem(path)
    if not fs.exists(path):
        return None, f"{path} (rank {rank}'s part of the checkpoint) does not exist"
    with fs.open(path, "rb") as f:
        return torch.load(f, map_location="cpu", weights_only=False), ""


def save_rank_files(own: dict | None, checkpoint_path: Any, pdist_state: dict, rank: int, world_size: int,
                    barrier: Callable[[], None]) -> None:
    """Write this rank's ``own`` state (None on every rank: nothing to write) and name every rank's file in
    ``pdist_state["rank_files"]``; ``barrier`` (every rank) makes every file exist before the main file names them."""
    if own is None:
        return
    save(own, checkpoint_path, rank, world_size)
    pdist_state["rank_files"] = manifest(checkpoint_path, world_size)
    barrier()


def agree_on_rank_state(own: dict | None, reason: str, rank: int, world_size: int,
                        device: Any = None) -> tuple[dict | None, str]:
    """This rank's loaded state, or None on every rank when any rank lacks its file (one collective).

    ``reason`` says why ``own`` is None; when another rank lacks its file, the reason names that rank.
    """
    if world_size == 1:
        return own, reason
    missing = torch.tensor([0 if own is not None else 1 + rank], dtype=torch.int64, device=device)
    dist.all_reduce(missing, op=dist.ReduceOp.MAX)
    if own is not None and missing.item():
        return None, f"rank {missing.item() - 1} has no part of this checkpoint, so no rank resumes its own"
    return own, reason
