"""Tier 3: the sign votes under Lightning Fabric (2 forked CPU ranks) against a plain-torch vote; setup refusals."""

import pytest
import torch
from _fabric_loop import batch, flat, launch, train
from _helpers import make_net
from lightning.fabric.plugins.precision import MixedPrecision
from torch import nn

from lightning_pdist.fabric import SignSGDFabricStrategy


def _majority_reference(steps, lr, world=2):
    """x ← x − lr·sign(Σ_m sign(g_m)), sign(0) = +1 and ties +1 (Bernstein et al. 2019): one model, every rank's batch."""
    net = make_net()
    history = {}
    for t in range(1, steps + 1):
        votes = []
        for r in range(world):
            net.zero_grad()
            x, y = batch(t, r, world)
            nn.functional.mse_loss(net(x), y).backward()
            votes.append([torch.where(p.grad >= 0, 1.0, -1.0) for p in net.parameters()])
        with torch.no_grad():
            for p, ys in zip(net.parameters(), zip(*votes)):
                p.sub_(lr * torch.where(torch.stack(ys).sum(0) >= 0, 1.0, -1.0))
        history[t] = flat(net).clone()
    return history


def test_majority_vote_matches_reference():
    """signsgd_mv under Fabric: every rank's parameters after every step equal the plain-torch majority vote."""
    history = launch(SignSGDFabricStrategy("majority", start_method="fork"), lambda fabric: train(fabric, 6, lr=1e-3))
    reference = _majority_reference(6, 1e-3)
    for t in range(1, 7):
        for r in range(2):
            torch.testing.assert_close(torch.from_numpy(history[t][r]), reference[t], atol=1e-7, rtol=0)


def test_it_signsgd_with_signum_resumes_exactly(tmp_path):
    """IT-signSGD with Signum momentum: fabric.save after step 4 and fabric.load reproduce steps 5..8 bit for bit."""
    make = lambda: SignSGDFabricStrategy("llr", warmup_rounds=2, momentum=0.9, start_method="fork")  # noqa: E731
    path = tmp_path / "ckpt.pt"
    whole = launch(make(), lambda fabric: train(fabric, 8, lr=1e-3, save_at=4, path=path))
    resumed = launch(make(), lambda fabric: train(fabric, 8, lr=1e-3, path=path, resume=True))
    for t in range(5, 9):
        torch.testing.assert_close(torch.from_numpy(resumed[t]), torch.from_numpy(whole[t]), atol=0, rtol=0)
    assert torch.load(path, weights_only=True)["pdist"]["config"]["aggregation"] == "llr"


def test_fp16_grad_scaler_is_refused_at_setup():
    """precision='16-mixed' (a GradScaler) is refused before the module is wrapped: its overflow skip is Trainer-only."""
    strategy = SignSGDFabricStrategy()
    strategy.precision = MixedPrecision("16-mixed", "cpu")
    with pytest.raises(ValueError, match=r"SignSGDFabricStrategy\(precision='16-mixed'\): fp16 with a GradScaler"):
        strategy.setup_module(nn.Linear(2, 2))


def test_sgd_sized_lr_warns():
    """An optimizer lr above MAX_SIGN_STEP warns that lr is the sign step (unit scale only)."""
    params = nn.Linear(2, 2).parameters()
    with pytest.warns(UserWarning, match=r"SGD\(lr=0.1\) is the sign step"):
        SignSGDFabricStrategy().setup_optimizer(torch.optim.SGD(params, lr=0.1))


def test_llr_options_under_majority_warn():
    """An LLR-only option set under aggregation='majority' warns that it is ignored."""
    with pytest.warns(UserWarning, match=r"aggregation='majority', warmup_rounds=3\): these options belong"):
        SignSGDFabricStrategy("majority", warmup_rounds=3)
