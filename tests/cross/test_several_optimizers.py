"""Several optimizers under the averaging family: the period counts training steps, the whole module is averaged.

The reference is written here from the papers' equations in plain torch: two ranks, each batch a
backward of the MSE loss, optimizer A (first layer) steps every batch, optimizer B (last layer)
every batch or every other one; after training step ``t`` with ``t % period == 0`` the replicas
synchronize by the algorithm's rule. Counting optimizer steps instead (two per batch) would
synchronize at other times, and the test would fail.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pdist import BMUFStrategy, EASGDStrategy, LocalSGDStrategy
from _helpers import TinyRegression, fit, make_net, rank_batches, regression_data

WORLD, BATCHES, LR, BATCH = 2, 5, 0.1, 4


class TwoOptimizers(TinyRegression):
    """Manual optimization; optimizer B steps every ``b_every`` batches."""

    def __init__(self, b_every: int = 1):
        super().__init__(optimizers=2, lr=LR, batch_size=BATCH)
        self.automatic_optimization = False
        self.b_every = b_every

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        opt_a, opt_b = self.optimizers()
        self.manual_backward(loss)
        opt_a.step()
        if (batch_idx + 1) % self.b_every == 0:
            opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()


def mean_rule(flats, state):
    avg = torch.stack(flats).mean(0)
    return [avg.clone() for _ in flats], avg


def bmuf_rule(flats, state, eta=0.5, zeta=1.0):
    anchor, delta = state.setdefault("anchor", None), state.setdefault("delta", None)
    g = torch.stack([state["A"] - w for w in flats]).mean(0)
    delta = eta * state["delta"] + zeta * g
    w_g = state["A"] - delta
    start = w_g - eta * delta
    state["A"], state["delta"] = start.clone(), delta
    return [start.clone() for _ in flats], w_g


def easgd_rule(flats, state, alpha=0.45):
    center = state["A"]
    d = [w - center for w in flats]
    state["A"] = center + alpha * torch.stack(d).sum(0)
    return [w - alpha * di for w, di in zip(flats, d)], state["A"].clone()


def reference(rule, period: int, b_every: int, consensus_at_end):
    data = regression_data(64)
    nets = [make_net() for _ in range(WORLD)]
    state = {"A": torch.nn.utils.parameters_to_vector(nets[0].parameters()).detach().clone()}
    state["delta"] = torch.zeros_like(state["A"])
    for t in range(1, BATCHES + 1):
        for r, net in enumerate(nets):
            x, y = rank_batches(data, r, WORLD, BATCH)[t - 1]
            net.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            with torch.no_grad():
                layers = [net[0]] + ([net[2]] if t % b_every == 0 else [])
                for layer in layers:
                    for p in layer.parameters():
                        p.sub_(LR * p.grad)
        flats = [torch.nn.utils.parameters_to_vector(n.parameters()).detach() for n in nets]
        if t % period == 0:
            flats, _ = rule(flats, state)
            for net, flat in zip(nets, flats):
                torch.nn.utils.vector_to_parameters(flat.clone(), net.parameters())
    flats = [torch.nn.utils.parameters_to_vector(n.parameters()).detach() for n in nets]
    return consensus_at_end(flats, state)


def final_flat(trainer):
    return torch.nn.utils.parameters_to_vector(trainer.lightning_module.parameters()).detach()


@pytest.mark.parametrize("b_every", [1, 2])
def test_local_sgd_counts_training_steps_with_two_optimizers(b_every):
    trainer = fit(LocalSGDStrategy(period=2, start_method="fork"), TwoOptimizers(b_every), max_steps=-1,
                  max_epochs=1, limit_train_batches=BATCHES)  # fmt: skip
    expected = reference(mean_rule, period=2, b_every=b_every, consensus_at_end=lambda f, s: torch.stack(f).mean(0))
    torch.testing.assert_close(final_flat(trainer), expected, atol=1e-6, rtol=0)


def test_bmuf_with_an_optimizer_stepping_every_other_batch():
    trainer = fit(BMUFStrategy(period=2, start_method="fork"), TwoOptimizers(2), max_steps=-1, max_epochs=1,
                  limit_train_batches=BATCHES)  # fmt: skip

    def global_model(flats, state):  # an open block is closed on a copy (eta = 1 - 1/2, zeta = 1)
        _, w_g = bmuf_rule(flats, dict(state))
        return w_g

    expected = reference(bmuf_rule, period=2, b_every=2, consensus_at_end=global_model)
    torch.testing.assert_close(final_flat(trainer), expected, atol=1e-6, rtol=0)


def test_easgd_with_two_optimizers_outputs_the_center():
    trainer = fit(EASGDStrategy(period=2, start_method="fork"), TwoOptimizers(1), max_steps=-1, max_epochs=1,
                  limit_train_batches=BATCHES)  # fmt: skip
    expected = reference(easgd_rule, period=2, b_every=1, consensus_at_end=lambda f, s: s["A"])
    torch.testing.assert_close(final_flat(trainer), expected, atol=1e-6, rtol=0)
