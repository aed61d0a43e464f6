"""Tier 3: Hogwild! under Lightning Fabric (2 forked CPU processes, your own loop) against plain torch: with
``lock=True`` every update lands, so on gradients that do not depend on the weights the shared weights end (and sit in
the mid-run checkpoint) at w0 + Σ over processes of each one's own torch SGD-with-momentum update, in any
interleaving; each process's momentum is its own (its rank file)."""

import pytest
import torch
from _fabric_loop import launch
from lightning.fabric import Fabric
from torch import nn

from lightning_pdist.fabric import HogwildFabricStrategy

D, STEPS, SAVE_AT, LR, MOMENTUM = 16, 6, 3, 1.0, 0.5


def grad(rank: int, t: int) -> torch.Tensor:
    """Process ``rank``'s gradient at step ``t``: integers (exact sums in fp32), not a function of the weights."""
    return torch.arange(D, dtype=torch.float32) % 5 + rank + t


def w0() -> torch.Tensor:
    return torch.arange(D, dtype=torch.float32) * 4 - 30


def own_update(rank: int, steps: int) -> torch.Tensor:
    """torch.optim.SGD with momentum, alone, on this process's gradients: the change it makes."""
    w = nn.Parameter(w0())
    opt = torch.optim.SGD([w], lr=LR, momentum=MOMENTUM)
    for t in range(1, steps + 1):
        w.grad = grad(rank, t)
        opt.step()
    return w.detach() - w0()


def momentum_buffer(rank: int, steps: int) -> torch.Tensor:
    buf = grad(rank, 1)
    for t in range(2, steps + 1):
        buf = MOMENTUM * buf + grad(rank, t)
    return buf


def run(fabric, path):
    model = nn.Linear(D, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(w0())
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM))
    for t in range(1, STEPS + 1):
        x = grad(fabric.global_rank, t).unsqueeze(0)  # d/dw (w·x) = x
        fabric.backward(model(x).sum())
        opt.step()
        opt.zero_grad()
        if t == SAVE_AT:
            fabric.save(path, {"model": model, "optimizer": opt, "step": t})
    fabric.strategy.load_consensus()
    return model.weight.detach().reshape(-1).clone().numpy(), fabric.strategy.steps


def test_two_processes_with_the_lock_sum_every_update_and_save_the_shared_weights(tmp_path):
    path = tmp_path / "hogwild.ckpt"
    final, steps = launch(HogwildFabricStrategy(lock=True, start_method="fork"), lambda fabric: run(fabric, path))
    expected = w0() + own_update(0, STEPS) + own_update(1, STEPS)
    torch.testing.assert_close(torch.from_numpy(final), expected, rtol=0, atol=0)
    assert steps == STEPS
    stored = torch.load(path, weights_only=False)
    assert stored["pdist"]["strategy"] == "HogwildFabricStrategy" and stored["step"] == SAVE_AT
    at_save = w0() + own_update(0, SAVE_AT) + own_update(1, SAVE_AT)
    torch.testing.assert_close(stored["model"]["weight"].reshape(-1), at_save, rtol=0, atol=0)
    for rank in range(2):  # each process's own momentum buffer, in its own file next to the checkpoint
        own = torch.load(f"{path}.pdist-rank{rank}-of-2", weights_only=False)
        buffer = own["optimizers"]["optimizer"]["state"][0]["momentum_buffer"].reshape(-1)
        torch.testing.assert_close(buffer, momentum_buffer(rank, SAVE_AT), rtol=0, atol=0)


def test_refusals():
    with pytest.raises(TypeError, match=r"HogwildFabricStrategy\(lock='yes'\): lock must be True"):
        HogwildFabricStrategy(lock="yes")
    with pytest.raises(ValueError, match=r"HogwildFabricStrategy\(num_nodes=2\): Hogwild! shares the parameters"):
        Fabric(accelerator="cpu", devices=1, num_nodes=2, strategy=HogwildFabricStrategy())


def run_lock_free(fabric, path, resume: bool):
    """SGD(lr=1) on loss = w·1: every update lowers every coordinate by exactly 1, whatever the weights; saves at
    ``SAVE_AT`` (or resumes from there). Returns the final weights, the weights right after ``fabric.load``, the
    process's step count after the load, and its own steps."""
    model = nn.Linear(D, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(w0())
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=1.0))
    state, loaded, steps_after_load = {"model": model, "optimizer": opt, "step": 0}, None, None
    if resume:
        fabric.load(path, state)
        loaded, steps_after_load = model.weight.detach().reshape(-1).clone().numpy(), fabric.strategy.steps
        fabric.barrier()  # nobody steps before every process has read them (the load's own barrier ends before the read)
    for t in range(state["step"] + 1, STEPS + 1):
        fabric.backward(model(torch.ones(1, D)).sum())
        opt.step()
        opt.zero_grad()
        if t == SAVE_AT and not resume:
            state["step"] = t
            fabric.save(path, state)
    fabric.strategy.load_consensus()
    return model.weight.detach().reshape(-1).clone().numpy(), loaded, steps_after_load, fabric.strategy.steps


def lost_updates(final: torch.Tensor, start: torch.Tensor, updates_per_coordinate: int) -> torch.Tensor:
    """Per coordinate, how many of the unit updates did not land: whole updates, never negative."""
    lost = final - (start - updates_per_coordinate)
    assert torch.equal(lost, lost.round()) and (lost >= 0).all(), lost
    return lost


def test_lock_free_loses_whole_updates_only_and_resumes_exactly_from_the_checkpoint(tmp_path):
    """Without the lock, 2 processes × STEPS unit updates: the shared weights end at w0 − 2·STEPS + (lost updates),
    counted per coordinate (whole, never negative) and few; the checkpoint holds w0 − 2·SAVE_AT + its own lost ones.
    A resumed run starts from exactly the saved weights and step counts, and ends at the saved weights − 2·(STEPS −
    SAVE_AT) + the lost updates of the resumed part."""
    path = tmp_path / "hogwild.ckpt"
    final, _, _, steps = launch(HogwildFabricStrategy(start_method="fork"), lambda f: run_lock_free(f, path, False))
    lost = lost_updates(torch.from_numpy(final), w0(), 2 * STEPS)
    saved = torch.load(path, weights_only=False)["model"]["weight"].reshape(-1)
    lost_at_save = lost_updates(saved, w0(), 2 * SAVE_AT)
    assert steps == STEPS and int(lost.sum()) <= 0.2 * 2 * STEPS * D and (lost >= lost_at_save).all()
    final, loaded, after_load, steps = launch(HogwildFabricStrategy(start_method="fork"),
                                              lambda f: run_lock_free(f, path, True))  # fmt: skip
    torch.testing.assert_close(torch.from_numpy(loaded), saved, rtol=0, atol=0)
    assert (after_load, steps) == (SAVE_AT, STEPS)
    lost = lost_updates(torch.from_numpy(final), saved, 2 * (STEPS - SAVE_AT))
    assert int(lost.sum()) <= 0.2 * 2 * (STEPS - SAVE_AT) * D
