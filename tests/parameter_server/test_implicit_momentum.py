"""Asynchrony as momentum on the parameter server: ``implicit_momentum="compensate"`` (mode="async" only).

The rule (``core/momentum.py``): ``N`` asynchronous workers imply momentum ``1 − 1/N``; the servers' optimizer runs
with ``μ' = max(0, μ − (1 − 1/N))``. Checked in a real run whose result does not depend on the order the pushes land
in: every gradient is the same constant ``c`` (the loss is linear in the weights), and an async server applies each
push scaled by ``1/N``, so after ``K`` pushes in any order heavy-ball SGD on the server has moved ``w`` by
``−lr Σ_{k=1..K} Σ_{j<k} μ'^j c/N`` (torch's SGD written here).
"""

from __future__ import annotations

import pytest
import torch
from _helpers import fit
from lightning.pytorch import Callback, LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pdist import ParameterServerStrategy

C = torch.tensor([1.0, -2.0, 0.5, 4.0])


class Linear(LightningModule):
    """loss = <w, c>: every gradient is c, whatever the weights and the batch."""

    def __init__(self, momentum: float):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([3.0, 1.0, -1.0, 2.0]))
        self.momentum = momentum

    def training_step(self, batch, batch_idx):
        return (self.w * C).sum() + 0.0 * batch[0].sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=self.momentum)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.zeros(16, 1)), batch_size=2)


class CheckMomentum(Callback):
    """In every worker (an assertion there fails the launch): the optimizer holds 0.4, the strategy kept 0.9."""

    def on_train_start(self, trainer, pl_module):
        assert abs(trainer.optimizers[0].param_groups[0]["momentum"] - 0.4) < 1e-12
        assert trainer.strategy.momentum_from == [0.9]
        self.checked = True

    def on_train_end(self, trainer, pl_module):
        assert self.checked


def heavy_ball(w0: torch.Tensor, pushes: int, lr: float, momentum: float, workers: int = 2) -> torch.Tensor:
    """torch.optim.SGD's momentum on ``pushes`` gradients equal to C / workers."""
    w = nn.Parameter(w0.clone())
    opt = torch.optim.SGD([w], lr=lr, momentum=momentum)
    for _ in range(pushes):
        w.grad = C / workers
        opt.step()
    return w.detach()


def test_async_servers_step_with_the_compensated_momentum():
    """2 async workers, 3 steps each, momentum 0.9: the servers stepped with 0.9 − (1 − 1/2) = 0.4 (6 pushes), the
    workers' optimizers show 0.4 and the strategy kept 0.9 (uncompensated, the servers would end elsewhere)."""
    model = Linear(momentum=0.9)
    w0 = model.w.detach().clone()
    fit(ParameterServerStrategy(mode="async", num_servers=1, implicit_momentum="compensate", start_method="fork"),
        model, devices=2, max_steps=3, callbacks=[CheckMomentum()])  # fmt: skip
    torch.testing.assert_close(model.w.detach(), heavy_ball(w0, 6, 0.1, 0.4), rtol=0, atol=1e-5)
    assert (heavy_ball(w0, 6, 0.1, 0.9) - heavy_ball(w0, 6, 0.1, 0.4)).abs().min() > 0.05


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"implicit_momentum": "compensate"}, r"ParameterServerStrategy\(implicit_momentum='compensate'\): 'compensate' "
                                          r"lowers the momentum that asynchronous workers add .*mode='sync' is not mode='async'"),
    ({"mode": "ssp", "implicit_momentum": "compensate"}, r"mode='ssp' is not mode='async'"),
    ({"mode": "easgd", "implicit_momentum": "compensate"}, r"mode='easgd' is not mode='async'"),
    ({"mode": "async", "implicit_momentum": "undo"}, r"\(implicit_momentum='undo'\): implicit_momentum must be None or 'compensate'"),
])  # fmt: skip
def test_compensate_is_refused_outside_async(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParameterServerStrategy(**kwargs)
