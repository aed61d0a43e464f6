"""Asynchrony as momentum: the explicit momentum that ``implicit_momentum="compensate"`` leaves (no torch here).

Mitliagkas, Zhang, Hadjis & Ré 2016, "Asynchrony begets momentum, with an application to deep learning": with ``M``
asynchronous workers whose updates land in random order, the expected update of SGD carries an implicit momentum

    μ_implicit = 1 − 1/M,

on top of the optimizer's own ``μ``. To keep the total at what the user asked for, the explicit momentum becomes

    μ' = max(0, μ − (1 − 1/M))

(:func:`compensated_momentum`), for SGD's (and RMSprop's) ``momentum`` and Adam's ``beta1``. One worker implies none
(``M = 1``: unchanged); when ``1 − 1/M`` exceeds ``μ`` the explicit momentum is 0 (asynchrony already gives more than
asked: say so). Used by AD-PSGD (``decentralized/``, ``M`` = the ranks) and the parameter server's asynchronous mode
(``parameter_server/``, ``M`` = the workers).
"""

from __future__ import annotations

from typing import Any, Iterable

__all__ = ["IMPLICIT_MOMENTUM", "compensate_optimizers", "compensated_momentum", "implicit_momentum"]

#: The values of the strategies' ``implicit_momentum`` argument.
IMPLICIT_MOMENTUM = (None, "compensate")


def implicit_momentum(workers: int) -> float:
    """``1 − 1/M``: the momentum ``M`` asynchronous workers induce (Mitliagkas et al. 2016)."""
    return 1.0 - 1.0 / workers


def compensated_momentum(explicit: float, workers: int) -> float:
    """``max(0, μ − (1 − 1/M))``: the explicit momentum that keeps the total at the user's ``μ``."""
    return max(0.0, explicit - implicit_momentum(workers))


def compensate_optimizers(optimizers: Iterable[Any], workers: int, owner: str) -> tuple[list[float], str | None]:
    """Lower every param group's ``momentum`` (SGD, RMSprop) or ``betas[0]`` (Adam-like) in place.

    Returns the momenta before (one per param group, in order) and a warning to show when some ``μ < 1 − 1/M`` (then
    set to 0), else None. ``ValueError`` naming ``owner`` for an optimizer with neither hyperparameter.
    """
    before: list[float] = []
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            if "momentum" in group:
                before.append(float(group["momentum"]))
                group["momentum"] = compensated_momentum(float(group["momentum"]), workers)
            elif "betas" in group:
                b1, b2 = group["betas"]
                before.append(float(b1))
                group["betas"] = (compensated_momentum(float(b1), workers), b2)
            else:
                raise ValueError(f"{owner}(implicit_momentum='compensate'): {type(optimizer).__name__} has neither "
                                 "'momentum' nor 'betas' to lower; use SGD, Adam-like optimizers or "
                                 "implicit_momentum=None")  # fmt: skip
    implied = implicit_momentum(workers)
    warning = None
    if any(m < implied for m in before):
        warning = (f"{owner}(implicit_momentum='compensate'): {workers} asynchronous workers imply momentum "
                   f"1 − 1/{workers} = {implied:.3g}, above the momentum asked for ({sorted(set(before))}); the "
                   "explicit momentum is set to 0")  # fmt: skip
    return before, warning
