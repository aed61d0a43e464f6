"""CIFAR10DataModule on tiny "python version" batch pickles written in the test."""

import pickle

import numpy as np
import pytest
import torch

from lightning_pdist.data import CIFAR10DataModule
from lightning_pdist.data.cifar10 import CIFAR10_TEST_FILE, CIFAR10_TRAIN_FILES, read_cifar_batch


def _write_batch(path, n, seed):
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
    batch = {b"data": data, b"labels": [i % 10 for i in range(n)], b"batch_label": b"x"}
    with open(path, "wb") as f:
        pickle.dump(batch, f)
    return batch


def _write_cifar(folder, n=20):
    folder.mkdir(parents=True, exist_ok=True)
    batches = {name: _write_batch(folder / name, n, seed) for seed, name in enumerate(CIFAR10_TRAIN_FILES)}
    batches[CIFAR10_TEST_FILE] = _write_batch(folder / CIFAR10_TEST_FILE, n, 99)
    return batches


def test_loads_the_six_batches(tmp_path):
    """Five training batches and the test batch load as float (3, 32, 32) in [0, 1], channel-major, with labels."""
    batches = _write_cifar(tmp_path / "cifar-10-batches-py")
    dm = CIFAR10DataModule(str(tmp_path), batch_size=8, val_fraction=0.2)
    dm.prepare_data()
    dm.setup("fit")
    assert len(dm.train_set) == 80 and len(dm.val_set) == 20 and len(dm.test_set) == 20
    x, y = dm.test_set[5]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and int(y) == 5
    raw = batches[CIFAR10_TEST_FILE][b"data"][5]
    torch.testing.assert_close(x[1, 0, :4], torch.from_numpy(raw[1024:1028]).float() / 255)  # green plane, row 0
    xb, yb = next(iter(dm.train_dataloader()))
    assert xb.shape == (8, 3, 32, 32) and yb.dtype == torch.int64


def test_accepts_the_batches_folder_itself(tmp_path):
    """data_dir may point at cifar-10-batches-py directly."""
    _write_cifar(tmp_path)
    dm = CIFAR10DataModule(str(tmp_path), val_fraction=0.2)
    dm.setup("fit")
    assert len(dm.test_set) == 20


def test_missing_batch_names_files_and_says_nothing_is_downloaded(tmp_path):
    """A missing batch file raises FileNotFoundError listing the files and folders and saying nothing is downloaded."""
    _write_cifar(tmp_path / "cifar-10-batches-py")
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").unlink()
    message = r"need \['data_batch_1', .*'test_batch'\] in one of .*Nothing is downloaded"
    with pytest.raises(FileNotFoundError, match=message):
        CIFAR10DataModule(str(tmp_path)).prepare_data()


def test_malformed_batch_raises(tmp_path):
    """A pickle without 3072-byte rows raises ValueError naming the file and the shapes."""
    with open(tmp_path / "b", "wb") as f:
        pickle.dump({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, f)
    with pytest.raises(ValueError, match=r"read_cifar_batch\(path='.*b'\): b'data' has shape \(2, 100\)"):
        read_cifar_batch(tmp_path / "b")
    with open(tmp_path / "c", "wb") as f:
        pickle.dump([1, 2], f)
    with pytest.raises(ValueError, match=r"expected a pickled dict with b'data' and b'labels'"):
        read_cifar_batch(tmp_path / "c")
