"""Small models, data and callbacks shared by the strategy tests."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def regression_data(n: int = 64, d_in: int = 4, d_out: int = 2, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    w = torch.randn(d_in, d_out, generator=g)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(n, d_out, generator=g)
    return TensorDataset(x, y)


def make_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


class TinyRegression(LightningModule):
    """MSE regression on fixed data; plain SGD unless told otherwise."""

    def __init__(self, lr: float = 0.1, momentum: float = 0.0, batch_size: int = 4, n: int = 64, optimizers: int = 1):
        super().__init__()
        self.net = make_net()
        self.lr, self.momentum, self.batch_size, self.n, self.num_optimizers = lr, momentum, batch_size, n, optimizers

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        make = lambda params: torch.optim.SGD(params, lr=self.lr, momentum=self.momentum)  # noqa: E731
        if self.num_optimizers == 1:
            return make(self.parameters())
        return [make(self.net[0].parameters()), make(self.net[2].parameters())]

    def train_dataloader(self):
        return DataLoader(regression_data(self.n), batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self):
        return DataLoader(regression_data(16, seed=1), batch_size=8)


class SnapshotParams(Callback):
    """Each rank saves its flat parameters after every training batch to dirpath/rank{r}_step{t}.pt."""

    def __init__(self, dirpath: str | Path):
        self.dirpath = Path(dirpath)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        flat = torch.cat([p.detach().reshape(-1).clone() for p in pl_module.parameters()])
        torch.save(flat, self.dirpath / f"rank{trainer.global_rank}_step{trainer.global_step}.pt")

    def on_train_end(self, trainer, pl_module):
        flat = torch.cat([p.detach().reshape(-1).clone() for p in pl_module.parameters()])
        torch.save(flat, self.dirpath / f"rank{trainer.global_rank}_final.pt")


def load_snapshot(dirpath: str | Path, rank: int, step: int | str) -> torch.Tensor:
    return torch.load(Path(dirpath) / f"rank{rank}_step{step}.pt" if step != "final" else Path(dirpath) / f"rank{rank}_final.pt")


def fit(strategy, module: LightningModule, devices: int = 2, max_steps: int = 8, callbacks=(), **trainer_kwargs):
    """Fork-launched CPU fit; returns the Trainer (rank 0's results come back to this process)."""
    os.environ["MASTER_PORT"] = str(free_port())
    kwargs = dict(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=list(callbacks),
    )
    kwargs.update(trainer_kwargs)
    trainer = Trainer(**kwargs)
    trainer.fit(module)
    return trainer


def rank_batches(dataset: TensorDataset, rank: int, world_size: int, batch_size: int):
    """The batches DistributedSampler(shuffle=False) gives `rank`, in order."""
    idx = list(range(rank, len(dataset), world_size))
    x, y = dataset.tensors
    return [(x[idx[i : i + batch_size]], y[idx[i : i + batch_size]]) for i in range(0, len(idx), batch_size)]
