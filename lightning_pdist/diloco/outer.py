"""DiLoCo's outer step: an ordinary torch optimizer applied to the pseudo-gradient.

Douillard et al., *DiLoCo: Distributed Low-Communication Training of Language Models*, arXiv 2311.08105. Every
replica ``r`` starts a round from ``θ_global``, takes ``H`` steps of its own (inner) optimizer and reaches ``θ_r``.
Then::

    Δ        = θ_global − mean_r θ_r          # the pseudo-gradient (positive = descent, as a gradient)
    θ_global ← OuterOpt(θ_global, grad=Δ)    # default SGD(lr=0.7, momentum=0.9, nesterov=True)

and every replica loads ``θ_global``. With torch's SGD (``b ← μ·b + Δ``; Nesterov: ``θ ← θ − lr·(Δ + μ·b)``,
else ``θ ← θ − lr·b``):

* outer ``SGD(lr=1, momentum=0)`` gives ``θ_global = mean_r θ_r``: local SGD (parameter averaging every ``H``);
  with ``H = 1`` as well it is synchronous data-parallel SGD (for a plain-SGD inner optimizer);
* BMUF (Chen & Huo 2016; :mod:`lightning_pdist.averaging.bmuf`) keeps ``D ← η·D + ζ·Δ`` and loads
  ``A − D`` (plain block momentum) or ``A − D − η·D`` (its Nesterov variant). Outer ``SGD(lr=ζ, momentum=η)``
  (``"sgd"``) keeps ``ζ·b = D``, so plain block momentum *is* DiLoCo's heavy-ball outer step, round for round.
  The Nesterov forms agree on the first round only: torch's Nesterov step is ``ζ·(Δ + η·b) = (1+η)·ζ·Δ + η²·D_old``,
  BMUF's is ``(1+η)·D = (1+η)·ζ·Δ + (η+η²)·D_old``: BMUF moves ``η·D_old`` further every later round.

The outer optimizer sees one flat fp32 parameter per fragment (:mod:`.fragments`), so its state (a momentum
buffer, Adam's moments) is one vector per fragment, the same on every replica.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

__all__ = ["OuterConfig", "outer_step_"]

_NAMED = {"nesterov": True, "sgd": False}


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class OuterConfig:
    """The outer optimizer: ``"nesterov"`` (SGD with Nesterov momentum, the paper's), ``"sgd"`` (SGD with plain
    momentum), or any ``torch.optim.Optimizer`` subclass, given as a class or its dotted path
    (``"torch.optim.Adam"``), built as ``cls([θ_global], lr=outer_lr, **outer_kwargs)``.

    ``outer_momentum`` applies to ``"nesterov"`` and ``"sgd"`` only (for a class, put it in ``outer_kwargs``).
    """

    outer_optimizer: Any = "nesterov"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_kwargs: dict = field(default_factory=dict)
    owner: str = "OuterConfig"

    def __post_init__(self) -> None:
        o = self.owner
        if not _is_number(self.outer_lr) or not (math.isfinite(self.outer_lr) and self.outer_lr > 0):
            raise ValueError(f"{o}(outer_lr={self.outer_lr!r}): outer_lr must be a finite number > 0")
        if not _is_number(self.outer_momentum) or not 0.0 <= self.outer_momentum < 1.0:
            raise ValueError(f"{o}(outer_momentum={self.outer_momentum!r}): outer_momentum must be a number in [0, 1)")
        if not isinstance(self.outer_kwargs, dict):
            raise TypeError(f"{o}(outer_kwargs={self.outer_kwargs!r}): outer_kwargs must be a dict or None")
        object.__setattr__(self, "outer_kwargs", dict(self.outer_kwargs))  # the caller's dict stays the caller's
        spec = self.outer_optimizer
        if isinstance(spec, str) and spec in _NAMED:
            if spec == "nesterov" and self.outer_momentum == 0:
                raise ValueError(f"{o}(outer_momentum=0): Nesterov momentum needs outer_momentum > 0; use "
                                 "outer_optimizer='sgd' for an outer step without momentum")  # fmt: skip
            if self.outer_kwargs:
                raise ValueError(f"{o}(outer_kwargs={self.outer_kwargs!r}): outer_kwargs applies to an optimizer "
                                 f"class; outer_optimizer={spec!r} takes outer_lr and outer_momentum")  # fmt: skip
            return
        cls = self.optimizer_class()
        try:  # a wrong keyword is refused here, not at setup
            cls([nn.Parameter(torch.zeros(1))], lr=self.outer_lr, **self.outer_kwargs)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{o}(outer_kwargs={self.outer_kwargs!r}): {cls.__name__} refused them: {err}") from err

    def optimizer_class(self) -> type:
        """The optimizer class ``outer_optimizer`` names."""
        spec, o = self.outer_optimizer, self.owner
        if isinstance(spec, str) and spec in _NAMED:
            return torch.optim.SGD
        cls = spec
        if isinstance(spec, str):
            module, _, name = spec.rpartition(".")
            try:
                cls = getattr(importlib.import_module(module), name) if module else None
            except (ImportError, AttributeError):
                cls = None
        if not (isinstance(cls, type) and issubclass(cls, Optimizer)):
            raise ValueError(f"{o}(outer_optimizer={spec!r}): outer_optimizer must be 'nesterov', 'sgd', a "
                             "torch.optim.Optimizer subclass or its dotted path such as 'torch.optim.Adam'")  # fmt: skip
        return cls

    def build(self, parameter: nn.Parameter) -> Optimizer:
        """A fresh outer optimizer over ``parameter`` (one fragment's flat ``θ_global``)."""
        spec = self.outer_optimizer
        if isinstance(spec, str) and spec in _NAMED:
            return torch.optim.SGD([parameter], lr=self.outer_lr, momentum=self.outer_momentum,
                                   nesterov=_NAMED[spec])  # fmt: skip
        return self.optimizer_class()([parameter], lr=self.outer_lr, **self.outer_kwargs)

    def describe(self) -> str:
        spec = self.outer_optimizer
        name = spec if isinstance(spec, str) else f"{spec.__module__}.{spec.__qualname__}"
        return name


@torch.no_grad()
def outer_step_(optimizer: Optimizer, global_params: nn.Parameter, mean_delta: Tensor) -> None:
    """``θ_global ← OuterOpt(θ_global, grad = mean_delta)`` in place; the gradient is cleared afterwards."""
    global_params.grad = mean_delta.to(global_params.dtype).reshape(global_params.shape).clone()
    optimizer.step()
    global_params.grad = None
