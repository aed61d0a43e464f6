"""Blockwise model-update filtering (BMUF).

Chen & Huo, *Scalable training of deep learning machines by incremental block training with
intra-block parallel optimization and blockwise model-update filtering*, ICASSP 2016.

Every rank starts a block from the same anchor ``A`` and takes ``period`` local optimizer steps,
reaching ``W_i``. At the block end, with ``η`` the block momentum and ``ζ`` the block learning
rate::

    G   = mean_i(A - W_i)          # the block's "gradient" (positive = descent)
    Δ  ← η·Δ + ζ·G                  # filtered (momentum) block update
    W_g = A - Δ                     # the global model
    S   = W_g - η·Δ   if nesterov   # Nesterov block momentum (NBM): look ahead
        = W_g         otherwise
    every rank loads S;  A ← S

With ``η = 0, ζ = 1`` this is plain model averaging (local SGD): ``W_g = mean_i W_i``.

Advice per hyperparameter:
    * ``block_momentum`` ``η``: ``1 - 1/N`` for ``N`` ranks (CNTK's default; fairseq's 0.875 is
      that value for N = 8). The factor ``(1 - η)`` in CNTK's update is then exactly the ``1/N``
      of the mean, which is why the two codebases agree. Larger ``η`` with a small block count
      overshoots; keep it tied to ``N``.
    * ``block_lr`` ``ζ``: 1.0. Values above 1 extrapolate the block step.
    * ``nesterov``: True (the paper's best variant on speech); fairseq defaults to False.
"""

from __future__ import annotations

import math

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_pdist.averaging.rules import AveragingRule, Replicas
from lightning_pdist.averaging.schedule import PeriodicSchedule

__all__ = ["BMUFConfig", "BMUFRule", "BMUFState", "bmuf_block_update_", "bmuf_global_model"]


@dataclass(frozen=True)
class BMUFConfig:
    """BMUF hyperparameters; checks itself on construction.

    ``block_momentum=None`` resolves to ``1 - 1/world_size`` once the world size is known.
    """

    block_momentum: float | None = None
    block_lr: float = 1.0
    nesterov: bool = True
    owner: str = "BMUFConfig"

    def __post_init__(self) -> None:
        bm = self.block_momentum
        if bm is not None and not _is_number(bm):
            raise TypeError(f"{self.owner}(block_momentum={bm!r}): block_momentum must be a number or None")
        if not _is_number(self.block_lr):
            raise TypeError(f"{self.owner}(block_lr={self.block_lr!r}): block_lr must be a number")
        if not isinstance(self.nesterov, bool):
            raise TypeError(f"{self.owner}(nesterov={self.nesterov!r}): nesterov must be a bool")
        if bm is not None and not (0.0 <= bm < 1.0):
            raise ValueError(f"{self.owner}(block_momentum={bm}): block_momentum must be in [0, 1) or None")
        if not (self.block_lr > 0 and math.isfinite(self.block_lr)):
            raise ValueError(f"{self.owner}(block_lr={self.block_lr}): block_lr must be a finite number > 0")

    def momentum_for(self, world_size: int) -> float:
        """The block momentum in force for ``world_size`` ranks (``1 - 1/N`` by default)."""
        return 1.0 - 1.0 / world_size if self.block_momentum is None else float(self.block_momentum)


