"""The batching and sampling options every data module in ``lightning_pdist.data`` shares."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

from lightning_pdist.data.sampling import RankBatchSampler, stratified_split


class UInt8ImageDataset(Dataset):
    """Images kept as uint8 ``(N, C, H, W)`` (a quarter of float32's memory), served as float32 in ``[0, 1]``."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        if images.dtype != torch.uint8 or images.ndim != 4:
            raise ValueError(
                f"UInt8ImageDataset(images={tuple(images.shape)} {images.dtype}): images must be uint8 (N, C, H, W)"
            )
        if len(labels) != len(images):
            raise ValueError(
                f"UInt8ImageDataset(labels={len(labels)}): labels must have one entry per image ({len(images)})"
            )
        self.images, self.labels = images, labels.to(torch.int64)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index].float().div_(255.0), self.labels[index]


class PdistDataModule(LightningDataModule, ABC):
    """In-memory map-style data with a seeded stratified train/val split and two training samplers.

    Subclasses implement :meth:`load`; this class splits, subsets and batches.

    *Default path* (``rank_batch_sizes=None`` and ``steps_per_epoch=None``): a shuffled ``DataLoader``;
    in a distributed run Lightning injects a ``DistributedSampler``, as for any Lightning data module.

    *Per-rank path* (``rank_batch_sizes`` or ``steps_per_epoch`` set): the train loader uses a
    :class:`~lightning_pdist.data.sampling.RankBatchSampler`, so every rank draws its own batch size from its
    own shard and all ranks take the same number of steps per epoch. Lightning 2.6 would try to inject a
    ``DistributedSampler`` into it (and fail), so a distributed run must use
    ``Trainer(use_distributed_sampler=False)``; :meth:`setup` raises otherwise. Validation and test loaders
    then get a non-shuffling ``DistributedSampler`` from this class instead of from Lightning.

    Args:
        batch_size: samples per training step on every rank (default path), and per evaluation batch.
        num_workers: ``DataLoader`` worker processes; 0 loads in the training process.
        val_fraction: share of each class of the training files held out for validation, in ``(0, 1)``.
        seed: seeds the split, ``train_subset``, the per-rank sampler and the default path's single-process
            shuffle (in a distributed run Lightning's ``DistributedSampler`` seeds from ``seed_everything``).
        train_subset: keep only this many (seeded, random) training samples; for fast tests and smoke runs.
        rank_batch_sizes: one training batch size per rank (length = ``trainer.world_size``, checked in
            :meth:`setup`); give faster workers larger batches.
        steps_per_epoch: training steps per epoch on every rank; ``None`` means
            ``ceil(len(train) / sum(rank_batch_sizes))``. Setting it without ``rank_batch_sizes`` uses
            ``batch_size`` on every rank.
    """

    num_classes: int = 10
    input_shape: tuple[int, ...] = ()

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
        super().__init__()
        name = type(self).__name__
        if batch_size < 1:
            raise ValueError(f"{name}(batch_size={batch_size}): batch_size must be >= 1")
        if num_workers < 0:
            raise ValueError(f"{name}(num_workers={num_workers}): num_workers must be >= 0")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"{name}(val_fraction={val_fraction}): val_fraction must be in (0, 1)")
        if seed < 0:
            raise ValueError(f"{name}(seed={seed}): seed must be >= 0")
        if train_subset is not None and train_subset < 1:
            raise ValueError(f"{name}(train_subset={train_subset}): train_subset must be >= 1 or None")
        if rank_batch_sizes is not None and (not rank_batch_sizes or any(b < 1 for b in rank_batch_sizes)):
            raise ValueError(
                f"{name}(rank_batch_sizes={rank_batch_sizes}): rank_batch_sizes must be a non-empty list of ints >= 1"
            )
        if steps_per_epoch is not None and steps_per_epoch < 1:
            raise ValueError(f"{name}(steps_per_epoch={steps_per_epoch}): steps_per_epoch must be >= 1 or None")
        self.batch_size, self.num_workers, self.val_fraction, self.seed = batch_size, num_workers, val_fraction, seed
        self.train_subset, self.steps_per_epoch = train_subset, steps_per_epoch
        self.rank_batch_sizes = list(rank_batch_sizes) if rank_batch_sizes is not None else None
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None
        self.save_hyperparameters()  # walks up to the subclass's __init__, so its own arguments are saved too

    @abstractmethod
    def load(self) -> tuple[Dataset, torch.Tensor, Dataset | None]:
        """Read the data: ``(train_dataset, train_labels (N,), test_dataset or None)``.

        ``train_dataset`` is split into train and validation by :meth:`setup`; without a test set,
        ``test_dataloader`` serves the validation split.
        """

    @property
    def per_rank(self) -> bool:
        """Whether the train loader uses :class:`RankBatchSampler` (``rank_batch_sizes`` or ``steps_per_epoch`` set)."""
        return self.rank_batch_sizes is not None or self.steps_per_epoch is not None

    def world(self) -> tuple[int, int]:
        """``(world_size, rank)`` from the attached Trainer, else the default process group, else ``(1, 0)``."""
        if self.trainer is not None:
            return self.trainer.world_size, self.trainer.global_rank
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(), dist.get_rank()
        return 1, 0

    def setup(self, stage: str | None = None) -> None:
        """Load and split the data once, and check the per-rank options against the run's world size."""
        name = type(self).__name__
        world_size, _ = self.world()
        if self.rank_batch_sizes is not None and len(self.rank_batch_sizes) != world_size:
            raise ValueError(
                f"{name}(rank_batch_sizes={self.rank_batch_sizes}): rank_batch_sizes needs one entry per rank, "
                f"got {len(self.rank_batch_sizes)} for world_size={world_size}"
            )
        if self.per_rank and self._lightning_injects_sampler():
            if self.rank_batch_sizes is not None:
                option = f"rank_batch_sizes={self.rank_batch_sizes}"
            else:
                option = f"steps_per_epoch={self.steps_per_epoch}"
            raise ValueError(
                f"{name}({option}): a per-rank RankBatchSampler needs Trainer(use_distributed_sampler=False) in a "
                "distributed run; with use_distributed_sampler=True Lightning tries to inject a DistributedSampler "
                "into it"
            )
        if self.train_set is not None:
            return
        full, labels, test = self.load()
        train_idx, val_idx = stratified_split(labels, self.val_fraction, self.seed)
        if self.train_subset is not None:
            if self.train_subset > len(train_idx):
                raise ValueError(
                    f"{name}(train_subset={self.train_subset}): train_subset must be <= the {len(train_idx)} "
                    "training samples"
                )
            g = torch.Generator().manual_seed(self.seed)
            train_idx = train_idx[torch.randperm(len(train_idx), generator=g)[: self.train_subset]].sort().values
        self.train_set = Subset(full, train_idx.tolist())
        self.val_set = Subset(full, val_idx.tolist())
        self.test_set = test if test is not None else self.val_set

    def _lightning_injects_sampler(self) -> bool:
        trainer = self.trainer
        if trainer is None:
            return False
        # Private in Lightning 2.6 (pinned <2.7); the same test as DataConnector._requires_distributed_sampler.
        connector = trainer._accelerator_connector
        return bool(connector.use_distributed_sampler and connector.is_distributed)

    def _loader(self, dataset: Dataset, **kwargs: Any) -> DataLoader:
        return DataLoader(dataset, num_workers=self.num_workers, persistent_workers=self.num_workers > 0, **kwargs)

    def _require_setup(self) -> None:
        if self.train_set is None:
            raise RuntimeError(f"{type(self).__name__}: call setup() (the Trainer does) before asking for a dataloader")

    def train_dataloader(self) -> DataLoader:
        """Shuffled batches of ``batch_size`` (default path) or this rank's :class:`RankBatchSampler` batches."""
        self._require_setup()
        if not self.per_rank:
            g = torch.Generator().manual_seed(self.seed)
            return self._loader(self.train_set, batch_size=self.batch_size, shuffle=True, generator=g)
        world_size, rank = self.world()
        batch_sizes = self.rank_batch_sizes or [self.batch_size] * world_size
        sampler = RankBatchSampler(len(self.train_set), batch_sizes, rank, self.seed, self.steps_per_epoch)
        return self._loader(self.train_set, batch_sampler=sampler)

    def _eval_loader(self, dataset: Dataset) -> DataLoader:
        world_size, rank = self.world()
        if self.per_rank and world_size > 1:
            # Lightning does not shard evaluation either when use_distributed_sampler=False; do what it would.
            sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
            return self._loader(dataset, batch_size=self.batch_size, sampler=sampler)
        return self._loader(dataset, batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        """The held-out split, in order."""
        self._require_setup()
        return self._eval_loader(self.val_set)

    def test_dataloader(self) -> DataLoader:
        """The test files where the dataset has them, else the validation split."""
        self._require_setup()
        return self._eval_loader(self.test_set)


class FileDataModule(PdistDataModule):
    """A data module read from the standard archive's files under ``data_dir``; nothing is downloaded.

    Subclasses implement :meth:`find_files` (where the files are, or ``FileNotFoundError`` naming what is missing),
    which :meth:`prepare_data` calls to fail early, and :meth:`load`. The other arguments are
    :class:`PdistDataModule`'s, with a tenth of the training files held out for validation by default.

    Args:
        data_dir: the folder holding the dataset's files (each subclass says where in it it looks).
    """

    def __init__(
        self,
        data_dir: str = "data",
        batch_size: int = 32,
        num_workers: int = 0,
        val_fraction: float = 0.1,
        seed: int = 0,
        train_subset: int | None = None,
        rank_batch_sizes: list[int] | None = None,
        steps_per_epoch: int | None = None,
    ):
        super().__init__(batch_size, num_workers, val_fraction, seed, train_subset, rank_batch_sizes, steps_per_epoch)
        self.data_dir = data_dir

    @abstractmethod
    def find_files(self) -> Any:
        """Where the dataset's files are under ``data_dir``; ``FileNotFoundError`` listing what is missing."""

    def prepare_data(self) -> None:
        """Fail early, on one process, when the files are missing."""
        self.find_files()
