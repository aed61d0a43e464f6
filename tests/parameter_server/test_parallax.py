"""Tier 3: the ``parallax`` strategy through ``Trainer(strategy=...)``: real worker processes, real servers, gloo.

One two-worker fit (2 servers) checks against one-process full-batch SGD written out here in plain torch (1e-5), rows
no batch touched bit-identical, the bytes each worker pushes and pulls per step against the byte model (logged), and
the checkpoint; a second fit resumes from the mid-run checkpoint and ends where the first one ended. Bad input:
refused at construction (the argument) or when fit starts, before any server (no sparse parameter).
"""

import json
from pathlib import Path

import pytest
import torch
from _helpers import fit
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_pdist import ParallaxStrategy
from lightning_pdist.parameter_server.parallax import sparse_push_bytes

VOCAB, DIM, USED, LENGTH, N, BATCH, LR = 40, 4, 24, 3, 24, 4, 0.5


def text_data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randint(0, USED, (N, LENGTH), generator=g), torch.randn(N, 2, generator=g))


class TextModule(LightningModule):
    """Mean of a sparse embedding's rows, then a dense head; rows USED.. of the table are in no sample."""

    def __init__(self, sparse: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM, sparse=sparse)
        self.head = nn.Linear(DIM, 2)

    def forward(self, tokens):
        return self.head(self.embed(tokens).mean(dim=1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def train_dataloader(self):
        return DataLoader(text_data(), batch_size=BATCH)

    def val_dataloader(self):
        return DataLoader(text_data(), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def flat(module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def reference(steps: int, world: int = 2) -> dict[int, torch.Tensor]:
    """One process, full batch: step t takes every worker's batch t (the DistributedSampler's shards), one SGD step."""
    module = TextModule()
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    x, y = text_data().tensors
    out, t, epoch = {0: flat(module).clone()}, 0, 0
    while t < steps:
        shards = []
        for rank in range(world):
            sampler = DistributedSampler(text_data(), num_replicas=world, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            shards.append(list(sampler))
        for i in range(0, len(shards[0]), BATCH):
            if t == steps:
                break
            idx = [j for shard in shards for j in shard[i : i + BATCH]]
            opt.zero_grad()
            nn.functional.mse_loss(module(x[idx]), y[idx]).backward()
            opt.step()
            t += 1
            out[t] = flat(module).clone()
        epoch += 1
    return out


class Record(Callback):
    """Each worker: per step, its batch's distinct rows and the logged bytes; at the end, its module."""

    def __init__(self, out: Path, tag: str):
        self.out, self.tag, self.steps = out, tag, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.rows = int(torch.unique(batch[0]).numel())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        m = trainer.callback_metrics
        self.steps.append([self.rows, float(m["pdist/parallax/push_bytes"]), float(m["pdist/parallax/pull_bytes"]),
                           float(m["pdist/parallax/rows"])])  # fmt: skip

    def on_fit_end(self, trainer, pl_module):
        rank = trainer.global_rank
        (self.out / f"{self.tag}{rank}.json").write_text(json.dumps(self.steps))
        torch.save(flat(pl_module), self.out / f"{self.tag}{rank}.pt")


def test_two_workers_are_full_batch_sgd_push_touched_rows_and_resume_exactly(tmp_path):
    """2 workers, 2 servers, 6 steps (3 an epoch, validation after each): every worker ends on the reference's parameters (1e-5), rows no
    batch touched bit-identical to the start; each step pushes and pulls r·(8 + 4·d) bytes for the r rows its batch
    touched (the logged metrics); the checkpoint at step 3 holds the reference's step 3 and the servers' state, and
    the fit resumed from it ends bit for bit where the uninterrupted one ended."""
    steps = 6
    ref = reference(steps)
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=False)
    fit(ParallaxStrategy(start_method="fork", num_servers=2), TextModule(), max_steps=steps, limit_val_batches=1,
        callbacks=[ckpt, Record(tmp_path, "full")], enable_checkpointing=True, logger=CSVLogger(tmp_path))  # fmt: skip
    start = ref[0][: VOCAB * DIM].view(VOCAB, DIM)
    for rank in range(2):
        end = torch.load(tmp_path / f"full{rank}.pt")
        torch.testing.assert_close(end, ref[steps], atol=1e-5, rtol=0)
        assert torch.equal(end[: VOCAB * DIM].view(VOCAB, DIM)[USED:], start[USED:])  # never touched: bit-identical
        records = json.loads((tmp_path / f"full{rank}.json").read_text())
        assert len(records) == steps
        for rows, pushed, pulled, logged_rows in records:
            assert pushed == pulled == sparse_push_bytes(rows, DIM) and logged_rows == rows
    saved = torch.load(tmp_path / "epoch=0-step=3.ckpt", weights_only=False)
    torch.testing.assert_close(torch.cat([v.reshape(-1) for v in saved["state_dict"].values()]), ref[3], atol=1e-5, rtol=0)
    assert [s["version"] for s in saved["pdist"]["servers"]] == [3, 3]
    fit(ParallaxStrategy(start_method="fork", num_servers=2), TextModule(), max_steps=steps, limit_val_batches=1,
        ckpt_path=str(tmp_path / "epoch=0-step=3.ckpt"), callbacks=[Record(tmp_path, "resumed")],
        logger=CSVLogger(tmp_path / "resumed"))  # fmt: skip
    for rank in range(2):
        assert torch.equal(torch.load(tmp_path / f"resumed{rank}.pt"), torch.load(tmp_path / f"full{rank}.pt"))


def test_four_workers_three_servers_are_full_batch_sgd(tmp_path):
    """4 workers (6 samples each: batches of 4 and 2), 3 servers (uneven row ranges): 3 steps end on the reference
    (1e-5), untouched rows bit-identical."""
    steps = 3
    ref = reference(steps, world=4)
    fit(ParallaxStrategy(start_method="fork", num_servers=3), TextModule(), devices=4, max_steps=steps,
        callbacks=[Record(tmp_path, "four")], logger=CSVLogger(tmp_path))  # fmt: skip
    end = torch.load(tmp_path / "four0.pt")
    torch.testing.assert_close(end, ref[steps], atol=1e-5, rtol=0)
    assert torch.equal(end[: VOCAB * DIM].view(VOCAB, DIM)[USED:], ref[0][: VOCAB * DIM].view(VOCAB, DIM)[USED:])


def test_no_sparse_parameter_is_refused_before_any_server_and_bad_names_at_construction():
    """Dense embeddings and no sparse_params: refused when fit starts (every rank, before a server starts), naming
    the argument, its value and the rule; a badly typed sparse_params at construction."""
    # (raised in the launched process: the launcher re-raises it with the message)
    with pytest.raises(Exception, match=r"ParallaxStrategy\(sparse_params=None\): the module has no sparse parameter: "
                                        r"no nn.Embedding or nn.EmbeddingBag with sparse=True"):  # fmt: skip
        fit(ParallaxStrategy(start_method="fork"), TextModule(sparse=False), devices=1, max_steps=1)
    with pytest.raises(TypeError, match=r"^ParallaxStrategy\(sparse_params='embed.weight'\): sparse_params must be a list"):
        ParallaxStrategy(sparse_params="embed.weight")
    with pytest.raises(ValueError, match=r"^ParallaxStrategy\(sparse_params=\['a', 'a'\]\): each name must appear once"):
        ParallaxStrategy(sparse_params=["a", "a"])
    trainer = Trainer(accelerator="cpu", devices=1, strategy="parallax", logger=False)
    assert isinstance(trainer.strategy, ParallaxStrategy)
