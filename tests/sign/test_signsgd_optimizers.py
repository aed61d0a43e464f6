"""Tier 3: the sign vote with several optimizers (GAN-style manual optimization) against a plain-torch reference.

Two fork-started ranks, ``find_unused_parameters=True``. Each batch, optimizer A (first layer) and
then optimizer B (last layer) each take a Lightning GAN step: ``toggle_optimizer``, a backward of its
own loss, ``step``. The reference, written here, takes each optimizer's rounds alone: every rank's
gradient of that optimizer's loss with respect to that optimizer's parameters only, the vote (or
Signum/EF, or the LLR vote with its own statistics) over those coordinates, ``x ← x − lr·update``.
"""

import warnings

import pytest
import torch
from _helpers import TinyRegression, fit, make_net, rank_batches, regression_data
from sign.test_hooks import binary, reference_it_signsgd
from lightning.pytorch import Callback
from torch import nn

from lightning_pdist import SignSGDStrategy
from lightning_pdist.sign.hooks import SignSGDState, _used_tensors

LR, BATCHES, WORLD = 0.01, 6, 2


def loss_a(net, x, y):
    return nn.functional.mse_loss(net(x), y)


def loss_b(net, x, y):
    return (net(x) - y).abs().mean()


class GAN(TinyRegression):
    """Manual optimization, two optimizers, Lightning's toggle_optimizer; B steps every ``b_every`` batches.

    Each backward checks that the other optimizer's gradients (left from its own last step) stay untouched.
    """

    def __init__(self, b_every: int = 1):
        super().__init__(lr=LR, optimizers=2)
        self.automatic_optimization = False
        self.b_every = b_every

    def _gan_step(self, opt, loss_fn, batch, others):
        self.toggle_optimizer(opt)  # before the forward: the other optimizer's parameters leave the graph
        opt.zero_grad()
        before = [None if p.grad is None else p.grad.clone() for p in others]
        self.manual_backward(loss_fn(self.net, *batch))
        for p, old in zip(others, before):
            assert (p.grad is None and old is None) or torch.equal(p.grad, old), "the other optimizer's .grad changed"
        opt.step()
        self.untoggle_optimizer(opt)

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        self._gan_step(opt_a, loss_a, batch, list(self.net[2].parameters()))
        if (batch_idx + 1) % self.b_every == 0:
            self._gan_step(opt_b, loss_b, batch, list(self.net[0].parameters()))


class SaveFinal(Callback):
    """Each rank saves its flat parameters and its hook state at the end of training."""

    def __init__(self, dirpath):
        self.dirpath = dirpath

    def on_train_end(self, trainer, pl_module):
        flat = torch.cat([p.detach().reshape(-1).clone() for p in pl_module.parameters()])
        state = trainer.strategy.hook_state.state_dict()
        torch.save({"params": flat, "state": state}, self.dirpath / f"rank{trainer.global_rank}.pt")


def majority(rounds, lengths):
    return binary(binary(rounds[-1]).sum(0))


def signum_ef(beta):
    """Signum momentum, then EF-signSGD per worker; the update is mean_m(s_{m,j})·U_j (Bernstein; Karimireddy)."""

    def vote(rounds, lengths):
        m = torch.zeros_like(rounds[0])
        e = torch.zeros_like(rounds[0])
        for g in rounds:  # (M, D)
            m = beta * m + (1 - beta) * g
            p = m + e
            s = torch.stack([seg.abs().mean(1) for seg in p.split(lengths, dim=1)], 1)  # (M, T)
            s_coord = torch.cat([s[:, j : j + 1].expand(-1, n) for j, n in enumerate(lengths)], 1)
            y = binary(p)
            e = p - s_coord * y
            u = binary(y.sum(0))
        s_mean = s.mean(0)
        return torch.cat([s_mean[j].expand(n) for j, n in enumerate(lengths)]) * u

    return vote