@dataclass
class BMUFState:
    """Run-time state of BMUF: the block anchor ``A`` and the filtered block update ``Δ``.

    Both are flat fp32 vectors over the module's averaged tensors
    (see :mod:`lightning_pdist.core.flat`).
    """

    anchor: Tensor
    delta: Tensor

    @classmethod
    def starting_from(cls, weights: Tensor) -> "BMUFState":
        """State at the start of training: ``A = weights``, ``Δ = 0``."""
        return cls(anchor=weights.clone(), delta=torch.zeros_like(weights))

    def state_dict(self) -> dict:
        return {"anchor": self.anchor.clone(), "delta": self.delta.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.anchor.copy_(state["anchor"])
        self.delta.copy_(state["delta"])


@torch.no_grad()
def bmuf_block_update_(
    anchor: Tensor,
    delta: Tensor,
    mean_local: Tensor,
    block_momentum: float,
    block_lr: float,
    nesterov: bool,
) -> Tensor:
    """Close a block: update ``delta`` and ``anchor`` in place and return the global model ``W_g``.

    Args:
        anchor: ``A``, the model every rank started the block from; becomes the next start ``S``.
        delta: ``Δ``, the filtered block update; updated in place.
        mean_local: ``mean_i W_i``, the average of the ranks' models at the block end.
        block_momentum: ``η`` in ``[0, 1)``.
        block_lr: ``ζ > 0``.
        nesterov: start the next block from ``W_g - η·Δ`` instead of ``W_g``.

    Returns:
        ``W_g = A - Δ`` (a new tensor). ``anchor`` then holds ``S``, which every rank loads.
    """
    block_grad = anchor - mean_local  # G = mean_i(A - W_i) = A - mean_i W_i
    delta.mul_(block_momentum).add_(block_grad, alpha=block_lr)
    global_model = anchor - delta
    anchor.copy_(global_model)
    if nesterov:
        anchor.sub_(delta, alpha=block_momentum)
    return global_model


@torch.no_grad()
def bmuf_global_model(
    anchor: Tensor,
    delta: Tensor,
    mean_local: Tensor,
    block_momentum: float,
    block_lr: float,
    block_open: bool,
    nesterov: bool,
) -> Tensor:
    """The model BMUF would output now, without changing its state.

    If the current block has taken local steps (``block_open``), the block is closed early
    on copies: ``W_g = A - (η·Δ + ζ·(A - mean_i W_i))``. If a block has just ended, the ranks
    hold ``S`` and the output is the last global model ``W_g = S + η·Δ`` (NBM) or ``S``.
    """
    if block_open:
        return anchor - (block_momentum * delta + block_lr * (anchor - mean_local))
    if nesterov:
        return anchor + block_momentum * delta
    return anchor.clone()


class BMUFRule(AveragingRule):
    """BMUF as a rule object: the block update of :func:`bmuf_block_update_` at each block end.

    At each synchronization (the all-reduce gives ``mean_i W_i``)::

        G = A - mean_i W_i;  Δ ← η·Δ + ζ·G;  W_g = A - Δ;  S = W_g - η·Δ (nesterov) or W_g
        every rank loads S;  A ← S

    The consensus is the global model ``W_g`` (:func:`bmuf_global_model`), with an open block closed early on a copy
    (Chen & Huo, ICASSP 2016). During warm-up the anchor follows the (identical) replicas.

    Args:
        period: local steps per block.
        block_momentum: ``η`` in ``[0, 1)``; ``None`` means ``1 - 1/N``.
        block_lr: ``ζ > 0``.
        nesterov: start blocks from the look-ahead ``W_g - η·Δ``.
        warmup_steps: leading steps that average gradients; the first block starts after them.
        owner: the name in error messages (the strategy class).
    """

    def __init__(self, period: int = 8, block_momentum: float | None = None, block_lr: float = 1.0,
                 nesterov: bool = True, warmup_steps: int = 0, owner: str = "BMUFRule") -> None:  # fmt: skip
        super().__init__(PeriodicSchedule(period=period, warmup_steps=warmup_steps, owner=owner))
        self.config = BMUFConfig(block_momentum=block_momentum, block_lr=block_lr, nesterov=nesterov, owner=owner)
        self.state: BMUFState | None = None

    @property
    def block_momentum(self) -> float:
        """``η`` for this run's world size (``1 - 1/N`` by default)."""
        return self.config.momentum_for(self.world_size)

    def start(self, replicas: Replicas, world_size: int) -> None:
        super().start(replicas, world_size)
        self.state = BMUFState.starting_from(replicas.local_vector())

    def after_warmup(self, replicas: Replicas) -> None:
        self.state.anchor.copy_(replicas.local_vector())

    def apply(self, combined: Tensor, replicas: Replicas) -> None:
        cfg, state = self.config, self.state
        bmuf_block_update_(state.anchor, state.delta, combined, self.block_momentum, cfg.block_lr, cfg.nesterov)
        replicas.load_vector(state.anchor)

    def consensus(self, step: int, replicas: Replicas) -> Tensor:
        block_open = step > self.schedule.warmup_steps and not self.schedule.syncs_after(step)
        mean_local = replicas.average_of_replicas() if block_open else replicas.local_vector()
        cfg, state = self.config, self.state
        return bmuf_global_model(state.anchor, state.delta, mean_local, self.block_momentum, cfg.block_lr,
                                 block_open=block_open, nesterov=cfg.nesterov)  # fmt: skip


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
