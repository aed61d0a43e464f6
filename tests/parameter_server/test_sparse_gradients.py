"""Tier 3: row-sparse embedding gradients (``EmbeddingBag(sparse=True)``) through real parameter servers, vs plain torch.

The worker hands each server the dense slice of a sparse gradient (``layout.pack``); the servers step whole slices.
Sync: the servers' Adagrad on the mean of the workers' gradients equals torch's sparse Adagrad on that mean in one
process. Async (Downpour): every push lands as one SGD step on ``g/N``, in whatever order; with a gradient that does
not depend on the weights that ends at ``E0 − lr·Σ g / N`` exactly. Rows no batch touches stay bit-identical in both.
"""

import torch
from _helpers import fit, rank_batches
from _sparse_bag import B, Bag, assert_only_used_rows_moved, bag_data, linear_bag_lands_every_push

from lightning_pdist import ParameterServerStrategy


def adagrad_on_the_mean(module: Bag, world: int, steps: int) -> Bag:
    """The sync rule in one process: per step, the mean of the ranks' (sparse) gradients, one torch Adagrad step."""
    ref = Bag()
    ref.load_state_dict(module.state_dict())
    opt = ref.configure_optimizers()
    shards = [rank_batches(bag_data(), r, world, B) for r in range(world)]
    for t in range(steps):
        per_rank = []
        for r in range(world):
            ref.zero_grad(set_to_none=True)
            x, y = shards[r][t]
            torch.nn.functional.cross_entropy(ref(x), y).backward()
            per_rank.append([p.grad for p in ref.parameters()])
        for p, gs in zip(ref.parameters(), zip(*per_rank)):
            p.grad = sum(gs[1:], gs[0]) / world  # sparse + sparse stays sparse: torch's sparse Adagrad steps it
        assert ref.model.embedding.weight.grad.is_sparse
        opt.step()
    return ref


def test_sparse_table_sync_is_adagrad_on_the_mean_and_async_lands_every_push():
    """2 workers, 2 servers. Sync, 3 steps of the suite's sparse text model (Adagrad): every parameter equals the
    one-process rule (1e-6). Async, 4 steps of LinearBag (SGD): the table is E0 − lr·Σg/2 exactly. Both: the table
    moved and its never-indexed rows are bit-identical to the start."""
    torch.manual_seed(0)
    module = Bag()
    start = {k: v.clone() for k, v in module.state_dict().items()}
    fit(ParameterServerStrategy(num_servers=2, start_method="fork"), module, max_steps=3)
    ref = Bag()
    ref.load_state_dict(start)
    ref = adagrad_on_the_mean(ref, world=2, steps=3)
    for (name, got), want in zip(module.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0, msg=name)
    assert_only_used_rows_moved(module.model.embedding.weight.detach(), start["model.embedding.weight"])
    linear_bag_lands_every_push(ParameterServerStrategy(mode="async", num_servers=2, start_method="fork"), atol=0)
