"""Tier 3: D-PSGD and AD-PSGD in real Lightning runs (fork launcher, gloo), each against plain torch written here.

Several checks per launch (the suite's time budget): the ring on 4 ranks checks the rule, the bytes and, on a probe
parameter the optimizer never moves (lr = 0), that the mean is preserved and the consensus distance shrinks; the
complete graph on 3 ranks checks the rule with momentum, the checkpoint's average, and the resume from it.
"""

from pathlib import Path

import torch
from _helpers import TinyRegression, fit, make_net, rank_batches, regression_data
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_pdist import DecentralizedStrategy

ATOL = 1e-5


class Probed(TinyRegression):
    """TinyRegression plus a 3-element probe in a param group with lr = 0, set apart per rank at the start of fit
    (after the strategy made every rank equal): only the mixing moves it. ``spread`` also sets the net apart."""

    def __init__(self, spread: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.probe = nn.Parameter(torch.zeros(3))
        self.spread = spread

    def on_train_start(self):
        rank = self.trainer.global_rank
        g = torch.Generator().manual_seed(100 + rank)
        with torch.no_grad():
            self.probe.copy_(torch.randn(3, generator=g) + rank)
            if self.spread:
                for p in self.net.parameters():
                    p.add_(torch.randn(p.shape, generator=g))

    def configure_optimizers(self):
        return torch.optim.SGD([{"params": self.net.parameters()}, {"params": [self.probe], "lr": 0.0}], lr=self.lr,
                               momentum=self.momentum)  # fmt: skip


class Record(Callback):
    """Per rank: net and probe after every step, at the start and at the end (own replica), bytes and momentum."""

    def __init__(self, dirpath):
        self.dirpath = Path(dirpath)

    def _save(self, trainer, module, tag):
        net = torch.cat([p.detach().reshape(-1).clone() for p in module.net.parameters()])
        torch.save({"net": net, "probe": module.probe.detach().clone()}, self.dirpath / f"r{trainer.global_rank}_{tag}.pt")

    def on_train_epoch_start(self, trainer, module):  # after the module's on_train_start set the probe
        if trainer.current_epoch == 0:
            self._save(trainer, module, "start")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self._save(trainer, module, str(trainer.global_step))

    def on_train_end(self, trainer, module):
        self._save(trainer, module, "end")
        meter = trainer.strategy.comm_meter
        torch.save({"by_kind": dict(meter.by_kind), "momentum": trainer.optimizers[0].param_groups[0]["momentum"]},
                   self.dirpath / f"r{trainer.global_rank}_meta.pt")  # fmt: skip


def load(d, rank, tag):
    return torch.load(Path(d) / f"r{rank}_{tag}.pt")


def dpsgd_reference(w: torch.Tensor, steps: int, lr: float, momentum: float = 0.0, n: int = 64, batch_size: int = 4):
    """Lian et al. 2017, Algorithm 1 in one process: x_i(t+1) = Σ_j W_ij x_j(t) − lr·v_i, v_i = μ v_i + ∇F_i(x_i(t))."""
    world = w.shape[0]
    data = regression_data(n)
    per_epoch = len(rank_batches(data, 0, world, batch_size))
    net = make_net()
    x = [torch.nn.utils.parameters_to_vector(net.parameters()).detach().clone() for _ in range(world)]
    v = [torch.zeros_like(x[0]) for _ in range(world)]
    history = {}
    for t in range(1, steps + 1):
        epoch, i = divmod(t - 1, per_epoch)
        grads = []
        for r in range(world):
            torch.nn.utils.vector_to_parameters(x[r].clone(), net.parameters())
            net.zero_grad()
            xb, yb = rank_batches(data, r, world, batch_size, epoch)[i]
            nn.functional.mse_loss(net(xb), yb).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in net.parameters()]))
        mixed = [sum(float(w[r, j]) * x[j] for j in range(world)) for r in range(world)]
        for r in range(world):
            v[r] = momentum * v[r] + grads[r]
            x[r] = mixed[r] - lr * v[r]
        history[t] = [xr.clone() for xr in x]
    return history


def ring(n):
    w = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        for j in (i - 1, i, i + 1):
            w[i, j % n] = 1 / 3
    return w


def consensus_distance(vectors):
    mean = torch.stack(vectors).mean(0)
    return sum(float((v - mean).norm()) ** 2 for v in vectors) ** 0.5


def test_ring_on_4_ranks_matches_the_rule_bytes_mean_and_consensus(tmp_path):
    """Ring, 4 ranks, 4 steps: every rank equals Algorithm 1 in plain torch (1e-5); each step sends the model to both
    neighbours; the lr = 0 probe keeps its mean exactly while its consensus distance shrinks every step; the module
    after fit is the average of the ranks."""
    steps, world = 4, 4
    model = Probed(lr=0.1)
    fit(DecentralizedStrategy(topology="ring", start_method="fork"), model, devices=world, max_steps=steps,
        callbacks=[Record(tmp_path)])  # fmt: skip
    reference = dpsgd_reference(ring(world), steps, lr=0.1)
    for t in range(1, steps + 1):
        for r in range(world):
            torch.testing.assert_close(load(tmp_path, r, t)["net"], reference[t][r], atol=ATOL, rtol=0,
                                       msg=lambda m: f"rank {r} step {t}: {m}")  # fmt: skip
    probes = {t: [load(tmp_path, r, t)["probe"] for r in range(world)] for t in ["start", *range(1, steps + 1)]}
    mean0 = torch.stack(probes["start"]).mean(0)
    distances = [consensus_distance(probes[t]) for t in ["start", *range(1, steps + 1)]]
    for t in range(1, steps + 1):
        torch.testing.assert_close(torch.stack(probes[t]).mean(0), mean0, atol=1e-6, rtol=0)
    assert all(b < a for a, b in zip(distances, distances[1:])), distances
    nbytes = 4 * (sum(p.numel() for p in make_net().parameters()) + 3)
    for r in range(world):
        assert load(tmp_path, r, "meta")["by_kind"]["gossip_model"] == steps * 2 * nbytes
    ends = [torch.cat([load(tmp_path, r, "end")["net"]]) for r in range(world)]
    got = torch.cat([p.detach().reshape(-1) for p in model.net.parameters()])
    torch.testing.assert_close(got, torch.stack(ends).mean(0), atol=1e-6, rtol=0)


