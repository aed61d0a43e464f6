"""MNISTDataModule and read_idx on tiny IDX files written in the test, gzipped and raw."""

import gzip

import numpy as np
import pytest
import torch

from _helpers import idx_bytes, write_mnist

from lightning_pdist.data import MNISTDataModule
from lightning_pdist.data.mnist import read_idx


@pytest.mark.parametrize("gz", [True, False])
def test_read_idx_round_trips(tmp_path, gz):
    """A uint8 IDX file reads back to the same array, gzipped or raw."""
    array = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    data = idx_bytes(array)
    path = tmp_path / "x"
    path.write_bytes(gzip.compress(data) if gz else data)
    np.testing.assert_array_equal(read_idx(path), array)


def test_read_idx_reads_big_endian_ints(tmp_path):
    """Multi-byte IDX types are decoded from big-endian into native values."""
    array = np.array([1, -2, 70000], dtype=np.int32)
    (tmp_path / "x").write_bytes(idx_bytes(array, type_code=0x0C))
    np.testing.assert_array_equal(read_idx(tmp_path / "x"), array)


def test_read_idx_rejects_non_idx_and_truncated_files(tmp_path):
    """A wrong header or a size that disagrees with it raises ValueError naming the file."""
    (tmp_path / "bad").write_bytes(b"PK\x03\x04junk")
    with pytest.raises(ValueError, match=r"read_idx\(path='.*bad'\): not an IDX file"):
        read_idx(tmp_path / "bad")
    (tmp_path / "short").write_bytes(idx_bytes(np.zeros((2, 3), np.uint8))[:-1])
    with pytest.raises(ValueError, match=r"header says shape \(2, 3\) \(6 bytes\) but the file holds 5"):
        read_idx(tmp_path / "short")


@pytest.mark.parametrize("gz", [True, False])
def test_loads_gz_and_raw_files(tmp_path, gz):
    """The module loads the four files, gzipped or raw, as float (1, 28, 28) in [0, 1] with the right labels."""
    arrays = write_mnist(tmp_path, gz=gz)
    dm = MNISTDataModule(str(tmp_path), batch_size=4, val_fraction=0.25)
    dm.prepare_data()
    dm.setup("fit")
    assert len(dm.train_set) == 30 and len(dm.val_set) == 10 and len(dm.test_set) == 20
    x, y = dm.test_set[3]
    assert x.shape == (1, 28, 28) and x.dtype == torch.float32 and y.dtype == torch.int64
    torch.testing.assert_close(x[0], torch.from_numpy(arrays["test_images"][3]).float() / 255)
    assert int(y) == 3
    xb, yb = next(iter(dm.train_dataloader()))
    assert xb.shape == (4, 1, 28, 28) and 0.0 <= xb.min() and xb.max() <= 1.0


def test_finds_files_in_torchvision_layout(tmp_path):
    """Files under data_dir/MNIST/raw (torchvision's layout) are found."""
    write_mnist(tmp_path / "MNIST" / "raw", gz=False)
    dm = MNISTDataModule(str(tmp_path), val_fraction=0.25)
    dm.setup("fit")
    assert len(dm.test_set) == 20


def test_missing_files_name_every_path_and_say_nothing_is_downloaded(tmp_path):
    """Missing files raise FileNotFoundError listing the missing names, the paths looked at, and no download."""
    write_mnist(tmp_path, gz=True)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    dm = MNISTDataModule(str(tmp_path))
    with pytest.raises(FileNotFoundError) as info:
        dm.prepare_data()
    message = str(info.value)
    assert "missing ['t10k-labels-idx1-ubyte']" in message and "Nothing is downloaded" in message
    assert str(tmp_path / "MNIST" / "raw" / "t10k-labels-idx1-ubyte.gz") in message


def test_mismatched_image_and_label_counts_raise(tmp_path):
    """Label and image files of different lengths raise ValueError naming both sizes."""
    write_mnist(tmp_path, gz=False)
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(idx_bytes(np.zeros(3, np.uint8)))
    with pytest.raises(ValueError, match=r"test files hold images \(20, 28, 28\) torch.uint8 and 3 labels"):
        MNISTDataModule(str(tmp_path), val_fraction=0.25).setup("fit")
