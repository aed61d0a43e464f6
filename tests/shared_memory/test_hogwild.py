"""Hogwild!/AsySVRG against plain torch: one process equals SGD and SVRG; two processes sharing one copy of the
weights end at w0 − lr·Σ(every gradient) up to lost updates (counted and bounded), exactly so with ``lock=True``; sparse
embedding rows no batch touches stay bit-identical; a mid-epoch checkpoint resumes exactly where that can be exact."""

from __future__ import annotations

import copy
from multiprocessing import resource_tracker

import pytest
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from _helpers import TinyRegression, fit, make_net, rank_batches, regression_data
from lightning_pdist import HogwildStrategy

D, ROWS, N, B = 64, 32, 64, 4  # dense width, embedding rows (the upper half never indexed), samples, batch


def counter_data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.ones(N, D), torch.randint(0, ROWS // 2, (N, 3), generator=g))


class Counter(LightningModule):
    """loss = <w, Σ_batch x> + Σ emb(idx): the gradients (Σ x, the rows' counts) do not depend on the weights."""

    def __init__(self, momentum: float = 0.0):
        super().__init__()
        g = torch.Generator().manual_seed(0)  # integers: every sum below is exact in fp32, in any order
        self.w = nn.Parameter(torch.randint(-64, 64, (D,), generator=g).float())
        self.emb = nn.Embedding(ROWS, 4, sparse=True)
        self.emb.weight.data.copy_(torch.randint(-64, 64, (ROWS, 4), generator=g).float())
        self.momentum = momentum

    def training_step(self, batch, batch_idx):
        x, idx = batch
        return (self.w * x.sum(0)).sum() + self.emb(idx).sum()

    def configure_optimizers(self):
        return torch.optim.SGD([{"params": [self.w], "momentum": self.momentum}, {"params": self.emb.parameters()}], lr=1.0)

    def train_dataloader(self):
        return DataLoader(counter_data(), batch_size=B, shuffle=False)


def counter_updates(world: int, steps: int | list[int], momentum: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ over processes and steps of each process's SGD update (its own momentum), for w and the embedding; ``steps``:
    the first ``steps`` batches of each process's shard, or the indices of the batches it steps on, in order."""
    dw, de = torch.zeros(D), torch.zeros(ROWS, 4)
    order = list(range(steps)) if isinstance(steps, int) else steps
    for rank in range(world):
        buf = None
        shard = rank_batches(counter_data(), rank, world, B)  # what Lightning's DistributedSampler gives the rank
        for x, idx in (shard[i] for i in order):
            g = x.sum(0)
            buf = g.clone() if buf is None else buf * momentum + g
            dw += buf
            de.index_add_(0, idx.reshape(-1), torch.ones(idx.numel(), 4))
    return dw, de


def test_two_processes_lock_free_lose_few_updates_and_leave_untouched_rows_alone(tmp_path):
    module = Counter()
    w0, e0 = module.w.detach().clone(), module.emb.weight.detach().clone()
    fit(HogwildStrategy(start_method="fork"), module, devices=2, max_steps=8)
    dw, de = counter_updates(2, 8, 0.0)
    lost_w = (module.w.detach() - (w0 - dw)) / B  # each update of a coordinate of w is exactly B
    assert torch.equal(lost_w, lost_w.round()) and (lost_w >= 0).all()
    lost_e = module.emb.weight.detach() - (e0 - de)  # each update of a touched row is exactly 1 per occurrence
    assert torch.equal(lost_e, lost_e.round()) and (lost_e >= 0).all()
    updates = 2 * 8 * D + int(de.sum())
    lost = int(lost_w.sum() + lost_e.sum())
    print(f"lost updates: {lost} of {updates}")
    assert lost <= 0.2 * updates  # not sharing would lose half (rank 0 would see only its own)
    untouched = slice(ROWS // 2, ROWS)
    assert torch.equal(module.emb.weight.detach()[untouched], e0[untouched])  # bit-identical
    assert (module.emb.weight.detach()[: ROWS // 2] != e0[: ROWS // 2]).any()


def test_lock_is_exact_and_resumes_mid_epoch_exactly(tmp_path):
    """lock=True: every update lands, so the interleaving does not matter: w0 − Σ, per-process momentum included,
    in the mid-epoch checkpoint, at the end, and after resuming from that checkpoint. implicit_momentum="compensate"
    took each process's 0.75 to 0.75 − (1 − 1/2) = 0.25 (the sums are those of momentum 0.25, and so is the resumed
    run's: each process's own states come back with the lowered value)."""
    module = Counter(momentum=0.75)
    w0, e0 = module.w.detach().clone(), module.emb.weight.detach().clone()
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_train_steps=3)
    locked = lambda: HogwildStrategy(lock=True, implicit_momentum="compensate", start_method="fork")  # noqa: E731
    fit(locked(), module, devices=2, max_steps=6, callbacks=[checkpoint], enable_checkpointing=True)
    dw, de = counter_updates(2, 6, 0.25)
    torch.testing.assert_close(module.w.detach(), w0 - dw, rtol=0, atol=0)
    torch.testing.assert_close(module.emb.weight.detach(), e0 - de, rtol=0, atol=0)
    path = tmp_path / "epoch=0-step=3.ckpt"
    stored = torch.load(path, weights_only=False)
    dw3, de3 = counter_updates(2, 3, 0.25)
    torch.testing.assert_close(stored["state_dict"]["w"], w0 - dw3, rtol=0, atol=0)
    torch.testing.assert_close(stored["state_dict"]["emb.weight"], e0 - de3, rtol=0, atol=0)
    resumed = Counter(momentum=0.75)
    fit(locked(), resumed, devices=2, max_steps=6, ckpt_path=str(path))
    # Lightning restarts a mid-epoch checkpoint's epoch at its first batch (its loaders keep no position): the
    # resumed steps 4-6 see batches 0-2 again, on the checkpoint's weights with each process's own momentum
    dw, de = counter_updates(2, [0, 1, 2, 0, 1, 2], 0.25)
    torch.testing.assert_close(resumed.w.detach(), w0 - dw, rtol=0, atol=0)
    torch.testing.assert_close(resumed.emb.weight.detach(), e0 - de, rtol=0, atol=0)


def sgd_reference(steps: int, lr: float, momentum: float) -> list[torch.Tensor]:
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    for x, y in rank_batches(regression_data(64), 0, 1, 4)[:steps]:
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    return [p.detach() for p in net.parameters()]


def svrg_reference(epochs: int, n: int, lr: float, every: int) -> list[torch.Tensor]:
    """SVRG (Johnson & Zhang 2013, option I) in plain torch: every ``every`` epochs w̃ ← w and μ ← the mean batch
    gradient at w̃; then w ← w − lr (∇f_b(w) − ∇f_b(w̃) + μ) batch by batch."""
    net = make_net()

    def grads(model, b):
        return torch.autograd.grad(nn.functional.mse_loss(model(b[0]), b[1]), list(model.parameters()))

    for epoch in range(epochs):
        batches = rank_batches(regression_data(n), 0, 1, 4, epoch)
        if epoch % every == 0:
            snap = copy.deepcopy(net)
            mu = [torch.stack(gs).mean(0) for gs in zip(*(grads(snap, b) for b in batches))]
        for b in batches:
            g, gs = grads(net, b), grads(snap, b)
            with torch.no_grad():
                for p, gi, gsi, m in zip(net.parameters(), g, gs, mu):
                    p -= lr * (gi - gsi + m)
    return [p.detach() for p in net.parameters()]


def test_one_process_is_sgd_and_svrg_and_resumes_mid_epoch_exactly(tmp_path):
    module = TinyRegression(lr=0.05, momentum=0.9)
    fit(HogwildStrategy(start_method="fork"), module, devices=1, max_steps=8)
    for p, q in zip(module.parameters(), sgd_reference(8, 0.05, 0.9)):
        torch.testing.assert_close(p.detach(), q, rtol=0, atol=1e-6)

    svrg = lambda: HogwildStrategy(variance_reduction="svrg", snapshot_every_epochs=2, start_method="fork")  # noqa: E731
    module = TinyRegression(lr=0.1, n=16)  # 4 batches per epoch, snapshots at epochs 0 and 2
    # epoch 0's checkpoint, mid snapshot period, saved after validation (a drained epoch, as Lightning resumes it)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=False)
    fit(svrg(), module, devices=1, max_steps=12, callbacks=[checkpoint], enable_checkpointing=True, limit_val_batches=1)
    reference = svrg_reference(3, 16, 0.1, every=2)
    for p, q in zip(module.parameters(), reference):
        torch.testing.assert_close(p.detach(), q, rtol=0, atol=1e-6)
    resumed = TinyRegression(lr=0.1, n=16)  # epoch 1 needs the checkpoint's w̃ and μ
    fit(svrg(), resumed, devices=1, max_steps=12, ckpt_path=str(tmp_path / "epoch=0-step=4.ckpt"), limit_val_batches=1)
    for p, q in zip(resumed.parameters(), module.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("strategy, world", [("hogwild_spawn", 2), ("hogwild_fork", 4)])
def test_processes_under_spawn_and_fork_share_one_copy(strategy, world):
    """Through the Trainer, 2 processes started by ``spawn`` (they share nothing with the parent: each maps rank 0's
    /dev/shm segment after it starts) and 4 forked ones: all write one copy of the weights. The final weights are
    w0 − Σ(every process's updates) up to lost updates, which are counted (whole updates, never negative) and bounded
    (without sharing rank 0 would see only its own: 1/2 or 3/4 lost); untouched embedding rows stay bit-identical.
    (spawn runs 2 processes, not 4: each spawned one imports torch and Lightning again, ~10 s of CPU here.)"""
    module = Counter()
    w0, e0 = module.w.detach().clone(), module.emb.weight.detach().clone()
    try:
        fit(strategy, module, devices=world, max_steps=4)
    finally:  # spawn started multiprocessing's resource tracker in this process: stop it (it restarts on demand)
        resource_tracker._resource_tracker._stop()
    dw, de = counter_updates(world, 4, 0.0)
    lost_w = (module.w.detach() - (w0 - dw)) / B
    assert torch.equal(lost_w, lost_w.round()) and (lost_w >= 0).all()
    lost_e = module.emb.weight.detach() - (e0 - de)
    assert torch.equal(lost_e, lost_e.round()) and (lost_e >= 0).all()
    updates, lost = world * 4 * D + int(de.sum()), int(lost_w.sum() + lost_e.sum())
    print(f"lost updates: {lost} of {updates}")
    assert lost <= 0.25 * updates
    assert torch.equal(module.emb.weight.detach()[ROWS // 2 :], e0[ROWS // 2 :])
