"""Tier 3: ParameterServerStrategy with several optimizers, parameters without gradients and buffers, vs plain torch."""

import copy

import pytest
import torch
from _helpers import TinyRegression, fit, make_net, rank_batches, regression_data
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.nn.functional import mse_loss, softplus
from torch.utils.data import DataLoader

from lightning_pdist import ParameterServerStrategy


def flat(module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def ps(**kwargs) -> ParameterServerStrategy:
    return ParameterServerStrategy(start_method="fork", **kwargs)


def mean_grads(per_rank: list[list[torch.Tensor | None]]) -> list[torch.Tensor | None]:
    """DDP's rule (find_unused_parameters=True): None where no rank has a gradient, else the sum over ranks / N."""
    out = []
    for gs in zip(*per_rank):
        present = [g for g in gs if g is not None]
        out.append(torch.stack(present).sum(0) / len(gs) if present else None)
    return out


# ---------------------------------------------------------------------- unused parameters


class Branches(LightningModule):
    """Head b is used on even batches only (unused by every worker on odd ones); head c by worker 0 only."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(8, 2), nn.Linear(8, 2), nn.Linear(8, 2)

    def loss(self, x, y, use_b, use_c):
        h = torch.tanh(self.trunk(x))
        out = self.a(h) + (self.b(h) if use_b else 0) + (self.c(h) if use_c else 0)
        return mse_loss(out, y)

    def training_step(self, batch, batch_idx):
        return self.loss(*batch, batch_idx % 2 == 0, self.global_rank == 0)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, weight_decay=0.05)

    def train_dataloader(self):
        return DataLoader(regression_data(64), batch_size=4)


def test_parameters_without_gradients_are_skipped_like_ddp():
    """A globally unused head does not move (no momentum/weight decay); a head one worker used moves by its grad / N."""
    model = Branches()
    fit(ps(num_servers=2), model, max_steps=6)
    ref = Branches()
    opt = ref.configure_optimizers()
    data = regression_data(64)
    for t in range(6):
        per_rank = []
        for r in range(2):
            ref.zero_grad(set_to_none=True)
            ref.loss(*rank_batches(data, r, 2, 4)[t], t % 2 == 0, r == 0).backward()
            per_rank.append([p.grad for p in ref.parameters()])
        for p, g in zip(ref.parameters(), mean_grads(per_rank)):
            p.grad = g
        opt.step()
    torch.testing.assert_close(flat(model), flat(ref), atol=1e-6, rtol=0)
    assert not torch.equal(flat(model.b), flat(Branches().b))


# ---------------------------------------------------------------------- several optimizers


class GAN(LightningModule):
    """Manual optimization with toggle_optimizer: a discriminator step (SGD) then a generator step (Adam) per batch."""

    def __init__(self, n: int = 64):
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.g, self.d = nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.n = n

    @staticmethod
    def d_loss(g, d, x):
        return softplus(-d(x)).mean() + softplus(d(g(x).detach())).mean()

    @staticmethod
    def g_loss(g, d, x):
        return softplus(-d(g(x))).mean()

    def training_step(self, batch, batch_idx):
        opt_g, opt_d = self.optimizers()
        x = batch[0]
        for opt, loss in ((opt_d, self.d_loss), (opt_g, self.g_loss)):
            self.toggle_optimizer(opt)
            self.manual_backward(loss(self.g, self.d, x))
            opt.step()
            opt.zero_grad()
            self.untoggle_optimizer(opt)

    def validation_step(self, batch, batch_idx):
        self.log("val/g_loss", self.g_loss(self.g, self.d, batch[0]), sync_dist=True)

    def configure_optimizers(self):
        return [torch.optim.Adam(self.g.parameters(), lr=0.01, betas=(0.5, 0.9)),
                torch.optim.SGD(self.d.parameters(), lr=0.05, momentum=0.9)]  # fmt: skip

    def train_dataloader(self):
        return DataLoader(regression_data(self.n), batch_size=4)

    def val_dataloader(self):
        return DataLoader(regression_data(16, seed=1), batch_size=8)


def gan_reference(batches_per_worker: int, n: int = 64) -> nn.Module:
    ref = GAN(n)
    opt_g, opt_d = ref.configure_optimizers()
    data = regression_data(n)
    per_epoch = len(rank_batches(data, 0, 2, 4))
    for t in range(batches_per_worker):
        epoch, i = divmod(t, per_epoch)
        xs = [rank_batches(data, r, 2, 4, epoch)[i][0] for r in range(2)]
        for opt, loss, module in ((opt_d, GAN.d_loss, ref.d), (opt_g, GAN.g_loss, ref.g)):
            per_rank = [list(torch.autograd.grad(loss(ref.g, ref.d, x), list(module.parameters()))) for x in xs]
            for p, g in zip(module.parameters(), mean_grads(per_rank)):
                p.grad = g
            opt.step()
    return ref


def test_gan_with_two_optimizers_matches_plain_torch():
    """Two optimizers (Adam for G, SGD+momentum for D) on 2 workers: each step moves only its own net, as in torch."""
    model = GAN()
    fit(ps(num_servers=2), model, max_steps=-1, max_epochs=1, limit_train_batches=5)
    torch.testing.assert_close(flat(model), flat(gan_reference(5)), atol=1e-5, rtol=0)


def test_resume_restores_every_server_optimizer(tmp_path):
    """GAN stopped after epoch 0 and resumed: the uninterrupted run's weights; the checkpoint holds both optimizers."""
    straight = GAN(n=24)
    fit(ps(), straight, max_steps=-1, max_epochs=2, limit_val_batches=1)
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=False)
    fit(ps(), GAN(n=24), max_steps=-1, max_epochs=1, callbacks=[ckpt], enable_checkpointing=True, limit_val_batches=1)
    (path,) = tmp_path.glob("epoch=0-*.ckpt")
    (server,) = torch.load(path, weights_only=False)["pdist"]["servers"]
    assert [bool(o["state"]) for o in server["shard"]["optimizers"]] == [True, True]
    resumed = GAN(n=24)
    fit(ps(), resumed, max_steps=-1, max_epochs=2, ckpt_path=str(path), limit_val_batches=1)
    torch.testing.assert_close(flat(resumed), flat(straight), atol=1e-6, rtol=0)
    torch.testing.assert_close(flat(resumed), flat(gan_reference(6, n=24)), atol=1e-5, rtol=0)


