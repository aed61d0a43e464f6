"""Small models, data and callbacks shared by the strategy tests."""

from __future__ import annotations

import gzip
import os
import socket
import struct
from pathlib import Path

import lightning_pdist  # noqa: F401  (first: torch and Lightning imported with the collector paused, core/startup.py)
import numpy as np
import torch
from _ranks import held_master_port
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


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


def fit(strategy, module: LightningModule, devices: int = 2, max_steps: int = 8, callbacks=(), ckpt_path=None, **trainer_kwargs):
    """Fork-launched CPU fit on a port held for it; returns the Trainer (rank 0's results come back to this process)."""
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
        # Every step is a logging step, so pdist/comm_bytes (bytes since the last logged step) is the step's bytes.
        log_every_n_steps=1,
    )
    kwargs.update(trainer_kwargs)
    with held_master_port():
        trainer = Trainer(**kwargs)
        trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


def rank_batches(dataset: TensorDataset, rank: int, world_size: int, batch_size: int, epoch: int = 0):
    """The batches Lightning gives `rank` in `epoch`: a shuffled DistributedSampler with seed 0."""
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    idx = list(sampler)
    x, y = dataset.tensors
    return [(x[idx[i : i + batch_size]], y[idx[i : i + batch_size]]) for i in range(0, len(idx), batch_size)]


def reference_replicas(world: int, steps: int, sync, period: int, warmup: int = 0, lr: float = 0.1, batch_size: int = 4, n: int = 64):
    """Plain-torch simulation of `world` ranks taking SGD steps on their DistributedSampler shards.

    Warm-up steps average gradients; afterwards each rank steps locally and ``sync(flat_list, state)``
    (written in each test, from the paper's equations) rewrites the list of flat replicas after every
    step t with (t - warmup) % period == 0. Returns {step: [flat params of rank r]}.
    """
    data = regression_data(n)
    per_epoch = len(rank_batches(data, 0, world, batch_size))
    nets = [make_net() for _ in range(world)]
    history, state = {}, {}
    for t in range(1, steps + 1):
        grads = []
        for r, net in enumerate(nets):
            epoch, i = divmod(t - 1, per_epoch)
            x, y = rank_batches(data, r, world, batch_size, epoch)[i]
            net.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            grads.append([p.grad.clone() for p in net.parameters()])
        if t <= warmup:
            grads = [[torch.stack(gs).mean(0) for gs in zip(*grads)] for _ in range(world)]
        with torch.no_grad():
            for net, gs in zip(nets, grads):
                for p, g in zip(net.parameters(), gs):
                    p.sub_(lr * g)
        flats = [torch.cat([p.detach().reshape(-1) for p in net.parameters()]) for net in nets]
        if t <= warmup:
            state["warm"] = flats[0].clone()
        elif (t - warmup) % period == 0:
            flats = sync(flats, state)
            with torch.no_grad():
                for net, flat in zip(nets, flats):
                    torch.nn.utils.vector_to_parameters(flat.clone(), net.parameters())
        history[t] = [f.clone() for f in flats]
    return history


def assert_matches_reference(snapdir, reference: dict, world: int, atol: float = 1e-6):
    """Every rank's snapshot after every step equals the reference replica."""
    for t, flats in reference.items():
        for r in range(world):
            torch.testing.assert_close(load_snapshot(snapdir, r, t), flats[r], atol=atol, rtol=0, msg=lambda m: f"rank {r} step {t}: {m}")


def server_processes() -> list[int]:
    """Live (non-zombie) processes named pdist-ps* that descend from this process (however deep: conftest makes this
    process the subreaper of orphans, so a server whose parent died is still found). Other suites' servers on the
    same machine are never counted."""
    parent_of, names = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()  # state ppid pgrp ...
                comm = (entry / "comm").read_text()
            except OSError:
                continue
            parent_of[int(entry.name)] = int(stat[1])
            if comm.startswith("pdist-ps") and stat[0] != "Z":
                names[int(entry.name)] = comm
    mine, grew = {os.getpid()}, True
    while grew:
        new = {pid for pid, ppid in parent_of.items() if ppid in mine and pid not in mine}
        mine |= new
        grew = bool(new)
    return sorted(pid for pid in names if pid in mine)


def idx_bytes(array: np.ndarray, type_code: int = 0x08) -> bytes:
    """``array`` in the IDX format of the MNIST files (big-endian)."""
    header = bytes([0, 0, type_code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write_mnist(folder, n_train=40, n_test=20, gz=True, seed=0):
    """Tiny random MNIST files (the four standard names) in ``folder``; returns the arrays written."""
    from lightning_pdist.data.mnist import MNIST_FILES

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {
        "train_images": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train_labels": (np.arange(n_train) % 10).astype(np.uint8),
        "test_images": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "test_labels": (np.arange(n_test) % 10).astype(np.uint8),
    }
    for key, array in arrays.items():
        data = idx_bytes(array)
        path = folder / (MNIST_FILES[key] + (".gz" if gz else ""))
        path.write_bytes(gzip.compress(data) if gz else data)
    return arrays


def closed_by_server(sock: socket.socket, within: float = 10.0) -> bool:
    """True once a server closed ``sock`` (EOF or reset) within ``within`` s; what it sent first is discarded."""
    sock.settimeout(within)
    try:
        while sock.recv(1 << 20):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


class FusedAttention(nn.Module):
    """(tensor-parallel tests) Rows [q; k; v] in one Linear; the heads come from the width (``view(..., -1, head_dim)``)."""

    def __init__(self, dim: int = 16, num_heads: int = 4):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, -1, self.head_dim).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return self.proj(nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, -1))
