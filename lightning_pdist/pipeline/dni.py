"""Decoupled neural interfaces with synthetic gradients (Jaderberg, Czarnecki, Osindero, Vinyals, Graves, Silver,
Kavukcuoglu, ICML 2017, "Decoupled Neural Interfaces using Synthetic Gradients").

Stage ``k < K−1`` of a pipeline owns a small learned module ``M_k`` at its output boundary that predicts the
gradient of the loss with respect to the boundary activation ``h_k``::

    ĝ_k = M_k(h_k)                      (the prediction, no gradient into M_k)
    g_w = J_w(F_k)(h_{k−1}; w)ᵀ ĝ_k     (the stage's weight gradient, right after its forward: no update locking)
    δ_{k−1} = J_x(F_k)(h_{k−1}; w)ᵀ ĝ_k  (sent to stage k−1: the target of M_{k−1}, bootstrapped as in the paper)

and ``w ← optimizer step(g_w)``. When stage ``k+1`` sends back ``δ_k`` (its backward of the same micro-batch, on
its own prediction or, on the last stage, on the loss), ``M_k`` takes one step of its own optimizer on
``½‖M_k(h_k) − δ_k‖²`` (summed over the elements: the paper's L2 distance, whose gradient in ``ĝ`` is ``ĝ − δ``).
Substituting the true ``∂L/∂h_k`` for ``ĝ_k`` is backprop (the rule's degenerate case; the tests check it).

Defaults, with their reasons:

* ``M_k`` is a linear map of the boundary activation's last dimension, ``ĝ = h·A + b`` with ``A, b`` **zero** at
  the start (the paper initialises the synthetic model's output layer to zero): the stages below do not move until
  ``M_k`` has seen true gradients, instead of following a random direction. ``module_factory(h) -> nn.Module``
  replaces it (called once, with the first boundary activation; its output must have ``h``'s shape).
* On a boundary cut by ``split_points`` the activation is one packed vector (header, then every value the next
  stage needs, :func:`~lightning_pdist.pipeline.ownership.pack`): ``parts(h)`` names the values that carry a
  gradient, each gets its own ``M`` (built by the factory on that value) and the rest of ``ĝ`` is zero: the header
  and integers have no gradient, and a mask or positions built from the inputs reach no weight of this stage, so
  their true gradient is zero too (an ``-inf`` causal mask fed to a linear map would make ``ĝ`` NaN).
* Its optimizer is ``torch.optim.Adam(lr=1e-3)``, torch's common default, not a tuned one. Adam moves each parameter
  of ``M_k`` by about ``lr`` per step whatever the targets' scale, so ``ĝ`` moves by about ``lr·Σ|h_i|`` per step;
  where the true gradients are small against that (the benchmark's digits CNN: ``δ`` about 3e-3 per element, a
  512-wide boundary of ReLU features about 0.5 each) the prediction is mostly noise and the stage below diverges.
  Measured there (``scripts/dni_diagnosis.py``, the method card's DNI section), no Adam rate and no SGD rate tried
  trains that CNN, so no other default is argued better; ``optimizer_factory(params) -> Optimizer`` replaces it.

This module is the rule only (no transport, no Lightning): :class:`SyntheticGradient`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

__all__ = ["SyntheticGradient", "zero_linear"]

DEFAULT_LR = 1e-3


def zero_linear(h: Tensor) -> nn.Module:
    """The default ``M_k``: ``nn.Linear(d, d)`` over ``h``'s last dimension ``d``, weight and bias zero."""
    layer = nn.Linear(h.shape[-1], h.shape[-1])
    nn.init.zeros_(layer.weight)
    nn.init.zeros_(layer.bias)
    return layer


def adam(params: Iterable[nn.Parameter]) -> Optimizer:
    """The default optimizer of ``M_k`` (see the module docstring for the reason)."""
    return torch.optim.Adam(params, lr=DEFAULT_LR)


Parts = Callable[[Tensor], list[tuple[int, tuple[int, ...]]]]