class EveryOtherBatch(TinyRegression):
    """Two SGD+momentum optimizers (first and last layer); the second steps every other batch on 2 batches' gradients."""

    def __init__(self, rank_dependent: bool = False):
        super().__init__(momentum=0.9, optimizers=2)
        self.automatic_optimization = False
        self.rank_dependent = rank_dependent

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        self.manual_backward(mse_loss(self.net(batch[0]), batch[1]))
        if self.rank_dependent and self.global_rank == 1:
            opt_a, opt_b = opt_b, opt_a  # worker 1 steps the other optimizer first: refused by the servers
        opt_a.step()
        opt_a.zero_grad()
        if batch_idx % 2 == 1 or self.rank_dependent:
            opt_b.step()
            opt_b.zero_grad()


@pytest.mark.parametrize("mode, devices", [("sync", 2), ("async", 1)])
def test_an_optimizer_that_steps_every_other_batch(mode, devices):
    """Optimizer b steps every other batch: its layer and momentum stay put in between, as with torch (sync and async)."""
    model = EveryOtherBatch()
    fit(ps(mode=mode, num_servers=2), model, devices=devices, max_steps=-1, max_epochs=1, limit_train_batches=6)
    net = make_net()
    opt_a = torch.optim.SGD(net[0].parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD(net[2].parameters(), lr=0.1, momentum=0.9)
    data, acc = regression_data(64), None
    for t in range(6):
        per_rank = []
        for r in range(devices):
            x, y = rank_batches(data, r, devices, 4)[t]
            per_rank.append(list(torch.autograd.grad(mse_loss(net(x), y), list(net.parameters()))))
        grads = mean_grads(per_rank)
        acc = grads[2:] if acc is None else [a + g for a, g in zip(acc, grads[2:])]
        for p, g in zip(net[0].parameters(), grads[:2]):
            p.grad = g
        opt_a.step()
        if t % 2 == 1:
            for p, g in zip(net[2].parameters(), acc):
                p.grad = g
            opt_b.step()
            acc = None
    torch.testing.assert_close(flat(model), flat(net), atol=1e-5, rtol=0)


def test_workers_stepping_different_optimizers_are_refused():
    """Sync: worker 1 steps optimizer 1 where worker 0 opened the step with optimizer 0: the run fails, saying why.

    Whichever worker's error the launcher surfaces, it carries the server's reason: the refused worker gets it as the
    reply to its push, and the server fails the step it cannot close with the same reason, so the waiting worker gets
    it too (not a bare "worker 1 disconnected")."""
    with pytest.raises(Exception, match=r"worker [01] pushed a gradient of optimizer [01] for step 0, which optimizer [01] opened; every worker must step the same optimizers in the same order"):
        fit(ps(), EveryOtherBatch(rank_dependent=True), max_steps=-1, max_epochs=1, limit_train_batches=2)


class SharedParameter(TinyRegression):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def configure_optimizers(self):
        return [torch.optim.SGD(self.net.parameters(), lr=0.1), torch.optim.SGD(self.net[2].parameters(), lr=0.1)]


def test_a_parameter_in_two_optimizers_is_refused():
    """A parameter two optimizers share cannot be stepped by either alone: refused at setup, naming it."""
    with pytest.raises(Exception, match=r"parameter 'net.2.weight' is in optimizer 0 and optimizer 1; each parameter must belong to one optimizer"):
        fit(ps(), SharedParameter(), devices=1, max_steps=1)


# ---------------------------------------------------------------------- buffers


def bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))


