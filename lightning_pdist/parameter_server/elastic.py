"""Asynchronous elastic averaging (EASGD / EAMSGD) on parameter servers, as pure single-process pieces.

Zhang, Choromanska & LeCun, *Deep learning with Elastic Averaging SGD*, NeurIPS 2015, Algorithm 1 (asynchronous
EASGD) and Algorithm 2 (EAMSGD). The servers hold the center ``x̃``, sharded like the parameters; worker ``i``
trains its own ``x_i`` with its local optimizer (SGD for EASGD; SGD with Nesterov momentum ``δ`` for EAMSGD) and,
every ``τ`` local steps, makes one elastic exchange with every server, each on its own shard::

    e   = α · (x_i − x̃)          # with the center as this server holds it now
    x_i ← x_i − e                 # the worker moves towards the center
    x̃  ← x̃ + e                  # the center moves towards the worker, by the same e

The worker sends ``x_i``'s shard; the server computes ``e`` against its current ``x̃``, adds it and answers ``e``,
which the worker subtracts. The paper's worker reads ``x̃``, computes ``e`` and pushes it in two messages; here
the read and the push are one request, applied atomically in the server's arrival order, so no other worker's
exchange lands between them (the paper's rule when none does; without the lost update when one would have).
There is no barrier: each worker exchanges on its own clock.

Properties (tested): every exchange conserves ``x_i + x̃`` (the worker subtracts the very ``e`` the server adds);
``α = 1`` swaps ``x_i`` and ``x̃``; with one worker the run is the rule above written out in plain torch.

Advice: the paper sets ``β = N·α = 0.9`` (``α = 0.9 / N``, the default), ``τ`` in {1, 4, 16, 64}, and
for EAMSGD ``δ = 0.99``; asynchrony adds momentum of its own (``docs/algorithms/parameter_server.md``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["ElasticCenter", "default_alpha", "elastic_difference"]


def default_alpha(num_workers: int) -> float:
    """``α = 0.9 / N``: the paper's ``β = N·α = 0.9``."""
    return 0.9 / num_workers


def _check_alpha(owner: str, alpha: object) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise TypeError(f"{owner}(alpha={alpha!r}): alpha must be a number in (0, 1]")
    if not (math.isfinite(alpha) and 0.0 < alpha <= 1.0):
        raise ValueError(f"{owner}(alpha={alpha}): alpha must be in (0, 1]")
    return float(alpha)


@torch.no_grad()
def elastic_difference(local: Tensor, center: Tensor, alpha: float) -> Tensor:
    """``e = α·(x_i − x̃)``, a new tensor; the worker subtracts it, the center adds it."""
    alpha = _check_alpha("elastic_difference", alpha)
    if local.shape != center.shape or local.dtype != center.dtype:
        raise ValueError(f"elastic_difference(local={tuple(local.shape)} {local.dtype}, center={tuple(center.shape)} "
                         f"{center.dtype}): local and center must have the same shape and dtype")  # fmt: skip
    return (local - center).mul_(alpha)


class ElasticCenter:
    """One server's part of the center ``x̃`` and its exchanges.

    Args:
        center: the shard of ``x̃``, updated in place (a server passes its shard's flat buffer).
        alpha: ``α`` in ``(0, 1]``.
    """

    def __init__(self, center: Tensor, alpha: float) -> None:
        self.center = center
        self.alpha = _check_alpha("ElasticCenter", alpha)
        self.exchanges = 0

    @torch.no_grad()
    def exchange(self, local: Tensor) -> Tensor:
        """One elastic exchange with a worker's ``x_i`` (this shard): ``x̃ ← x̃ + e``; returns ``e``."""
        e = elastic_difference(local, self.center, self.alpha)
        self.center.add_(e)
        self.exchanges += 1
        return e

    def state_dict(self) -> dict:
        return {"alpha": self.alpha, "exchanges": self.exchanges}

    def load_state_dict(self, state: dict) -> None:
        exchanges = state.get("exchanges", 0)
        if isinstance(exchanges, bool) or not isinstance(exchanges, int) or exchanges < 0:
            raise ValueError(f"ElasticCenter.load_state_dict: exchanges={exchanges!r} must be an int >= 0")
        self.exchanges = exchanges
