"""Two small sparse-embedding modules for real-process tests, and their plain-torch gradients.

* :class:`Bag`: ``SparseBagClassifier`` (``EmbeddingBag(sparse=True)``, mean, cross-entropy, Adagrad) on 48 reviews of
  6 ids from the lower half of a 40-row table: the upper half is never indexed, so those rows must stay bit-identical.
* :class:`LinearBag`: ``loss = Σ_b <Σ_{r in x_b} E[r], c[y_b]>`` (an ``EmbeddingBag(mode="sum", sparse=True)``, no
  head): the table's gradient ``∂L/∂E[r] = Σ_{b, r in x_b} c[y_b]`` does not depend on the weights, so any mix of
  stale reads, pairwise averages and arrival orders ends at a sum that one process can write down. Integers and
  ``lr = 0.5`` keep every sum exact in fp32, in any order. SGD (it steps sparse gradients: no momentum, no decay).
"""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from _helpers import fit, rank_batches
from lightning_pdist.models import SparseBagClassifier

ROWS, DIM, N, B = 40, 4, 48, 4
USED = ROWS // 2  # ids drawn from [1, USED): rows USED.. are never touched
C = torch.tensor([[1.0, -2.0, 0.0, 3.0], [-1.0, 1.0, 2.0, -3.0]])  # c[y]: the gradient each id of a class-y review gets


def bag_data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randint(1, USED, (N, 6), generator=g), torch.randint(0, 2, (N,), generator=g))


class Bag(SparseBagClassifier):
    """The suite's sparse text model, small: a 40 x 4 table and a linear head, Adagrad (table lr, head lr)."""

    def __init__(self, lr: float = 0.5, head_lr: float = 0.1):
        super().__init__(vocab_size=ROWS, embed_dim=DIM, lr=lr, head_lr=head_lr)

    def train_dataloader(self):
        return DataLoader(bag_data(), batch_size=B)


class LinearBag(LightningModule):
    """A table whose gradient does not depend on its weights (see the module docstring); integer start."""

    def __init__(self, lr: float = 0.5):
        super().__init__()
        self.table = nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True)
        g = torch.Generator().manual_seed(1)
        self.table.weight.data.copy_(torch.randint(-64, 64, (ROWS, DIM), generator=g).float())
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return (self.table(x) * C[y]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        return DataLoader(bag_data(), batch_size=B)


def linear_grad(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``∂L/∂E`` of :class:`LinearBag` on one batch, dense, written out: each id of review ``b`` gets ``c[y_b]``."""
    grad = torch.zeros(ROWS, DIM)
    grad.index_add_(0, x.reshape(-1), C[y].repeat_interleave(x.shape[1], dim=0))
    return grad


def linear_sum(world: int, steps: int) -> torch.Tensor:
    """``Σ`` over ranks and their first ``steps`` batches (Lightning's shuffled shards) of :func:`linear_grad`."""
    total = torch.zeros(ROWS, DIM)
    for rank in range(world):
        for x, y in rank_batches(bag_data(), rank, world, B)[:steps]:
            total += linear_grad(x, y)
    return total


def assert_only_used_rows_moved(table: torch.Tensor, table0: torch.Tensor) -> None:
    """The rows some batch indexed moved; the rows no batch touches are bit-identical to the start."""
    assert torch.equal(table[USED:], table0[USED:])
    assert not torch.equal(table[:USED], table0[:USED])


def linear_bag_lands_every_push(strategy, atol: float) -> None:
    """4 steps of :class:`LinearBag` on 2 ranks under ``strategy``: the table is ``E0 − lr·Σg/2`` (every push landed,
    in whatever order) and its never-indexed rows are bit-identical to the start."""
    linear = LinearBag()
    e0 = linear.table.weight.detach().clone()
    fit(strategy, linear, max_steps=4)
    expected = e0 - linear.lr * linear_sum(world=2, steps=4) / 2
    torch.testing.assert_close(linear.table.weight.detach(), expected, atol=atol, rtol=0)
    assert torch.equal(linear.table.weight.detach()[USED:], e0[USED:])
    assert not torch.equal(expected, e0)