class BatchNormRegression(TinyRegression):
    def __init__(self, n: int = 64):
        super().__init__(lr=0.05, momentum=0.9, n=n)
        self.net = bn_net()


class SaveBuffers(Callback):
    def __init__(self, dirpath):
        self.dirpath = dirpath

    def on_fit_end(self, trainer, pl_module):  # after the strategy's on_train_end
        torch.save({k: v.clone() for k, v in pl_module.named_buffers()}, self.dirpath / f"buffers{trainer.global_rank}.pt")


def bn_reference(steps: int, n: int = 64) -> nn.Module:
    """Sync: each worker normalizes with its own batch, gradients averaged, running statistics averaged after each step."""
    net = bn_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    data = regression_data(n)
    per_epoch = len(rank_batches(data, 0, 2, 4))
    for t in range(steps):
        replicas = [copy.deepcopy(net) for _ in range(2)]
        for r, replica in enumerate(replicas):
            x, y = rank_batches(data, r, 2, 4, t // per_epoch)[t % per_epoch]
            mse_loss(replica(x), y).backward()
        for p, *copies in zip(net.parameters(), *(rep.parameters() for rep in replicas)):
            p.grad = torch.stack([c.grad for c in copies]).mean(0)
        opt.step()
        with torch.no_grad():
            for b, *copies in zip(net.buffers(), *(rep.buffers() for rep in replicas)):
                b.copy_(torch.stack(copies).float().mean(0) if b.is_floating_point() else copies[0])
    return net


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_batchnorm_buffers_agree_on_every_worker(tmp_path, mode):
    """BatchNorm running statistics: equal on both workers after fit; sync: equal to the averaged-per-step reference."""
    model = BatchNormRegression()
    trainer = fit(ps(mode=mode), model, max_steps=6, callbacks=[SaveBuffers(tmp_path)])
    buffers = [torch.load(tmp_path / f"buffers{r}.pt") for r in range(2)]
    for name in buffers[0]:
        torch.testing.assert_close(buffers[1][name], buffers[0][name], atol=0, rtol=0)
    assert not torch.equal(buffers[0]["net.1.running_mean"], torch.zeros(8))
    if mode == "sync":
        ref = bn_reference(6)
        torch.testing.assert_close(flat(model), flat(ref), atol=1e-6, rtol=0)
        for (name, b), ref_b in zip(model.named_buffers(), ref.buffers()):
            torch.testing.assert_close(b, ref_b, atol=1e-6, rtol=0, msg=name)
        assert trainer.callback_metrics["pdist/comm_bytes"] > 0


def test_batchnorm_resume_equals_the_uninterrupted_run(tmp_path):
    """Sync with BatchNorm: stop after epoch 0, resume: the same weights and running statistics as the straight run."""
    straight = BatchNormRegression(n=24)
    fit(ps(), straight, max_steps=6, limit_val_batches=1)
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=False)
    fit(ps(), BatchNormRegression(n=24), max_steps=3, callbacks=[ckpt], enable_checkpointing=True, limit_val_batches=1)
    resumed = BatchNormRegression(n=24)
    fit(ps(), resumed, max_steps=6, ckpt_path=str(tmp_path / "epoch=0-step=3.ckpt"), limit_val_batches=1)
    torch.testing.assert_close(flat(resumed), flat(straight), atol=1e-6, rtol=0)
    for (name, b), b_straight in zip(resumed.named_buffers(), straight.buffers()):
        torch.testing.assert_close(b, b_straight, atol=1e-6, rtol=0, msg=name)
    ref = bn_reference(6, n=24)
    torch.testing.assert_close(flat(straight), flat(ref), atol=1e-6, rtol=0)
