"""SpecTrain's weight prediction (Chen, Yang, Cheng 2018, "Efficient and Robust Parallel DNN Training through
Model Parallelism on Multi-GPU Platform").

Under PipeDream's timing (1F1B without flushes, every micro-batch a mini-batch, each stage updating right after its
backward) stage ``k`` runs micro-batch ``j``'s forward on its newest weights ``w_t``, and ``j``'s gradient is applied
``s`` updates later, to ``w_{t+s}``: the stage's *staleness* for ``j``, ``s = j − b`` where ``b`` is the number of
backwards the stage has run when the forward starts (``K − 1 − k`` in the steady state, ``0`` on the last stage and
during the first forward after a drain). PipeDream answers with weight stashing (compute the gradient at the old
``w_t``); SpecTrain instead *predicts* the weights the update will meet, from the momentum ``v`` of SGD
(``v ← μ·v + (1−d)·g``, ``w ← w − ν·v``), which changes slowly::

    ŵ_j = w_t − s · ν · v_t

and runs micro-batch ``j``'s forward **and** backward on ``ŵ_j`` (the backward happens at the moment the prediction
aims at, so it uses the same predicted weights: the gradient is ``∇f_j(ŵ_j)``, the gradient of one weight vector),
then updates the current weights with it. With ``s = 0`` (one stage, the last stage) ``ŵ = w`` and the rule is
momentum SGD. Memory: each in-flight micro-batch with ``s > 0`` keeps its own predicted copy of the stage's weights
(``K − k`` on stage ``k < K−1`` plus the current weights; the schedule simulator derives it), one more than PipeDream's
stash because a prediction is never equal to a stored version.

This module holds the rule only (no transport, no Lightning): :func:`staleness`, :func:`predicted_weights`,
:func:`check_momentum` (the refusal of an optimizer without a momentum buffer) and :func:`versions_alive`
(the simulator's memory count).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor
from torch.optim import Optimizer

__all__ = ["check_momentum", "predicted_weights", "staleness", "versions_alive"]


def staleness(microbatch: int, backwarded: int) -> int:
    """``s``: updates the stage makes between micro-batch ``microbatch``'s forward and its own update (one per
    earlier backward still to run: backwards run in micro-batch order, each followed by its update)."""
    return max(0, microbatch - backwarded)


def check_momentum(optimizer: Optimizer, owner: str, schedule: str = "spectrain") -> None:
    """Refuse an optimizer whose step is not ``w ← w − ν·v`` with a momentum buffer ``v``: SpecTrain predicts from it.

    ``torch.optim.SGD`` with ``momentum > 0`` in every parameter group (Nesterov's variant is accepted: its buffer is
    the same ``v``, its step ``ν·(g + μ·v)`` is approximated by ``ν·v``).
    """
    name = type(optimizer).__name__
    if not isinstance(optimizer, torch.optim.SGD):
        raise ValueError(f"{owner}(schedule={schedule!r}): the optimizer is {name}; SpecTrain predicts the weights "
                         "ŵ = w − s·lr·v from SGD's momentum buffer v, so it needs torch.optim.SGD with momentum > 0")  # fmt: skip
    for i, group in enumerate(optimizer.param_groups):
        if not group.get("momentum", 0) > 0:
            raise ValueError(f"{owner}(schedule={schedule!r}): {name} has momentum={group.get('momentum', 0)} in param "
                             f"group {i}; SpecTrain predicts the weights ŵ = w − s·lr·v from the momentum buffer v, which "
                             "does not exist without momentum (use momentum > 0, or schedule='pipedream')")  # fmt: skip


@torch.no_grad()
def predicted_weights(params: Mapping[str, Tensor], optimizer: Optimizer, s: int) -> dict[str, Tensor]:
    """``ŵ = w − s·ν·v`` per parameter (fresh tensors), ``v`` the optimizer's momentum buffer (``0`` before the
    first step), ``ν`` the learning rate of the parameter's group."""
    lr = {id(p): group["lr"] for group in optimizer.param_groups for p in group["params"]}
    out = {}
    for name, p in params.items():
        v = optimizer.state.get(p, {}).get("momentum_buffer")
        out[name] = p.detach().clone() if v is None else p.detach() - (s * float(lr.get(id(p), 0.0))) * v
    return out


def versions_alive(program: Iterable[tuple[str, int]], backwarded_at: Mapping[int, int]) -> int:
    """Most weight copies a stage holds at once: the current weights plus one predicted copy per in-flight
    micro-batch with ``s > 0``. ``program``: the stage's ``(kind, microbatch)`` in order; ``backwarded_at[j]``: the
    backwards run before ``j``'s forward."""
    in_flight: set[int] = set()
    top = 1
    for kind, j in program:
        if kind == "F":
            if staleness(j, backwarded_at[j]) > 0:
                in_flight.add(j)
            top = max(top, 1 + len(in_flight))
        elif kind == "B":
            in_flight.discard(j)
    return top
