"""Tier 3: synthetic gradients (DNI) through ``Trainer(strategy=PipelineStrategy(synthetic_gradients=True))`` on 2
processes, with the default synthetic module (zero linear map) and optimizer (Adam, lr 1e-4), normalised (``σ·M(h/‖h‖)``); and the registered
aliases of the pipeline's newer schedules.

The DNI test runs the whole Lightning path twice, conditioned on labels (cDNI, ``synthetic_conditioning="labels"``:
the batches are ``(x, y, c)`` with ``c`` = how many of ``y``'s two targets are positive, which stage 0 takes from its
own copy of the batch): a fit of 8 steps that drains for validation at each epoch end (3 steps per epoch) and writes
a checkpoint there, compared with the plain-torch reference (``tests/_dni_reference.py``, drains included; stage
weights and the synthetic module); then a fit resumed from the first epoch's checkpoint (synthetic module with its
label columns and its Adam state restored on stage 0), which must end, step by step, where the first ends.
"""

import _delayed_reference as delayed
import pytest
import torch
from _dni_reference import dni_reference
from _helpers import SnapshotParams, TinyRegression, fit, load_snapshot, rank_batches, regression_data
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pdist import PipelineStrategy

LR, MU, N, BS, M = 0.05, 0.9, 12, 4, 2
STEPS, PER_EPOCH = 8, 3


class DeepRegression(TinyRegression):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.net = delayed.make_net()


def classes(y):
    """cDNI's labels of the regression targets: how many of each sample's two targets are positive (0, 1 or 2)."""
    return (y > 0).sum(1)


class LabelledRegression(DeepRegression):
    """Batches ``(x, y, c)``: the regression plus class labels that only the synthetic modules read."""

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self):
        x, y = regression_data(self.n).tensors
        return DataLoader(TensorDataset(x, y, classes(y)), batch_size=self.batch_size, shuffle=False)


class SaveSynthetic(Callback):
    """Stage 0 saves its synthetic module (after draining) at the end of training."""

    def __init__(self, path):
        self.path = path

    def on_train_end(self, trainer, pl_module):
        trainer.strategy.drain()
        if trainer.global_rank == 0:
            torch.save(trainer.strategy.executor.synthetic.state_dict(), self.path)


def microbatches():
    data = regression_data(N)
    out = []
    for t in range(STEPS):
        x, y = rank_batches(data, 0, 1, BS, t // PER_EPOCH)[t % PER_EPOCH]
        out += list(zip(x.tensor_split(M), y.tensor_split(M)))
    return out


def flat(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def test_trains_as_its_reference_and_resumes_exactly(tmp_path):
    """8 steps of cDNI on 2 ranks equal the reference (drained at 6 and 12 micro-batches; the stage weights and stage
    0's synthetic module, label columns included); a run resumed from the epoch-0 checkpoint matches it at every step."""
    make = lambda: LabelledRegression(lr=LR, momentum=MU, n=N)  # noqa: E731
    strategy = lambda: PipelineStrategy(start_method="fork", schedule="pipedream", synthetic_gradients=True,  # noqa: E731
                                        num_microbatches=M, split_points=["net.4"], synthetic_conditioning="labels",
                                        synthetic_num_classes=3)  # fmt: skip
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    first.mkdir(), resumed.mkdir()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=False)
    module = make()
    trainer = fit(strategy(), module, max_steps=STEPS, limit_val_batches=1, enable_checkpointing=True,
                  callbacks=[SnapshotParams(first), checkpoint, SaveSynthetic(tmp_path / "synthetic.pt")])  # fmt: skip
    mbs = microbatches()
    weights, synth = dni_reference([(0, 4), (4, 7)], mbs, LR, MU, lambda p: torch.optim.Adam(p, lr=1e-4), drains=(6, 12),
                                   labels=[classes(y) for _, y in mbs], num_classes=3)  # fmt: skip
    torch.testing.assert_close(flat(module.parameters()), flat(t for stage in weights for t in stage), atol=1e-6, rtol=0)
    saved = torch.load(tmp_path / "synthetic.pt", weights_only=False)
    torch.testing.assert_close(flat(saved["module"].values()), flat(synth[0]), atol=1e-6, rtol=0)
    assert saved["steps"] == STEPS * M and float(flat(synth[0]).abs().max()) > 0
    assert saved["module"]["weight"].shape == (8, 8 + 3) and float(saved["module"]["weight"][:, 8:].abs().max()) > 0
    assert [int(trainer.callback_metrics[f"pdist/pipeline/stage{s}/stash_depth"]) for s in range(2)] == [1, 1]
    ckpt = tmp_path / "ckpts" / "epoch=0-step=3.ckpt"
    stages = torch.load(ckpt, weights_only=False)["pdist"]["pipeline"]["stages"]
    assert stages[0]["schedule"] == "dni" and stages[0]["synthetic"]["steps"] == PER_EPOCH * M
    assert "state" in stages[0]["synthetic"]["optimizer"] and "synthetic" not in stages[1]
    fit(strategy(), make(), max_steps=STEPS, callbacks=[SnapshotParams(resumed)], ckpt_path=str(ckpt), limit_val_batches=1)
    for rank in range(2):
        for step in range(4, STEPS + 1):
            torch.testing.assert_close(load_snapshot(resumed, rank, step), load_snapshot(first, rank, step), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "name, schedule, dni",
    [("pipeline_spectrain", "spectrain", False), ("pipeline_ddg", "ddg", False),
     ("pipeline_features_replay", "features_replay", False), ("pipeline_dni", "pipedream", True),
     ("pipeline_dni_fork", "pipedream", True), ("pipeline_ddg_spawn", "ddg", False)],
)  # fmt: skip
def test_the_newer_schedules_have_registered_names(name, schedule, dni):
    """``Trainer(strategy=name)`` builds a PipelineStrategy with the schedule (and DNI) the name says."""
    strategy = Trainer(accelerator="cpu", devices=2, strategy=name, logger=False).strategy
    assert isinstance(strategy, PipelineStrategy) and strategy.config.schedule == schedule
    assert strategy.config.synthetic_gradients == dni and strategy.config.spec.synthetic == dni
    assert strategy._start_method == ("fork" if name.endswith("_fork") else "spawn" if name.endswith("_spawn") else "popen")


def test_four_stages_on_four_processes():
    """One layer per stage on 4 ranks (three synthetic modules): 3 steps end where the DNI reference ends."""
    module = DeepRegression(lr=LR, momentum=MU, n=N)
    fit(PipelineStrategy(start_method="fork", schedule="pipedream", synthetic_gradients=True, num_microbatches=M), module,
        devices=4, max_steps=3, limit_val_batches=0)  # fmt: skip
    weights, _ = dni_reference([(0, 2), (2, 4), (4, 6), (6, 7)], microbatches()[: 3 * M], LR, MU,
                               lambda p: torch.optim.Adam(p, lr=1e-4))  # fmt: skip
    torch.testing.assert_close(flat(module.parameters()), flat(t for stage in weights for t in stage), atol=1e-6, rtol=0)
