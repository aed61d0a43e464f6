"""Double DQN's n-step TD error and its loss (van Hasselt et al. 2016; Ape-X's learner, Horgan et al. 2018).

``δ_i = G_i + d_i · Q_target(s'_i, argmax_a Q(s'_i, a)) − Q(s_i, a_i)`` (``d_i = γ^k`` or 0, see
:mod:`~lightning_pdist.rl.nstep`); the loss is ``mean_i w_i · huber(δ_i)`` with the importance weights ``w_i`` of the
prioritized replay (all 1 for uniform replay).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["double_q_td", "weighted_huber"]


def double_q_td(q_net: nn.Module, target_net: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """``δ`` per transition; gradients flow through ``Q(s, a)`` only."""
    q = q_net(batch["obs"]).gather(1, batch["action"].long().unsqueeze(1)).squeeze(1)
    with torch.no_grad():
        best = q_net(batch["next_obs"]).argmax(dim=1, keepdim=True)
        bootstrap = target_net(batch["next_obs"]).gather(1, best).squeeze(1)
        target = batch["ret"] + batch["discount"] * bootstrap
    return target - q


def weighted_huber(td: Tensor, weights: Tensor | None = None) -> Tensor:
    """``mean(w · huber(δ))`` (Huber with threshold 1: ½δ² inside, |δ| − ½ outside)."""
    loss = F.huber_loss(td, torch.zeros_like(td), reduction="none", delta=1.0)
    return (loss if weights is None else weights * loss).mean()