def llr(estimator, warmup=1):
    return lambda rounds, lengths: reference_it_signsgd(rounds, warmup, estimator, lengths)[0][-1]


def gan_reference(b_every, vote):
    """Plain torch: each optimizer's rounds alone, over its own parameters; returns the final flat parameters."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the workers, so gradients (and their signs) agree to the bit
    try:
        net = make_net()
        data = regression_data()
        batches = [rank_batches(data, r, WORLD, 4) for r in range(WORLD)]
        groups = {"a": (list(net[0].parameters()), loss_a), "b": (list(net[2].parameters()), loss_b)}
        rounds = {"a": [], "b": []}
        for t in range(BATCHES):
            for name in ("a", "b") if (t + 1) % b_every == 0 else ("a",):
                params, loss = groups[name]
                grads = []
                for r in range(WORLD):
                    x, y = batches[r][t]
                    gs = torch.autograd.grad(loss(net, x, y), params)
                    grads.append(torch.cat([g.reshape(-1) for g in gs]))
                rounds[name].append(torch.stack(grads))
                update = vote(torch.stack(rounds[name]), [p.numel() for p in params])
                with torch.no_grad():
                    for p, u in zip(params, update.split([p.numel() for p in params])):
                        p.sub_(LR * u.view_as(p))
        return torch.cat([p.detach().reshape(-1) for p in net.parameters()]), {k: len(v) for k, v in rounds.items()}
    finally:
        torch.set_num_threads(threads)


CASES = {
    "majority": (dict(), majority),
    "majority_bucket_view": (dict(gradient_as_bucket_view=True), majority),
    "signum_ef": (dict(momentum=0.5, error_feedback=True), signum_ef(0.5)),
    "llr_worker": (dict(aggregation="llr", warmup_rounds=1), llr("worker")),
    "llr_coordinate": (dict(aggregation="llr", warmup_rounds=1, estimator="coordinate"), llr("coordinate")),
}


@pytest.mark.parametrize("b_every", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_gan_two_optimizers_vote_per_optimizer(tmp_path, case, b_every):
    """toggle_optimizer GAN on 2 ranks: every optimizer's coordinates follow its own vote; the rest sit out exactly."""
    kwargs, vote = CASES[case]
    strategy = SignSGDStrategy(find_unused_parameters=True, start_method="fork", **kwargs)
    fit(strategy, GAN(b_every), devices=WORLD, max_steps=-1, max_epochs=1, limit_train_batches=BATCHES,
        callbacks=[SaveFinal(tmp_path)])  # fmt: skip
    expected, num_rounds = gan_reference(b_every, vote)
    saved = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for r in range(WORLD):
        torch.testing.assert_close(saved[r]["params"], expected, atol=1e-6, rtol=0, msg=lambda m: f"rank {r}: {m}")
    bucket = saved[0]["state"]["buckets"][0]
    assert bucket["rounds"] == num_rounds["a"] + num_rounds["b"]  # one bucket; a round per backward pass
    if kwargs.get("aggregation") == "llr":
        # One statistics set per optimizer, each counting only its own rounds; none for the whole bucket.
        assert bucket["llr"] is None
        assert sorted(s["rounds"] for s in bucket["groups"].values()) == sorted(num_rounds.values())


def test_partial_use_across_ranks_warns_once():
    """A tensor used on some ranks only is voted on with a zero gradient from the others, and rank 0 says so once."""
    state = SignSGDState(find_unused_parameters=True)
    state.rank = 0
    flags = torch.tensor([[True, False, False], [True, True, False]])  # (M, T): tensor 1 used on rank 1 only
    with pytest.warns(UserWarning, match=r"took part in the backward pass on some ranks only \(.*\{1: \[1\]\}\); a rank "
                                         r"that did not use one votes with a zero gradient"):  # fmt: skip
        assert _used_tensors(state, 0, flags).tolist() == [True, True, False]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _used_tensors(state, 0, flags)  # warned once
