"""The default data: scikit-learn's bundled 8x8 digits, so nothing is ever downloaded (``pip install 'lightning_pdist[demo]'``)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, TensorDataset

from lightning_pdist.data.base import PdistDataModule
from lightning_pdist.extras import require


class DigitsDataModule(PdistDataModule):
    """scikit-learn's ``load_digits``: 1797 grey 8x8 images of the digits 0-9, shipped with scikit-learn.

    scikit-learn is optional (the ``demo`` extra); without it ``setup`` raises an ``ImportError`` saying so.

    Images are float32 ``(1, 8, 8)`` in ``[0, 1]`` (the raw values 0-16 divided by 16), labels int64.
    A small CNN reaches over 90% validation accuracy in a couple of CPU epochs, which makes this the
    default for recipes, tests and benchmarks. There is no separate test set: ``test_dataloader`` serves
    the validation split.

    Args:
        batch_size: see :class:`~lightning_pdist.data.base.PdistDataModule`, as are all the others.
        num_workers: ``DataLoader`` worker processes.
        val_fraction: share of each class held out for validation.
        seed: seeds the split and the sampling.
        train_subset: keep only this many training samples.
        rank_batch_sizes: one training batch size per rank.
        steps_per_epoch: training steps per epoch on every rank.
    """

    num_classes = 10
    input_shape = (1, 8, 8)

    def __init__(
        self,
        batch_size: int = 32,
        num_workers: int = 0,
        val_fraction: float = 0.2,
        seed: int = 0,
        train_subset: int | None = None,
        rank_batch_sizes: list[int] | None = None,
        steps_per_epoch: int | None = None,
    ):
        super().__init__(batch_size, num_workers, val_fraction, seed, train_subset, rank_batch_sizes, steps_per_epoch)

    def load(self) -> tuple[Dataset, torch.Tensor, Dataset | None]:
        """All 1797 digits as one dataset, and their labels; no test set."""
        datasets = require("sklearn.datasets", "demo", "DigitsDataModule (scikit-learn's bundled digits)")
        bunch = datasets.load_digits()
        images = torch.as_tensor(bunch.images, dtype=torch.float32).div_(16.0).unsqueeze(1)  # (1797, 1, 8, 8)
        labels = torch.as_tensor(bunch.target, dtype=torch.int64)  # (1797,)
        return TensorDataset(images, labels), labels, None
