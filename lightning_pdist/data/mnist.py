"""MNIST from local IDX files (raw or gzipped); nothing is downloaded."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_pdist.data.base import FileDataModule, UInt8ImageDataset

# IDX type codes (http://yann.lecun.com/exdb/mnist/, bottom of the page); data is big-endian.
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_GZIP_MAGIC = b"\x1f\x8b"

MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
# Where torchvision and common mirrors leave the files, relative to data_dir.
MNIST_SUBDIRS = (".", "MNIST/raw", "mnist", "MNIST", "raw")


def read_idx(path: str | Path) -> np.ndarray:
    """Read one IDX file (gzipped or not, told apart by its first bytes) into an array of its shape.

    Layout: two zero bytes, a type code, the number of dimensions ``d``, ``d`` big-endian uint32 sizes,
    then the data in row-major order.
    """
    raw = Path(path).read_bytes()
    if raw[:2] == _GZIP_MAGIC:
        raw = gzip.decompress(raw)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"read_idx(path='{path}'): not an IDX file (the header must be 0x00 0x00 <type code> <ndim>)")
    dtype, ndim = np.dtype(_IDX_DTYPES[raw[2]]), raw[3]
    shape = tuple(int(s) for s in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    offset = 4 + 4 * ndim
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(raw) - offset != expected:
        raise ValueError(
            f"read_idx(path='{path}'): header says shape {shape} ({expected} bytes) but the file holds "
            f"{len(raw) - offset}"
        )
    return np.frombuffer(raw, dtype=dtype, offset=offset).reshape(shape).astype(dtype.newbyteorder("="))


def find_mnist_files(data_dir: str | Path) -> dict[str, Path]:
    """Locate the four MNIST IDX files under ``data_dir`` (each raw or ``.gz``) in the usual subfolders.

    Raises:
        FileNotFoundError: listing every path looked at, when any file is missing.
    """
    data_dir = Path(data_dir)
    found, missing, looked = {}, [], []
    for key, stem in MNIST_FILES.items():
        candidates = [data_dir / sub / name for sub in MNIST_SUBDIRS for name in (stem, stem + ".gz")]
        hit = next((p for p in candidates if p.is_file()), None)
        if hit is None:
            missing.append(stem)
            looked += [str(p) for p in candidates]
        else:
            found[key] = hit
    if missing:
        raise FileNotFoundError(
            f"MNISTDataModule(data_dir='{data_dir}'): missing {missing} (raw or .gz); looked at {looked}. "
            "Nothing is downloaded: put the four MNIST IDX files in data_dir or data_dir/MNIST/raw."
        )
    return found


class MNISTDataModule(FileDataModule):
    """MNIST from the four standard IDX files under ``data_dir``: float32 ``(1, 28, 28)`` in ``[0, 1]``.

    The validation split is a seeded stratified ``val_fraction`` of the 60k training images; the 10k
    ``t10k`` images are the test set. Files are looked up in ``data_dir``, ``data_dir/MNIST/raw``
    (torchvision's layout), ``data_dir/mnist``, ``data_dir/MNIST`` and ``data_dir/raw``.

    The other arguments are :class:`~lightning_pdist.data.base.PdistDataModule`'s.

    Args:
        data_dir: folder holding the IDX files (or one of the subfolders above).
    """

    num_classes = 10
    input_shape = (1, 28, 28)

    def find_files(self) -> dict[str, Path]:
        return find_mnist_files(self.data_dir)

    def load(self) -> tuple[Dataset, torch.Tensor, Dataset | None]:
        """The training images and labels, and the ``t10k`` test set."""
        files = self.find_files()
        parts = []
        for split in ("train", "test"):
            images = torch.from_numpy(read_idx(files[f"{split}_images"]).copy())  # (N, 28, 28) uint8
            labels = torch.from_numpy(read_idx(files[f"{split}_labels"]).astype(np.int64))  # (N,)
            if images.ndim != 3 or images.dtype != torch.uint8 or len(images) != len(labels):
                raise ValueError(
                    f"MNISTDataModule(data_dir='{self.data_dir}'): {split} files hold images {tuple(images.shape)} "
                    f"{images.dtype} and {len(labels)} labels; expected uint8 (N, H, W) and N labels"
                )
            parts.append(UInt8ImageDataset(images.unsqueeze(1), labels))
        return parts[0], parts[0].labels, parts[1]
