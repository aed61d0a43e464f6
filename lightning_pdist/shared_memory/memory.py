"""The module's tensors in memory every Hogwild! process maps, and the process lock of the locking baseline.

Sharing: rank 0 writes the parameters and float buffers, one flat segment per dtype, into a file in ``/dev/shm``
(a RAM file system) named for this run; every process maps the file ``MAP_SHARED`` (``torch.from_file(shared=True)``)
and points each tensor's ``.data`` at its slice, so all processes hold the *same* memory: an optimizer step in one
process is seen by every other at once, with no message. Once every process has mapped it, rank 0 unlinks the file:
the memory lives while a mapping does and is freed with the last one, even after a crash. This is what
``Tensor.share_memory_()`` does before a ``fork`` (``torch.multiprocessing``'s Hogwild example), made independent of
how the processes were started: Lightning's ``popen`` launcher (ranks re-run the script), ``fork``/``spawn`` and
torchrun all work, because the mapping happens after the processes exist. It needs one machine (one RAM).

Locking baseline: :class:`ProcessLock` is an ``flock`` on a file next to the segments, held around each step.

Never imports Lightning.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

__all__ = ["ProcessLock", "SharedTensors", "shm_directory"]


def shm_directory() -> Path:
    """``/dev/shm`` where it exists (Linux), else the temporary directory."""
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


class SharedTensors:
    """``tensors`` (in a fixed order, the same on every process) backed by one shared mapping per dtype."""

    def __init__(self, tensors: list[Tensor], run: str):
        self.tensors = tensors
        self.run = run
        self.dtypes = sorted({str(t.dtype) for t in tensors})
        self._private = [t.data for t in tensors]  # what each tensor held before (dropped once mapped)

    @staticmethod
    def new_run() -> str:
        return f"pdist-hogwild-{os.getpid()}-{uuid.uuid4().hex[:12]}"

    def path(self, dtype: str) -> Path:
        return shm_directory() / f"{self.run}-{dtype.replace('torch.', '')}"

    def _group(self, dtype: str) -> list[Tensor]:
        return [t for t in self.tensors if str(t.dtype) == dtype]

    def create(self) -> None:
        """Rank 0: write every tensor's current value into the run's files (before any process maps them)."""
        for dtype in self.dtypes:
            group = self._group(dtype)
            numel = sum(t.numel() for t in group)
            path = self.path(dtype)
            with open(path, "wb") as f:
                f.truncate(max(numel, 1) * group[0].element_size())
            flat = torch.from_file(str(path), shared=True, size=max(numel, 1), dtype=group[0].dtype)
            offset = 0
            for t in group:
                flat[offset : offset + t.numel()].copy_(t.detach().reshape(-1))
                offset += t.numel()

    def attach(self) -> None:
        """Every process: map the files and point each tensor at its slice (its own values are replaced by rank 0's).

        Raises:
            RuntimeError: the file is not there (this process runs on another machine than rank 0).
        """
        for dtype in self.dtypes:
            group, path = self._group(dtype), self.path(dtype)
            if not path.exists():
                raise RuntimeError(f"HogwildStrategy: {path} (rank 0's shared parameters) does not exist in this "
                                   f"process (pid {os.getpid()}); Hogwild! needs every process on rank 0's machine")  # fmt: skip
            numel = sum(t.numel() for t in group)
            flat = torch.from_file(str(path), shared=True, size=max(numel, 1), dtype=group[0].dtype)
            offset = 0
            for t in group:
                t.data = flat[offset : offset + t.numel()].view(t.shape)
                offset += t.numel()
        self._private = []

    def unlink(self) -> None:
        """Rank 0, after every process attached: remove the names (the memory stays while mapped)."""
        for dtype in self.dtypes:
            self.path(dtype).unlink(missing_ok=True)

    def detach(self) -> None:
        """Give every tensor a private copy of its current (shared) value: the mapping is released with the views."""
        for t in self.tensors:
            if t.data.is_shared():
                t.data = t.data.clone()

    def shared(self) -> bool:
        return all(t.data.is_shared() for t in self.tensors)


class ProcessLock:
    """An exclusive ``flock`` every process of the run takes around its optimizer step (the locking baseline)."""

    def __init__(self, run: str):
        self.path = shm_directory() / f"{run}-lock"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> "ProcessLock":
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def share(tensors: list[Tensor], lock: bool, rank: int, broadcast: Callable[[Any], Any],
          barrier: Callable[[], None]) -> tuple[SharedTensors, ProcessLock | None]:
    """Rank 0's ``tensors`` into one shared mapping that every process maps in place (and, with ``lock``, the run's
    lock file); the names are unlinked once every process holds them, so nothing is left behind. Collective:
    ``broadcast``/``barrier`` are the caller's (a Trainer's or Fabric's strategy)."""
    run = broadcast(SharedTensors.new_run() if rank == 0 else None)
    shared = SharedTensors(tensors, run)
    if rank == 0:
        shared.create()
    barrier()
    shared.attach()
    process_lock = ProcessLock(run) if lock else None
    barrier()  # every process mapped the memory and opened the lock: the names can go
    if rank == 0:
        shared.unlink()
        if process_lock is not None:
            process_lock.unlink()
    return shared, process_lock


def release(shared: SharedTensors | None, lock: ProcessLock | None) -> None:
    """The end of :func:`share`: this process keeps a private copy of the weights and closes the lock."""
    if shared is not None:
        shared.detach()
    if lock is not None:
        lock.close()
