"""Tier 3: local SGD, BMUF and EASGD under Lightning Fabric (2 forked CPU ranks) against the papers' equations."""

import pytest
import torch
from _fabric_loop import batch, flat, gathered, launch, train
from _helpers import TinyRegression, fit, make_net, reference_replicas
from torch import nn

from lightning_pdist import BMUFStrategy
from lightning_pdist.fabric import BMUFFabricStrategy, EASGDFabricStrategy, LocalSGDFabricStrategy
from lightning_pdist.fabric import SimuParallelSGDFabricStrategy


def _initial():
    return flat(make_net())


def _local_sgd_reference(flats, state):
    mean = torch.stack(flats).mean(0)
    return [mean.clone() for _ in flats]


def _bmuf_reference(bm, blr, nesterov):
    def sync(flats, state):
        anchor = state.get("anchor", state.get("warm", _initial()))
        delta = state.get("delta", torch.zeros_like(anchor))
        g = torch.stack([anchor - w for w in flats]).mean(0)  # G = mean_i(A - W_i)
        delta = bm * delta + blr * g
        w_g = anchor - delta
        start = w_g - bm * delta if nesterov else w_g
        state.update(anchor=start, delta=delta, global_model=w_g)
        return [start.clone() for _ in flats]

    return sync


def _easgd_reference(alpha):
    def sync(flats, state):
        center = state.get("center", state.get("warm", _initial()))
        d = [x - center for x in flats]
        state["center"] = center + alpha * torch.stack(d).sum(0)
        return [x - alpha * di for x, di in zip(flats, d)]

    return sync


CASES = {
    "local_sgd": (lambda w: LocalSGDFabricStrategy(period=3, warmup_steps=w, start_method="fork"), lambda: _local_sgd_reference),
    "bmuf": (lambda w: BMUFFabricStrategy(period=3, block_momentum=0.5, block_lr=1.2, warmup_steps=w,
                                          start_method="fork"), lambda: _bmuf_reference(0.5, 1.2, True)),
    "bmuf_plain": (lambda w: BMUFFabricStrategy(period=3, block_momentum=0.3, nesterov=False, warmup_steps=w,
                                                start_method="fork"), lambda: _bmuf_reference(0.3, 1.0, False)),
    "easgd": (lambda w: EASGDFabricStrategy(period=3, alpha=0.3, warmup_steps=w, start_method="fork"),
              lambda: _easgd_reference(0.3)),
}  # fmt: skip


def _assert_history(history, reference, steps):
    for t in steps:
        for r in range(2):
            torch.testing.assert_close(torch.from_numpy(history[t][r]), reference[t][r], atol=1e-6, rtol=0,
                                       msg=lambda m: f"rank {r} step {t}: {m}")  # fmt: skip


@pytest.mark.parametrize("warmup", [0, 2])
@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_matches_reference(name, warmup):
    """Each rank's parameters after every optimizer.step() equal a plain-torch run of the algorithm's equations."""
    make_strategy, make_sync = CASES[name]
    history = launch(make_strategy(warmup), lambda fabric: train(fabric, 10))
    _assert_history(history, reference_replicas(2, 10, make_sync(), 3, warmup), range(1, 11))


def test_gradient_accumulation_with_no_backward_sync():
    """Two half-batches per step (the first under fabric.no_backward_sync) give the full-batch run, warm-up included."""

    def run(fabric):
        model = make_net()
        model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        history = {}
        for t in range(1, 9):
            x, y = batch(t, fabric.global_rank, fabric.world_size)
            with fabric.no_backward_sync(model, enabled=True):
                fabric.backward(nn.functional.mse_loss(model(x[:2]), y[:2]) / 2)
            fabric.backward(nn.functional.mse_loss(model(x[2:]), y[2:]) / 2)
            opt.step()
            opt.zero_grad()
            history[t] = gathered(flat(model))
        return history

    history = launch(BMUFFabricStrategy(period=3, block_momentum=0.5, warmup_steps=2, start_method="fork"), run)
    reference = reference_replicas(2, 8, _bmuf_reference(0.5, 1.0, True), 3, warmup=2)
    for t in range(1, 9):
        for r in range(2):
            torch.testing.assert_close(torch.from_numpy(history[t][r]), reference[t][r], atol=1e-5, rtol=0)


def test_fabric_and_trainer_give_the_same_weights():
    """BMUF under Fabric ends where BMUFStrategy under the Trainer ends, on the same data (consensus at the end)."""
    module = TinyRegression()
    fit(BMUFStrategy(period=3, block_momentum=0.5, start_method="fork"), module, max_steps=8)
    history = launch(BMUFFabricStrategy(period=3, block_momentum=0.5, start_method="fork"),
                     lambda fabric: train(fabric, 8, finish=True))  # fmt: skip
    for r in range(2):
        torch.testing.assert_close(torch.from_numpy(history["final"][r]), flat(module.net), atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ["bmuf", "easgd"])
