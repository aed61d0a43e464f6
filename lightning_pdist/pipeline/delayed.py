"""Delayed gradients without stashed weights: DDG and features replay (Huo et al. 2018), on PipeDream's timing.

Both run the ``pipedream`` order (1F1B without flushes, every micro-batch a mini-batch, each stage updating right
after its backward). Stage ``k``'s backward of micro-batch ``j`` takes the *delayed* gradient ``δ_k = ∂f_j/∂h_k``
that stage ``k+1`` sent back, ``K − 1 − k`` of the stage's own updates after ``j``'s forward ran on ``w_t``; neither
keeps an old copy of the weights (the stash depth is 1 on every stage). They differ in what the backward
differentiates:

* ``ddg`` (Huo, Gu, Yang, Huang, ICML 2018, "Decoupled Parallel Backpropagation with Convergence Guarantee"):
  the stage keeps the forward's activations (its autograd graph) and backpropagates ``δ_k``
  through them with the **current** weights ``w_{t+s}``: ``g = J_w(h_{k−1}^j; w_{t+s}, a^j)ᵀ δ_k``, where ``a^j`` are the
  stored activations of the forward on ``w_t``, and sends ``J_x(…)ᵀ δ_k`` to stage ``k−1``; then
  ``w ← w − ν·g``. The weights are updated in place, so the stored graph sees them (no copy): memory is the
  activations of the ``K − k`` micro-batches in flight, as PipeDream's, without its ``K − k`` weight versions.
* ``features_replay`` (Huo, Gu, Huang, NeurIPS 2018, "Training Neural Networks Using Features Replay"):
  the forward keeps only the stage's **input** ``h_{k−1}^j`` (no graph); the backward first
  *replays* the forward on it with the current weights, ``ĥ_k = F_k(h_{k−1}^j; w_{t+s})`` (same dropout mask: the
  stage's random stream is rewound to where the forward drew it), then backpropagates ``δ_k`` through the replay:
  ``g = ∇_w ⟨ĥ_k, δ_k⟩`` and ``∇_x ⟨ĥ_k, δ_k⟩`` to stage ``k−1``. One stored input per micro-batch in flight instead
  of its activations, one extra forward per backward.

The last stage's backward follows its forward with no update in between (``s = 0``), so there both are plain
backprop, and with one stage both equal SGD. This module holds the replay (pure torch, no transport):
:func:`replay_backward`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import Tensor

__all__ = ["replay_backward"]


def replay_backward(
    forward: Callable[[Tensor, dict[str, Tensor]], Tensor],
    x: Tensor,
    weights: dict[str, Tensor],
    grad_output: Tensor,
    rng: Callable[[], AbstractContextManager],
    context: Callable[[], AbstractContextManager],
    input_grad: bool = True,
) -> Tensor | None:
    """Recompute ``forward(x, weights)`` (under ``rng()`` and ``context()``) and backpropagate ``grad_output``.

    Gradients accumulate into the ``weights`` leaves' ``.grad``; returns ``∂⟨out, grad_output⟩/∂x`` (``None`` when
    ``x`` is not a floating-point tensor, or ``input_grad`` is off: the first stage). The graph is recorded whatever
    the caller's grad mode.
    """
    # A drain may run inside Lightning's evaluation loop (inference mode): the replay must still record its graph.
    with torch.inference_mode(False), torch.enable_grad():
        leaf = x.detach().requires_grad_() if input_grad and x.is_floating_point() else x.detach()
        with rng(), context():
            out = forward(leaf, weights)
    inputs = [w for w in weights.values() if w.requires_grad] + ([leaf] if leaf.requires_grad else [])
    if out.requires_grad and inputs:
        torch.autograd.backward(out, grad_tensors=grad_output, inputs=inputs)
    if not leaf.requires_grad:
        return None
    return leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
