"""A Fabric training loop for the Fabric strategy tests: the same model, data and steps as ``reference_replicas``."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _helpers import make_net, rank_batches, regression_data
from _ranks import held_master_port
from lightning.fabric import Fabric
from torch import nn


def launch(strategy, fn, devices: int = 2, **fabric_kwargs):
    """Run ``fn(fabric)`` on ``devices`` CPU ranks (the strategy's start method; fork in the tests) on a port held for
    the launch; rank 0's result."""
    with held_master_port():
        fabric = Fabric(accelerator="cpu", devices=devices, strategy=strategy, **fabric_kwargs)
        return fabric.launch(fn)


def batch(t: int, rank: int, world: int, batch_size: int = 4, n: int = 64):
    """Rank ``rank``'s batch for optimizer step ``t`` (1-based), as in ``reference_replicas``."""
    data = regression_data(n)
    per_epoch = len(rank_batches(data, 0, world, batch_size))
    epoch, i = divmod(t - 1, per_epoch)
    return rank_batches(data, rank, world, batch_size, epoch)[i]


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def gathered(vector: torch.Tensor):
    """Every rank's ``vector`` as a numpy (world, d) array (numpy: torch tensors do not survive the launcher's queue)."""
    out = [torch.empty_like(vector) for _ in range(dist.get_world_size())]
    dist.all_gather(out, vector.contiguous())
    return torch.stack(out).numpy()


def train(fabric, steps: int, lr: float = 0.1, save_at: int | None = None, path=None, resume: bool = False,
          finish: bool = False, optimizer=torch.optim.SGD, **optimizer_kwargs):  # fmt: skip
    """SGD on the regression data; returns {step: numpy (world, d) of every rank's parameters} (rank 0's copy).

    ``save_at``: ``fabric.save(path, ...)`` right after that step. ``resume``: ``fabric.load(path, ...)`` after setup
    and continue from the saved step. ``finish``: ``load_consensus()`` at the end, recorded as step ``"final"``.
    """
    model = make_net()
    model, opt = fabric.setup(model, optimizer(model.parameters(), lr=lr, **optimizer_kwargs))
    state = {"model": model, "optimizer": opt, "step": 0}
    if resume:
        fabric.load(path, state)
    history = {}
    for t in range(state["step"] + 1, steps + 1):
        x, y = batch(t, fabric.global_rank, fabric.world_size)
        fabric.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
        history[t] = gathered(flat(model))
        if t == save_at:
            state["step"] = t
            fabric.save(path, state)
    if finish:
        fabric.strategy.load_consensus()
        history["final"] = gathered(flat(model))
    return history
