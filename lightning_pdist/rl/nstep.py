"""n-step transitions from one actor's stream of environment steps (Ape-X, Horgan et al. 2018, eq. 1).

For the step taken in ``s_t`` with action ``a_t`` the actor emits, once ``n`` further rewards are known or the episode
ends, ``(s_t, a_t, G_t, s_{t+k}, d_t)`` with ``k = min(n, steps left in the episode)``,
``G_t = Σ_{j<k} γ^j r_{t+j}`` and ``d_t = γ^k`` times 0 if the episode terminated within those ``k`` steps (no
bootstrap from a terminal state) and 1 otherwise (a truncated episode, a time limit, still bootstraps from its last
observation). The learner's target is then ``G_t + d_t · Q_target(s_{t+k}, argmax_a Q(s_{t+k}, a))``.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from torch import Tensor

__all__ = ["NStep", "stack"]


class NStep:
    """Pending steps of the current episode; :meth:`push` returns the transitions that became complete."""

    def __init__(self, n: int, gamma: float) -> None:
        self.n, self.gamma = n, float(gamma)
        self.pending: deque[tuple[Tensor, int, float]] = deque()

    def _emit(self, next_obs: Tensor, terminated: bool) -> dict[str, Any]:
        obs, action, _ = self.pending[0]
        ret, scale = 0.0, 1.0
        for _, _, reward in self.pending:
            ret += scale * reward
            scale *= self.gamma
        self.pending.popleft()
        return {"obs": obs, "action": action, "ret": ret, "next_obs": next_obs,
                "discount": 0.0 if terminated else scale}  # fmt: skip

    def push(self, obs: Tensor, action: int, reward: float, next_obs: Tensor, terminated: bool,
             truncated: bool) -> list[dict[str, Any]]:  # fmt: skip
        self.pending.append((obs, int(action), float(reward)))
        out = []
        if terminated or truncated:
            while self.pending:
                out.append(self._emit(next_obs, terminated))
        elif len(self.pending) == self.n:
            out.append(self._emit(next_obs, False))
        return out

    def clear(self) -> None:
        """Drop the pending steps (the episode cannot continue: a resumed actor starts a new one)."""
        self.pending.clear()


def stack(transitions: list[dict[str, Any]], obs_shape: tuple[int, ...]) -> dict[str, Tensor]:
    """Rows of a batch (float32 observations, int64 actions, float32 returns and discounts)."""
    if not transitions:
        empty = torch.zeros((0, *obs_shape), dtype=torch.float32)
        return {"obs": empty, "action": torch.zeros(0, dtype=torch.long), "ret": torch.zeros(0),
                "next_obs": empty.clone(), "discount": torch.zeros(0)}  # fmt: skip
    return {
        "obs": torch.stack([t["obs"] for t in transitions]).float(),
        "action": torch.tensor([t["action"] for t in transitions], dtype=torch.long),
        "ret": torch.tensor([t["ret"] for t in transitions], dtype=torch.float32),
        "next_obs": torch.stack([t["next_obs"] for t in transitions]).float(),
        "discount": torch.tensor([t["discount"] for t in transitions], dtype=torch.float32),
    }
