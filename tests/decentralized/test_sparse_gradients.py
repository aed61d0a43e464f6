"""Tier 3: row-sparse embedding gradients (``EmbeddingBag(sparse=True)``) under D-PSGD and AD-PSGD in real runs.

The gossip moves parameters (dense); each rank's own optimizer applies its own sparse gradient after the mixing.
D-PSGD is deterministic, so the module after fit (the average of the ranks) is checked against Lian et al.'s rule
with torch's sparse Adagrad per rank, in one process. AD-PSGD's pairings depend on timing, but a pairwise average
keeps the sum of the ranks' models, so with a gradient that does not depend on the weights the average ends at
``E0 − lr·Σg/N`` whatever the pairings were.
"""

import torch
from _helpers import fit, rank_batches
from _sparse_bag import B, Bag, assert_only_used_rows_moved, bag_data, linear_bag_lands_every_push

from lightning_pdist import DecentralizedStrategy


def dpsgd_adagrad(start: dict, weights: torch.Tensor, steps: int) -> list[Bag]:
    """Algorithm 1 with Adagrad: ``x_i(t+1) = Σ_j W_ij x_j(t)``, then rank i's Adagrad steps with ``∇F_i(x_i(t))``
    (a sparse gradient for the table), each rank with its own Adagrad state."""
    world = weights.shape[0]
    ranks = [Bag() for _ in range(world)]
    for m in ranks:
        m.load_state_dict(start)
    opts = [m.configure_optimizers() for m in ranks]
    shards = [rank_batches(bag_data(), r, world, B) for r in range(world)]
    for t in range(steps):
        grads = []
        for r, m in enumerate(ranks):
            m.zero_grad(set_to_none=True)
            x, y = shards[r][t]
            torch.nn.functional.cross_entropy(m(x), y).backward()
            grads.append([p.grad for p in m.parameters()])
        assert grads[0][0].is_sparse
        old = [[p.detach().clone() for p in m.parameters()] for m in ranks]
        for r, m in enumerate(ranks):
            with torch.no_grad():
                for k, p in enumerate(m.parameters()):
                    p.copy_(sum(float(weights[r, j]) * old[j][k] for j in range(world)))
                    p.grad = grads[r][k]
            opts[r].step()
    return ranks


def test_sparse_table_under_dpsgd_is_the_rule_and_under_adpsgd_keeps_the_sum():
    """2 ranks, complete graph. D-PSGD, 3 steps of the suite's sparse text model (Adagrad): the average of the ranks
    equals the rule's (1e-6). AD-PSGD, 4 steps of LinearBag (SGD): the average is E0 − lr·Σg/2. Both: the table
    moved and its never-indexed rows are bit-identical to the start."""
    torch.manual_seed(0)
    module = Bag()
    start = {k: v.clone() for k, v in module.state_dict().items()}
    fit(DecentralizedStrategy(topology="complete", start_method="fork"), module, max_steps=3)
    ranks = dpsgd_adagrad(start, torch.full((2, 2), 0.5), steps=3)
    for name, got in module.state_dict().items():
        want = torch.stack([m.state_dict()[name] for m in ranks]).mean(0)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0, msg=name)
    assert_only_used_rows_moved(module.model.embedding.weight.detach(), start["model.embedding.weight"])
    linear_bag_lands_every_push(DecentralizedStrategy(topology="complete", mode="async", start_method="fork"), atol=1e-6)
