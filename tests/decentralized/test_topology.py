"""Tier 1: the graphs, the mixing step, the implicit-momentum rule, and every refusal (no process is started)."""

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry

from lightning_pdist import DecentralizedStrategy
from lightning_pdist.decentralized.topology import (bipartite_edges, compensated_momentum, mix, mixing_matrix,
                                                    neighbour_sets)  # fmt: skip


@pytest.mark.parametrize("topology, n", [("ring", 2), ("ring", 5), ("torus", 6), ("torus", 9), ("exponential", 8),
                                         ("exponential", 6), ("complete", 3)])  # fmt: skip
def test_named_graphs_are_regular_and_give_doubly_stochastic_symmetric_weights(topology, n):
    nbrs = neighbour_sets(topology, n)
    assert all(i not in s and all(i in nbrs[j] for j in s) for i, s in enumerate(nbrs))  # undirected, no self-loops
    assert len({len(s) for s in nbrs}) == 1  # regular, so 1/(deg+1) is doubly stochastic
    w = mixing_matrix(topology, n)
    torch.testing.assert_close(w.sum(0), torch.ones(n, dtype=torch.float64))
    torch.testing.assert_close(w.sum(1), torch.ones(n, dtype=torch.float64))
    torch.testing.assert_close(w, w.T)
    deg = len(nbrs[0])
    assert all(abs(float(w[i, j]) - 1 / (deg + 1)) < 1e-15 for i in range(n) for j in nbrs[i] | {i})


def test_graphs_by_hand():
    assert neighbour_sets("ring", 4)[0] == {1, 3}
    assert neighbour_sets("exponential", 8)[0] == {1, 2, 4, 7, 6}  # ± 2^k for 2^k < 8
    assert neighbour_sets("torus", 6)[0] == {3, 1, 2}  # 2 × 3: up = down = 3, left 2, right 1
    assert neighbour_sets("complete", 3)[1] == {0, 2}
    assert bipartite_edges(mixing_matrix("complete", 3)) == [{1}, {0, 2}, {1}]  # 0–2 joins two active ranks


def test_mix_is_the_row_of_w_times_the_models():
    w = mixing_matrix("ring", 5)
    x = torch.randn(5, 7)
    for i in range(5):
        got = mix(x[i], {j: x[j] for j in range(5) if j != i and w[i, j] > 0}, {j: float(w[i, j]) for j in range(5)},
                  float(w[i, i]))  # fmt: skip
        torch.testing.assert_close(got, (w.float() @ x)[i])


def test_compensated_momentum_rule():
    """μ' = max(0, μ − (1 − 1/M)): 0.9 on 4 asynchronous ranks → 0.15; on one rank unchanged; floored at 0."""
    assert abs(compensated_momentum(0.9, 4) - 0.15) < 1e-12
    assert compensated_momentum(0.9, 1) == 0.9
    assert abs(compensated_momentum(0.9, 2) - 0.4) < 1e-12
    assert compensated_momentum(0.5, 4) == 0.0


@pytest.mark.parametrize("kwargs, message", [
    (dict(topology="star"), r"DecentralizedStrategy\(topology='star'\): unknown topology; choose one of 'ring'"),
    (dict(topology=[[0.5, 0.5], [0.2, 0.8]]), r"must be doubly stochastic .* column sums \[0.7, 1.3\]"),
    (dict(topology=[[1.5, -0.5], [-0.5, 1.5]]), r"finite, non-negative weights"),
    (dict(topology=[[1.0, 0.0]]), r"must be square .* got shape \(1, 2\)"),
    (dict(mode="gossip"), r"DecentralizedStrategy\(mode='gossip'\): mode must be 'sync'"),
    (dict(implicit_momentum="compensate"), r"mode='sync' \(D-PSGD\) has no asynchrony"),
    (dict(mode="async", implicit_momentum="undo"), r"implicit_momentum must be None or 'compensate'"),
    (dict(torus_shape=(2, 2)), r"torus_shape is for topology='torus' only"),
    (dict(topology="torus", torus_shape=(1, 4)), r"two ints >= 2"),
    (dict(ddp_comm_hook=lambda s, b: None), r"ddp_comm_hook.* owns all communication"),
])  # fmt: skip
def test_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DecentralizedStrategy(**kwargs)


def test_ddp_only_arguments_are_refused():
    with pytest.raises(TypeError, match=r"never wraps the model in DistributedDataParallel"):
        DecentralizedStrategy(find_unused_parameters=True)


@pytest.mark.parametrize("devices, kwargs, message", [
    (3, dict(topology="torus"), r"topology=.torus.\): needs at least 4 ranks; the run has 3"),
    (5, dict(topology="torus"), r"5 ranks cannot form an r × c torus .* \(5 is prime\)"),
    (4, dict(topology="torus", torus_shape=(2, 3)), r"a 2 × 3 torus needs exactly 6 ranks; the run has 4"),
    (2, dict(topology=torch.full((3, 3), 1 / 3)), r"the mixing matrix is 3 × 3 but the run has 2 ranks"),
    (2, dict(topology=torch.eye(2), mode="async"), r"mode='async': AD-PSGD averages only across the even"),
])  # fmt: skip
def test_refused_when_the_trainer_is_built(devices, kwargs, message):
    """What needs the number of ranks is refused by Trainer(...) (devices × num_nodes), before any process starts."""
    with pytest.raises(ValueError, match=message):
        Trainer(accelerator="cpu", devices=devices, strategy=DecentralizedStrategy(**kwargs), logger=False)


def test_registered_names():
    assert StrategyRegistry["dpsgd"]["strategy"] is DecentralizedStrategy
    assert StrategyRegistry["adpsgd"]["init_params"] == {"mode": "async"}
    assert DecentralizedStrategy.registered_name(DecentralizedStrategy(mode="async")) == "adpsgd"
    assert "dpsgd_find_unused_parameters_true" not in StrategyRegistry