def test_load_consensus_loads_the_global_model(name):
    """After load_consensus() every rank holds BMUF's global model W_g or EASGD's center, mid-block included."""
    make_strategy, make_sync = CASES[name]
    for steps in (6, 7):  # a block just closed; a block open (closed early on a copy)
        history = launch(make_strategy(0), lambda fabric: train(fabric, steps, finish=True))
        state = {}
        sync = make_sync()
        replicas = reference_replicas(2, steps, lambda flats, s: sync(flats, state), 3)[steps]
        if name == "easgd":
            expected = state["center"]
        elif steps % 3 == 0:
            expected = state["global_model"]
        else:
            expected = _early_global_model(state, replicas, 0.5, 1.2)
        for r in range(2):
            torch.testing.assert_close(torch.from_numpy(history["final"][r]), expected, atol=1e-6, rtol=0)


def _early_global_model(state, replicas, bm, blr):
    """BMUF's output with an open block: W_g = A - (η·Δ + ζ·(A - mean_i W_i))."""
    anchor, delta = state["anchor"], state["delta"]
    return anchor - (bm * delta + blr * (anchor - torch.stack(replicas).mean(0)))


def test_simuparallel_sgd_trains_independently_and_averages_once():
    """SimuParallelSGD: no communication while training; load_consensus() loads the mean of the independent replicas."""

    def run(fabric):
        history = train(fabric, 7, finish=True)
        return history, fabric.strategy.comm_meter.by_kind

    history, by_kind = launch(SimuParallelSGDFabricStrategy(start_method="fork"), run)
    independent = reference_replicas(2, 7, _local_sgd_reference, period=100)
    _assert_history(history, independent, range(1, 8))
    for r in range(2):
        torch.testing.assert_close(torch.from_numpy(history["final"][r]), torch.stack(independent[7]).mean(0),
                                   atol=1e-6, rtol=0)  # fmt: skip
    assert list(by_kind) == ["param_all_reduce"]  # the one average; no gradient traffic


def test_consensus_weights_swaps_in_and_out():
    """Inside consensus_weights() the module holds the average; after it each rank has its own replica back."""

    def run(fabric):
        train_history = train(fabric, 4)  # one local step after the sync at 3: replicas differ
        model = fabric.strategy.module
        own = flat(model).clone()
        with fabric.strategy.consensus_weights():
            inside = gathered(flat(model))
        return train_history[4], inside, gathered(own), gathered(flat(model))

    replicas, inside, own, after = launch(LocalSGDFabricStrategy(period=3, start_method="fork"), run)
    assert not torch.allclose(torch.from_numpy(replicas[0]), torch.from_numpy(replicas[1]))
    mean = torch.from_numpy(replicas).mean(0)
    for r in range(2):
        torch.testing.assert_close(torch.from_numpy(inside[r]), mean, atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.from_numpy(after), torch.from_numpy(own), atol=0, rtol=0)


@pytest.mark.parametrize("name", ["local_sgd", "bmuf", "easgd"])
def test_save_mid_period_and_load_resumes_exactly(name, tmp_path):
    """fabric.save after step 4 (mid-period) and fabric.load in a new run reproduce the uninterrupted steps 5..9."""
    make_strategy, _ = CASES[name]
    path = tmp_path / "ckpt.pt"
    whole = launch(make_strategy(0), lambda fabric: train(fabric, 9, save_at=4, path=path))
    resumed = launch(make_strategy(0), lambda fabric: train(fabric, 9, path=path, resume=True))
    assert sorted(resumed) == list(range(5, 10))
    for t in range(5, 10):
        torch.testing.assert_close(torch.from_numpy(resumed[t]), torch.from_numpy(whole[t]), atol=0, rtol=0)
    saved = torch.load(path, weights_only=True)
    assert saved["step"] == 4 and saved["pdist"]["step"] == 4
    assert saved["pdist"]["rank_files"]["world_size"] == 2
    assert (tmp_path / "ckpt.pt.pdist-rank1-of-2").exists()


def test_saved_model_is_the_consensus(tmp_path):
    """The checkpoint's "model" entry is the average of the replicas (what to load for inference), not rank 0's."""
    path = tmp_path / "ckpt.pt"
    history = launch(LocalSGDFabricStrategy(period=3, start_method="fork"),
                     lambda fabric: train(fabric, 4, save_at=4, path=path))  # fmt: skip
    saved = torch.load(path, weights_only=True)["model"]
    net = make_net()
    net.load_state_dict(saved)
    torch.testing.assert_close(flat(net), torch.from_numpy(history[4]).mean(0), atol=1e-6, rtol=0)
