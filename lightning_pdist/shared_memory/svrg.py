"""AsySVRG's update direction (Zhao & Li, "Fast asynchronous parallel stochastic gradient descent: a lock-free
approach with convergence guarantee", AAAI 2016; SVRG: Johnson & Zhang, NeurIPS 2013).

Every ``m`` epochs (``snapshot_every_epochs``) the processes take a snapshot ``w̃`` of the shared parameters and
compute the full gradient there, sharing the pass (each process sums its own shard, one all-reduce adds them)::

    μ = (1/B) Σ_b ∇f_b(w̃)          (B = the batches of the whole epoch, all processes)

Then each process, lock-free on the shared ``w`` (Hogwild!), steps with the variance-reduced gradient of its batch ``b``::

    v = ∇f_b(w) − ∇f_b(w̃) + μ       w ← w − η v   (or the module's optimizer applied to v)

``E_b[v] = ∇F(w)`` and ``Var v → 0`` as ``w, w̃ → w*``. With one process this is SVRG (option I: the snapshot is
the current iterate at the start of the outer loop).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["snapshot_due", "variance_reduced"]


def snapshot_due(epoch: int, every: int) -> bool:
    """Whether epoch ``epoch`` (0-based) starts with a new snapshot and full gradient."""
    return epoch % every == 0


@torch.no_grad()
def variance_reduced(grads: list[Tensor], snapshot_grads: list[Tensor], mu: list[Tensor]) -> list[Tensor]:
    """``g − g̃ + μ``, tensor by tensor (a sparse embedding gradient becomes dense: μ is dense)."""
    dense = lambda t: t.to_dense() if t.is_sparse else t  # noqa: E731
    return [dense(g) - dense(gs) + m for g, gs, m in zip(grads, snapshot_grads, mu)]