def test_complete_on_3_ranks_with_momentum_checkpoint_and_exact_resume(tmp_path):
    """Complete graph, 3 ranks, momentum 0.9: every rank equals the rule (1e-5); the checkpoint saved at validation
    end of epoch 0 (step 2) holds the average of the ranks; resuming from it reproduces steps 3 and 4 (own models and
    momentum buffers come back from each rank's file)."""
    steps, world, n = 4, 3, 24  # 8 samples per rank, batch 4: 2 steps per epoch
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    first.mkdir(), resumed.mkdir()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=False)
    fit(DecentralizedStrategy(topology="complete", start_method="fork"), Probed(lr=0.05, momentum=0.9, n=n),
        devices=world, max_steps=steps, callbacks=[Record(first), ckpt], enable_checkpointing=True,
        limit_val_batches=1)  # fmt: skip
    reference = dpsgd_reference(torch.full((world, world), 1 / 3, dtype=torch.float64), steps, lr=0.05, momentum=0.9, n=n)
    for t in range(1, steps + 1):
        for r in range(world):
            torch.testing.assert_close(load(first, r, t)["net"], reference[t][r], atol=ATOL, rtol=0)
    path = tmp_path / "ckpts" / "epoch=0-step=2.ckpt"
    stored = torch.load(path, weights_only=False)
    assert stored["pdist"]["strategy"] == "DecentralizedStrategy" and stored["pdist"]["step"] == 2
    net_keys = [k for k in stored["state_dict"] if k.startswith("net.")]
    saved = torch.cat([stored["state_dict"][k].reshape(-1) for k in net_keys])
    torch.testing.assert_close(saved, torch.stack(reference[2]).mean(0), atol=ATOL, rtol=0)
    fit(DecentralizedStrategy(topology="complete", start_method="fork"), Probed(lr=0.05, momentum=0.9, n=n),
        devices=world, max_steps=steps, callbacks=[Record(resumed)], ckpt_path=str(path), limit_val_batches=1)  # fmt: skip
    for t in (3, 4):
        for r in range(world):
            torch.testing.assert_close(load(resumed, r, t)["net"], load(first, r, t)["net"], atol=1e-6, rtol=0)
            torch.testing.assert_close(load(resumed, r, t)["probe"], load(first, r, t)["probe"], atol=1e-6, rtol=0)


def test_identity_mixing_is_independent_sgd(tmp_path):
    """W = I: no neighbours, no bytes, each rank is plain SGD on its own shard (torch.optim.SGD written here)."""
    steps, world = 3, 2
    fit(DecentralizedStrategy(topology=torch.eye(world), start_method="fork"), Probed(lr=0.1, momentum=0.5),
        devices=world, max_steps=steps, callbacks=[Record(tmp_path)])  # fmt: skip
    data = regression_data(64)
    for r in range(world):
        net = make_net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.5)
        for t, (xb, yb) in enumerate(rank_batches(data, r, world, 4)[:steps], start=1):
            opt.zero_grad()
            nn.functional.mse_loss(net(xb), yb).backward()
            opt.step()
            expected = torch.nn.utils.parameters_to_vector(net.parameters()).detach()
            torch.testing.assert_close(load(tmp_path, r, t)["net"], expected, atol=1e-6, rtol=0)
        assert load(tmp_path, r, "meta")["by_kind"].get("gossip_model", 0) == 0


def test_adpsgd_lr0_preserves_the_average_and_compensates_momentum(tmp_path):
    """AD-PSGD, ring on 4 ranks (2 active, 2 passive), lr = 0, models set apart per rank: pairwise averages keep the
    mean, so the module after fit is exactly the mean of the starting models (1e-6); the ranks' own models end closer
    together than they started; implicit_momentum='compensate' took 0.9 to 0.9 − (1 − 1/4) = 0.15 on every rank."""
    steps, world = 6, 4
    model = Probed(lr=0.0, momentum=0.9, spread=True)
    fit(DecentralizedStrategy(topology="ring", mode="async", implicit_momentum="compensate", start_method="fork"),
        model, devices=world, max_steps=steps, callbacks=[Record(tmp_path)])  # fmt: skip
    starts = [load(tmp_path, r, "start") for r in range(world)]
    ends = [load(tmp_path, r, "end") for r in range(world)]
    got = torch.cat([p.detach().reshape(-1) for p in model.net.parameters()])
    torch.testing.assert_close(got, torch.stack([s["net"] for s in starts]).mean(0), atol=1e-6, rtol=0)
    torch.testing.assert_close(model.probe.detach(), torch.stack([s["probe"] for s in starts]).mean(0), atol=1e-6, rtol=0)
    assert consensus_distance([e["net"] for e in ends]) < 0.5 * consensus_distance([s["net"] for s in starts])
    for r in range(world):
        meta = load(tmp_path, r, "meta")
        assert abs(meta["momentum"] - 0.15) < 1e-12, meta
        assert meta["by_kind"].get("gossip_pair", 0) > 0, meta
