"""Tier 1: the worker-side optimizer layout and the shard's compact pushes, in one process."""

import pytest
import torch
from torch import nn

from lightning_pdist.parameter_server.sharding import param_specs, plan_sharding
from lightning_pdist.parameter_server.layout import OptimizerLayout, accumulate_grads
from lightning_pdist.parameter_server.shard import ParameterShard, parse_present


def test_pack_then_expand_round_trips_and_skips_missing_gradients():
    """pack sends optimizer k's present slices only; the server's expand puts them back in place, zeros elsewhere."""
    net = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    opts = [torch.optim.SGD(net[0].parameters(), lr=0.1), torch.optim.Adam(net[1].parameters())]
    plan = plan_sharding(param_specs(net), 2, "memory")
    layout = OptimizerLayout(list(net.named_parameters()), opts, plan)
    grads = {"0.weight": torch.randn(2, 3), "0.bias": None}
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    full = torch.cat([grads["0.weight"].reshape(-1), torch.zeros(2 + 4 + 2)])
    for server in range(2):
        compact, present = layout.pack(server, 0, grads)
        shard = ParameterShard(plan.gather(flat, server), layout.segments(server), [("SGD", [{"lr": 0.1}]), ("Adam", [{}])])
        expanded = shard.expand(compact, 0, parse_present(present, len(shard.pieces[0])))
        torch.testing.assert_close(expanded, plan.gather(full, server))
    assert accumulate_grads(accumulate_grads(None, {"a": None}), {"a": torch.ones(1)})["a"].item() == 1.0
    sparse = {"0.weight": grads["0.weight"].to_sparse(), "0.bias": None}  # an embedding's gradient is pushed dense
    assert [layout.pack(s, 0, sparse)[0].tolist() for s in range(2)] == [layout.pack(s, 0, grads)[0].tolist() for s in range(2)]


def test_bad_layouts_and_pushes_are_refused():
    """A parameter in two optimizers, a foreign tensor, a bad present string, a compact gradient of the wrong size."""
    net = nn.Linear(2, 2)
    plan = plan_sharding(param_specs(net), 1, "memory")
    shared = [torch.optim.SGD(net.parameters(), lr=0.1), torch.optim.SGD([net.bias], lr=0.1)]
    with pytest.raises(ValueError, match=r"parameter 'bias' is in optimizer 0 and optimizer 1"):
        OptimizerLayout(list(net.named_parameters()), shared, plan, "PS")
    foreign = [torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1)]
    with pytest.raises(ValueError, match=r"optimizer 0 \(SGD\) param group 0 holds a tensor of shape \(3,\) that is not a parameter"):
        OptimizerLayout(list(net.named_parameters()), foreign, plan, "PS")
    with pytest.raises(ValueError, match=r"present='10x': must be a string of 3 '0'/'1' characters"):
        parse_present("10x", 3)
    shard = ParameterShard(torch.zeros(6), [(0, 0, 4), (0, 0, 2)], [("SGD", [{"lr": 0.1}])])
    with pytest.raises(ValueError, match="gradient of 3 elements; optimizer 0's present pieces on this shard hold 4"):
        shard.expand(torch.zeros(3), 0, [True, False])
    with pytest.raises(ValueError, match=r"optimizer=1: must be in \[0, 1\)"):
        shard.apply_(torch.zeros(6), 1)
