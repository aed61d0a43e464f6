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

    The arguments are :class:`~lightning_pdist.data.base.PdistDataModule`'s.
    """

    num_classes = 10
    input_shape = (1, 8, 8)

    def load(self) -> tuple[Dataset, torch.Tensor, Dataset | None]:
        """All 1797 digits as one dataset, and their labels; no test set."""
        datasets = require("sklearn.datasets", "demo", "DigitsDataModule (scikit-learn's bundled digits)")
        bunch = datasets.load_digits()
        images = torch.as_tensor(bunch.images, dtype=torch.float32).div_(16.0).unsqueeze(1)  # (1797, 1, 8, 8)
        labels = torch.as_tensor(bunch.target, dtype=torch.int64)  # (1797,)
        return TensorDataset(images, labels), labels, None
