"""Data modules (bundled digits, and local MNIST, CIFAR-10 and IMDB files) and per-rank sampling.

Nothing here downloads: ``DigitsDataModule`` uses the copy shipped with scikit-learn, the others read
the standard archives' files from ``data_dir``.
"""

from lightning_pdist.data.base import FileDataModule, PdistDataModule, UInt8ImageDataset
from lightning_pdist.data.cifar10 import CIFAR10DataModule
from lightning_pdist.data.digits import DigitsDataModule
from lightning_pdist.data.imdb import IMDBDataModule
from lightning_pdist.data.mnist import MNISTDataModule
from lightning_pdist.data.sampling import RankBatchSampler, RankShardSampler, stratified_split

__all__ = [
    "CIFAR10DataModule",
    "DigitsDataModule",
    "FileDataModule",
    "IMDBDataModule",
    "MNISTDataModule",
    "PdistDataModule",
    "RankBatchSampler",
    "RankShardSampler",
    "UInt8ImageDataset",
    "stratified_split",
]
