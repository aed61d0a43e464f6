"""DigitsDataModule: the bundled data, its seeded split, and both training samplers (with and without a Trainer)."""

import json
import os
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DistributedSampler

from lightning_pdist.data import DigitsDataModule, RankBatchSampler
from lightning_pdist.models import ClassifierModule


def _fake_trainer(world_size: int, rank: int, use_distributed_sampler: bool = False) -> SimpleNamespace:
    connector = SimpleNamespace(use_distributed_sampler=use_distributed_sampler, is_distributed=world_size > 1)
    return SimpleNamespace(world_size=world_size, global_rank=rank, _accelerator_connector=connector)


def _on_rank(dm: DigitsDataModule, world_size: int, rank: int, use_distributed_sampler: bool = False):
    dm.trainer = _fake_trainer(world_size, rank, use_distributed_sampler)
    dm.setup("fit")
    return dm


def test_images_are_float_unit_range_and_labels_int64():
    """All 1797 digits load as float32 (1, 8, 8) in [0, 1] with int64 labels 0-9."""
    dm = DigitsDataModule()
    dm.setup("fit")
    assert len(dm.train_set) + len(dm.val_set) == 1797
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (32, 1, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
    images = torch.stack([dm.train_set[i][0] for i in range(len(dm.train_set))])
    assert images.min() == 0.0 and images.max() == 1.0
    assert dm.input_shape == (1, 8, 8) and dm.num_classes == 10


def test_split_is_stratified_and_seeded():
    """The validation split holds ~20% of every class, is the same for the same seed, and differs for another."""
    dm, same, other = DigitsDataModule(), DigitsDataModule(), DigitsDataModule(seed=1)
    for m in (dm, same, other):
        m.setup("fit")
    labels = torch.tensor([int(dm.val_set.dataset[i][1]) for i in dm.val_set.indices])
    all_labels = dm.val_set.dataset.tensors[1]
    for c in range(10):
        assert int((labels == c).sum()) == round(0.2 * int((all_labels == c).sum()))
    assert dm.val_set.indices == same.val_set.indices != other.val_set.indices
    assert not set(dm.val_set.indices) & set(dm.train_set.indices)


def test_default_path_is_a_plain_shuffled_loader_for_lightning_to_shard():
    """Without per-rank options the train loader is an ordinary shuffled DataLoader of batch_size."""
    dm = DigitsDataModule(batch_size=50)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert loader.batch_sampler.batch_size == 50 and not isinstance(loader.batch_sampler, RankBatchSampler)
    assert len(loader) == -(-len(dm.train_set) // 50)
    assert dm.val_dataloader().sampler.__class__.__name__ == "SequentialSampler"


def test_train_subset_keeps_a_seeded_subset():
    """train_subset keeps that many training samples, the same ones for the same seed, and leaves val alone."""
    a, b = DigitsDataModule(train_subset=100), DigitsDataModule(train_subset=100)
    a.setup(), b.setup()
    assert len(a.train_set) == 100 and a.train_set.indices == b.train_set.indices
    assert len(a.val_set) == 359


def test_rank_batch_sizes_give_each_rank_its_batch_and_equal_steps():
    """With rank_batch_sizes each rank's loader yields its own batch size, all for the same number of steps."""
    loaders = [_on_rank(DigitsDataModule(rank_batch_sizes=[8, 24]), 2, r).train_dataloader() for r in range(2)]
    assert [len(dl) for dl in loaders] == [-(-1438 // 32)] * 2
    assert [len(next(iter(dl))[0]) for dl in loaders] == [8, 24]


def test_per_rank_eval_loaders_are_sharded():
    """In per-rank mode the val loader gets the non-shuffling DistributedSampler Lightning no longer adds."""
    loader = _on_rank(DigitsDataModule(rank_batch_sizes=[8, 8]), 2, 1).val_dataloader()
    assert isinstance(loader.sampler, DistributedSampler) and loader.sampler.rank == 1 and not loader.sampler.shuffle


def test_steps_per_epoch_alone_uses_batch_size_on_every_rank():
    """steps_per_epoch without rank_batch_sizes gives every rank batch_size and exactly that many steps."""
    loader = _on_rank(DigitsDataModule(batch_size=16, steps_per_epoch=5), 3, 2).train_dataloader()
    assert len(loader) == 5 and [len(x) for x, _ in loader] == [16] * 5


def test_rank_batch_sizes_length_must_match_world_size():
    """rank_batch_sizes with the wrong number of entries raises at setup, naming both counts."""
    message = r"rank_batch_sizes=\[8, 8, 8\]\): rank_batch_sizes needs one entry per rank, got 3 for world_size=2"
    with pytest.raises(ValueError, match=message):
        _on_rank(DigitsDataModule(rank_batch_sizes=[8, 8, 8]), 2, 0)


def test_per_rank_mode_requires_use_distributed_sampler_false():
    """Per-rank sampling under Trainer(use_distributed_sampler=True) in a distributed run raises with the fix."""
    with pytest.raises(ValueError, match=r"needs Trainer\(use_distributed_sampler=False\)"):
        _on_rank(DigitsDataModule(rank_batch_sizes=[8, 8]), 2, 0, use_distributed_sampler=True)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(batch_size=0), r"DigitsDataModule\(batch_size=0\): batch_size must be >= 1"),
        (dict(num_workers=-1), r"num_workers=-1\): num_workers must be >= 0"),
        (dict(val_fraction=1.0), r"val_fraction=1.0\): val_fraction must be in \(0, 1\)"),
        (dict(seed=-2), r"seed=-2\): seed must be >= 0"),
        (dict(train_subset=0), r"train_subset=0\): train_subset must be >= 1"),
        (dict(rank_batch_sizes=[]), r"rank_batch_sizes=\[\]\): rank_batch_sizes must be a non-empty list"),
        (dict(rank_batch_sizes=[4, 0]), r"rank_batch_sizes=\[4, 0\]\): rank_batch_sizes must be"),
        (dict(steps_per_epoch=0), r"steps_per_epoch=0\): steps_per_epoch must be >= 1"),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    """Each bad constructor argument raises a ValueError naming it, its value and the rule."""
    with pytest.raises(ValueError, match=message):
        DigitsDataModule(**kwargs)


def test_train_subset_larger_than_train_split_raises():
    """A train_subset larger than the training split raises at setup with the split's size."""
    with pytest.raises(ValueError, match=r"train_subset=5000\): train_subset must be <= the 1438 training samples"):
        DigitsDataModule(train_subset=5000).setup()


def test_dataloader_before_setup_raises():
    """Asking for a loader before setup is a lifecycle error, not an AttributeError."""
    with pytest.raises(RuntimeError, match=r"DigitsDataModule: call setup\(\)"):
        DigitsDataModule().train_dataloader()


class _RecordBatches(Callback):
    def __init__(self, dirpath):
        self.dirpath, self.sizes = dirpath, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.sizes.append([trainer.current_epoch, len(batch[0])])

    def on_train_end(self, trainer, pl_module):
        record = {"sizes": self.sizes, "sampler": type(trainer.train_dataloader.sampler).__name__}
        with open(os.path.join(self.dirpath, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(record, f)


def _two_rank_fit(tmp_path, dm: DigitsDataModule, use_distributed_sampler: bool) -> list[dict]:
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy="ddp_fork", max_epochs=2,
        use_distributed_sampler=use_distributed_sampler,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[_RecordBatches(tmp_path)],
    )  # fmt: skip
    trainer.fit(ClassifierModule(), dm)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_two_rank_fit_default_path_gets_lightnings_distributed_sampler(tmp_path):
    """Under a 2-process Trainer the default path gets Lightning's DistributedSampler: half the steps each."""
    ranks = _two_rank_fit(tmp_path, DigitsDataModule(batch_size=16, train_subset=160), use_distributed_sampler=True)
    for record in ranks:
        assert record["sampler"] == "DistributedSampler"
        assert record["sizes"] == [[0, 16]] * 5 + [[1, 16]] * 5  # 80 samples per rank in batches of 16


def test_two_rank_fit_runs_in_lockstep_with_per_rank_batches(tmp_path):
    """Under a 2-process Trainer each rank trains on its own batch size for the same number of steps every epoch."""
    dm = DigitsDataModule(rank_batch_sizes=[8, 24], train_subset=160)
    ranks = [record["sizes"] for record in _two_rank_fit(tmp_path, dm, use_distributed_sampler=False)]
    for rank, batch_size in enumerate([8, 24]):
        assert [e for e, _ in ranks[rank]] == [0] * 5 + [1] * 5  # ceil(160 / 32) steps per epoch
        assert {n for _, n in ranks[rank]} == {batch_size}
