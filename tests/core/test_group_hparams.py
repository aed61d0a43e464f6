"""``core.ps_client.group_hparams``: what a worker (the parameter server's, Parallax's, Gorila's learner) sends in
``INIT`` for each param group, from which the servers rebuild the optimizer."""

import pytest
import torch

from lightning_pdist.core.ps_client import group_hparams


def test_json_values_pass_tuples_become_lists_and_one_element_tensors_numbers():
    weight = torch.nn.Parameter(torch.zeros(3))
    group = torch.optim.Adam([weight], lr=torch.tensor(0.01), betas=(0.8, 0.9)).param_groups[0]
    out = group_hparams(group, "where")
    assert "params" not in out
    assert out["betas"] == [0.8, 0.9] and out["lr"] == pytest.approx(0.01) and isinstance(out["lr"], float)
    assert out["amsgrad"] is False and out["foreach"] is None


def test_a_value_the_servers_cannot_rebuild_from_is_refused_naming_where_and_the_key():
    with pytest.raises(TypeError, match=r"^GorilaStrategy: param group 1 has fused_fn=<lambda>; the servers rebuild"):
        group_hparams({"params": [], "lr": 0.1, "fused_fn": type("F", (), {"__repr__": lambda s: "<lambda>"})()},
                      "GorilaStrategy: param group 1")
