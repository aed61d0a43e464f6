"""What Hogwild! refuses, with the message a user sees: at construction, when the Trainer is built, at setup."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer

from _helpers import TinyRegression, fit
from lightning_pdist import HogwildStrategy
from lightning_pdist.shared_memory.svrg import variance_reduced


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"lock": "yes"}, TypeError, r"HogwildStrategy\(lock='yes'\): lock must be True .* or False"),
    ({"variance_reduction": "saga"}, ValueError, r"HogwildStrategy\(variance_reduction='saga'\): variance_reduction must be None .* or 'svrg'"),
    ({"variance_reduction": "svrg", "snapshot_every_epochs": 0}, ValueError, r"\(snapshot_every_epochs=0\): snapshot_every_epochs must be an int >= 1"),
    ({"variance_reduction": "svrg", "snapshot_every_epochs": 1.5}, TypeError, r"\(snapshot_every_epochs=1.5\): snapshot_every_epochs must be an int"),
    ({"implicit_momentum": "always"}, ValueError, r"HogwildStrategy\(implicit_momentum='always'\): implicit_momentum must be None or 'compensate'"),
    ({"snapshot_every_epochs": 2}, ValueError, r"\(snapshot_every_epochs=2\): snapshot_every_epochs only applies with variance_reduction='svrg'"),
    ({"ddp_comm_hook": print}, ValueError, r"HogwildStrategy\(ddp_comm_hook=.*\): Hogwild! has no gradient communication"),
    ({"find_unused_parameters": True}, TypeError, r"HogwildStrategy\(find_unused_parameters=True\): HogwildStrategy never wraps the model"),
    ({"parallel_devices": [torch.device("cuda", 0)]}, ValueError, r"HogwildStrategy\(accelerator='cuda'\): .* Use accelerator='cpu'"),
])  # fmt: skip
def test_bad_arguments_are_refused_at_construction(kwargs, error, message):
    with pytest.raises(error, match=message):
        HogwildStrategy(**kwargs)


def test_several_nodes_are_refused_when_the_trainer_is_built():
    with pytest.raises(ValueError, match=r"HogwildStrategy\(num_nodes=2\): Hogwild! shares the parameters through one "
                                         r"machine's memory, so every process must run on one node"):  # fmt: skip
        Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy=HogwildStrategy(), logger=False)


class Manual(TinyRegression):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        opt.step()


def test_svrg_refuses_manual_optimization_at_setup_and_its_rule_is_svrgs():
    with pytest.raises(ValueError, match=r"HogwildStrategy\(variance_reduction='svrg'\): AsySVRG needs automatic "
                                         r"optimization and one optimizer \(this module: automatic_optimization=False"):  # fmt: skip
        fit(HogwildStrategy(variance_reduction="svrg"), Manual(), devices=1, max_steps=2)  # one process: in this one
    g, gs, mu = torch.tensor([1.0, 2.0]), torch.tensor([0.5, 4.0]), torch.tensor([0.25, 0.25])
    sparse = torch.sparse_coo_tensor([[1]], [3.0], (2,))
    assert torch.equal(variance_reduced([g, sparse], [gs, gs], [mu, mu])[0], torch.tensor([0.75, -1.75]))
    assert torch.equal(variance_reduced([g, sparse], [gs, gs], [mu, mu])[1], torch.tensor([-0.25, -0.75]))
