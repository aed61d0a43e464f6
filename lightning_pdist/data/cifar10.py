"""CIFAR-10 from the local "python version" pickles; nothing is downloaded."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_pdist.data.base import FileDataModule, UInt8ImageDataset

CIFAR10_FOLDER = "cifar-10-batches-py"
CIFAR10_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST_FILE = "test_batch"


def read_cifar_batch(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR "python version" batch: ``(images uint8 (N, 3, 32, 32), labels int64 (N,))``.

    The file is a pickle of a dict with ``b"data"`` (uint8 ``(N, 3072)``, channel-major rows: 1024 red,
    1024 green, 1024 blue) and ``b"labels"`` (N ints). Unpickling runs code the file names: only load
    files you trust.
    """
    with open(path, "rb") as f:
        batch = pickle.load(f, encoding="bytes")
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise ValueError(f"read_cifar_batch(path='{path}'): expected a pickled dict with b'data' and b'labels'")
    data = np.asarray(batch[b"data"], dtype=np.uint8)
    labels = np.asarray(batch[b"labels"], dtype=np.int64)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(data) != len(labels):
        raise ValueError(
            f"read_cifar_batch(path='{path}'): b'data' has shape {data.shape} and b'labels' {len(labels)} entries; "
            "expected (N, 3072) and N"
        )
    return data.reshape(-1, 3, 32, 32), labels


def find_cifar10_dir(data_dir: str | Path) -> Path:
    """The folder holding the six batch files: ``data_dir/cifar-10-batches-py`` or ``data_dir`` itself.

    Raises:
        FileNotFoundError: listing the files looked for and where, when any is missing.
    """
    data_dir = Path(data_dir)
    names = (*CIFAR10_TRAIN_FILES, CIFAR10_TEST_FILE)
    candidates = (data_dir / CIFAR10_FOLDER, data_dir)
    for folder in candidates:
        if all((folder / name).is_file() for name in names):
            return folder
    raise FileNotFoundError(
        f"CIFAR10DataModule(data_dir='{data_dir}'): need {list(names)} in one of {[str(c) for c in candidates]}. "
        "Nothing is downloaded: extract cifar-10-python.tar.gz into data_dir."
    )


class CIFAR10DataModule(FileDataModule):
    """CIFAR-10 from ``data_dir/cifar-10-batches-py``: float32 ``(3, 32, 32)`` in ``[0, 1]``, 10 classes.

    The validation split is a seeded stratified ``val_fraction`` of the 50k training images;
    ``test_batch`` is the test set. No augmentation and no normalization: the data is for comparing
    distributed algorithms against each other, not for chasing accuracy.

    The other arguments are :class:`~lightning_pdist.data.base.PdistDataModule`'s.

    Args:
        data_dir: folder holding ``cifar-10-batches-py`` (or the batch files themselves).
    """

    num_classes = 10
    input_shape = (3, 32, 32)

    def find_files(self) -> Path:
        return find_cifar10_dir(self.data_dir)

    def load(self) -> tuple[Dataset, torch.Tensor, Dataset | None]:
        """The five training batches joined, and the test batch."""
        folder = self.find_files()
        train = [read_cifar_batch(folder / name) for name in CIFAR10_TRAIN_FILES]
        images = torch.from_numpy(np.concatenate([x for x, _ in train]))  # (50000, 3, 32, 32) uint8
        labels = torch.from_numpy(np.concatenate([y for _, y in train]))  # (50000,)
        test_images, test_labels = read_cifar_batch(folder / CIFAR10_TEST_FILE)
        test = UInt8ImageDataset(torch.from_numpy(test_images), torch.from_numpy(test_labels))
        return UInt8ImageDataset(images, labels), labels, test
