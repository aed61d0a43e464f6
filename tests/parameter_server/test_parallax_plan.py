"""Tier 1: Parallax's pure pieces (issue 23 item 3, not yet a strategy): which parameters are sparse, the auto rule,
and the memory-balanced row plan, each against a plain-torch or hand-counted reference."""

import pytest
import torch
from torch import nn

from lightning_pdist.parameter_server.parallax import RowPlan, auto_sparse, sparse_parameter_names, sparse_push_bytes


class TextModel(nn.Module):
    def __init__(self, sparse=True):
        super().__init__()
        self.words = nn.Embedding(1000, 8, sparse=sparse)
        self.bag = nn.EmbeddingBag(50, 8, sparse=sparse)
        self.head = nn.Linear(8, 2)


def test_sparse_parameters_are_the_sparse_embeddings_and_the_named_ones():
    assert sparse_parameter_names(TextModel()) == ["words.weight", "bag.weight"]
    assert sparse_parameter_names(TextModel(sparse=False), ["bag.weight"]) == ["bag.weight"]
    with pytest.raises(ValueError, match=r"parallax: the module has no sparse parameter: no nn.Embedding"):
        sparse_parameter_names(TextModel(sparse=False))
    with pytest.raises(ValueError, match=r"sparse_params=\['head.bias'\]\): 'head.bias' has shape \(2,\); .* \(2-D\)"):
        sparse_parameter_names(TextModel(), ["head.bias"])
    with pytest.raises(ValueError, match=r"sparse_params=\['nope'\]\): 'nope' is not a parameter of the module"):
        sparse_parameter_names(TextModel(), ["nope"])


def test_the_auto_rule_and_the_bytes_of_a_sparse_push():
    assert auto_sparse(50, 1000) and not auto_sparse(100, 1000) and auto_sparse(100, 1000, threshold=0.2)
    with pytest.raises(ValueError, match=r"auto_sparse\(threshold=0\): threshold must be in \(0, 1\]"):
        auto_sparse(1, 10, threshold=0)
    assert sparse_push_bytes(3, 8) == 3 * (8 + 32)


@pytest.mark.parametrize("servers", [1, 2, 3, 7])
def test_the_row_plan_balances_bytes_and_every_row_has_one_server(servers):
    """Each server holds at most B/S plus one row; the ranges cover every row once; split agrees with the ranges."""
    tables = (("a", 1000, 8), ("b", 50, 8), ("c", 37, 3))
    plan = RowPlan(tables, servers)
    total = sum(r * d * 4 for _, r, d in tables)
    assert sum(plan.bytes_per_server()) == total
    assert max(plan.bytes_per_server()) <= total / servers + 8 * 4
    for name, rows, _ in tables:
        owners = plan.server_of(name, torch.arange(rows))
        expected = torch.full((rows,), -1)
        for s in range(servers):
            lo, hi = plan.rows_of(s).get(name, (0, 0))
            expected[lo:hi] = s
        assert torch.equal(owners, expected)  # contiguous ranges, every row exactly once
        touched = torch.tensor([5, 5, rows - 1, 0, rows // 2])
        parts = plan.split(name, touched)
        assert torch.equal(torch.sort(torch.cat(parts)).values, torch.unique(touched))
        assert all(bool((plan.server_of(name, p) == s).all()) for s, p in enumerate(parts))


def test_a_bad_plan_is_refused():
    with pytest.raises(ValueError, match=r"RowPlan\(num_servers=0\): num_servers must be an int >= 1"):
        RowPlan((("a", 3, 2),), 0)
    with pytest.raises(ValueError, match=r"'a' has 0 rows of 2; both must be >= 1"):
        RowPlan((("a", 0, 2),), 1)