class SyntheticGradient:
    """``M_k`` and its optimizer: :meth:`predict` the gradient at a boundary, :meth:`train` on the true one.

    The module is built at the first :meth:`predict` (the boundary's shape is known then), in float32 on the
    activation's device; a state loaded before that waits for it. ``parts(h)``, for a packed boundary: the
    ``(offset, shape)`` of each value of the 1-D ``h`` that carries a gradient; ``module`` is then an
    ``nn.ModuleList``, one ``M`` per value, and ``ĝ`` is zero elsewhere.
    """

    def __init__(self, module_factory: Callable[[Tensor], nn.Module] | None = None,
                 optimizer_factory: Callable[[Iterable[nn.Parameter]], Optimizer] | None = None,
                 owner: str = "PipelineStrategy", parts: Parts | None = None) -> None:  # fmt: skip
        self.module_factory, self.optimizer_factory = module_factory or zero_linear, optimizer_factory or adam
        self.owner, self.parts = owner, parts
        self.module: nn.Module | None = None
        self.optimizer: Optimizer | None = None
        self._pending: dict | None = None
        self.steps = 0

    def _values(self, h: Tensor) -> list[tuple[int, Tensor]]:
        """The values ``M`` sees (views of ``h``) and their offsets: ``h`` itself, or its gradient-carrying parts."""
        if self.parts is None:
            return [(0, h)]
        values = [(offset, h[offset : offset + math.prod(shape)].view(shape)) for offset, shape in self.parts(h)]
        if isinstance(self.module, nn.ModuleList) and len(values) != len(self.module):
            raise RuntimeError(f"{self.owner}(synthetic_gradients=True): this boundary carries {len(values)} values with "
                               f"a gradient, its first carried {len(self.module)}; each has its own synthetic module, so "
                               "the network must hand the split point the same tensors at every step")  # fmt: skip
        return values

    def _make(self, h: Tensor) -> nn.Module:
        module = self.module_factory(h.detach().float())
        if not isinstance(module, nn.Module):
            raise TypeError(f"{self.owner}(synthetic_module=...): the factory returned {type(module).__name__}, not an nn.Module")
        return module

    def _build(self, h: Tensor) -> None:
        module = self._make(h) if self.parts is None else nn.ModuleList(self._make(v) for _, v in self._values(h))
        self.module = module.to(device=h.device, dtype=torch.float32)
        self.optimizer = self.optimizer_factory(self.module.parameters())
        if not isinstance(self.optimizer, Optimizer):
            raise TypeError(f"{self.owner}(synthetic_optimizer=...): the factory returned {type(self.optimizer).__name__}, "
                            "not a torch.optim.Optimizer")  # fmt: skip
        if self._pending is not None:
            self._load(self._pending)
            self._pending = None

    def _apply(self, h: Tensor) -> Tensor:
        """``ĝ`` in float32, of ``h``'s shape (with a graph into ``M`` where grad mode is on)."""
        if self.parts is None:
            return _checked(self.module, h, self.owner)
        out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        for m, (offset, v) in zip(self.module, self._values(h)):
            out[offset : offset + v.numel()] = _checked(m, v, self.owner).reshape(-1)
        return out

    @torch.no_grad()
    def predict(self, h: Tensor) -> Tensor:
        """``ĝ = M(h)`` in ``h``'s dtype (no graph)."""
        if self.module is None:
            self._build(h)
        with torch.inference_mode(False), torch.autocast(h.device.type, enabled=False):
            return self._apply(h).to(h.dtype)

    def train(self, h: Tensor, target: Tensor) -> float:
        """One step of ``M``'s optimizer on ``½‖M(h) − target‖²``; returns that loss (before the step)."""
        if self.module is None:
            self._build(h)
        with torch.inference_mode(False), torch.enable_grad(), torch.autocast(h.device.type, enabled=False):
            loss = 0.5 * (self._apply(h) - target.detach().float()).pow(2).sum()
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return float(loss.detach())

    def state_dict(self) -> dict:
        """The module's and optimizer's state (copies), or the loaded state still waiting for the first boundary."""
        if self.module is None:
            return self._pending if self._pending is not None else {"steps": self.steps}
        return {"module": {k: v.detach().clone() for k, v in self.module.state_dict().items()},
                "optimizer": _clone(self.optimizer.state_dict()), "steps": self.steps}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state.get("steps", 0))
        if "module" not in state:
            return
        if self.module is None:
            self._pending = state
        else:
            self._load(state)

    def _load(self, state: dict) -> None:
        self.module.load_state_dict(state["module"])
        self.optimizer.load_state_dict(_clone(state["optimizer"]))


def _checked(module: nn.Module, h: Tensor, owner: str) -> Tensor:
    out = module(h.detach().float())
    if not isinstance(out, Tensor) or out.shape != h.shape:
        got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise RuntimeError(f"{owner}(synthetic_module=...): the synthetic module maps a boundary activation of "
                           f"shape {tuple(h.shape)} to {got}; it must predict dL/dh, of h's shape")  # fmt: skip
    return out


def _clone(obj: object) -> object:
    """A deep copy of a state dict's tensors (an optimizer keeps references to what it is given)."""
    if isinstance(obj, Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj
