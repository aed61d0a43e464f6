"""The asynchrony-as-momentum rule (core/momentum.py), shared by AD-PSGD and the parameter server's async mode."""

import pytest
import torch

from lightning_pdist.core.momentum import compensate_optimizers, compensated_momentum, implicit_momentum


def test_the_rule_and_what_it_does_to_optimizers():
    assert implicit_momentum(1) == 0.0 and implicit_momentum(4) == 0.75
    assert compensated_momentum(0.9, 1) == 0.9 and abs(compensated_momentum(0.9, 2) - 0.4) < 1e-12
    assert compensated_momentum(0.5, 4) == 0.0  # floored at 0
    w = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
    sgd = torch.optim.SGD([{"params": [w[0]], "momentum": 0.9}, {"params": [w[1]], "momentum": 0.2}], lr=0.1)
    adam = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], betas=(0.95, 0.999))
    before, warning = compensate_optimizers([sgd, adam], 2, "Owner")
    assert before == [0.9, 0.2, 0.95]
    assert [g["momentum"] for g in sgd.param_groups] == pytest.approx([0.4, 0.0])
    assert adam.param_groups[0]["betas"] == pytest.approx((0.45, 0.999))
    assert warning.startswith("Owner(implicit_momentum='compensate'): 2 asynchronous workers imply momentum 1 − 1/2")
    assert compensate_optimizers([torch.optim.SGD(w, lr=0.1, momentum=0.9)], 2, "Owner")[1] is None
    with pytest.raises(ValueError, match=r"Owner\(implicit_momentum='compensate'\): Adagrad has neither 'momentum' nor 'betas'"):
        compensate_optimizers([torch.optim.Adagrad(w)], 2, "Owner")
