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
* ``normalize=True``: ``M_k`` works in unit scales, on both sides, and the prediction is scaled back::

      ĥ = h / ‖h‖                        (L2 over the last dimension: what M_k sees)
      σ ← rms(δ) at the first target, then σ ← 0.99·σ + 0.01·rms(δ)   (the true gradients' running scale)
      ĝ = σ · M_k(ĥ)                      (σ = 0, so ĝ = 0, before the first target)
      M_k trains on ½‖M_k(ĥ) − δ/σ‖²

  The reason, measured on the pipeline benchmark's digits CNN (``scripts/dni_diagnosis.py``, the method card's DNI
  section): unnormalised, Adam's first step moves every weight of ``M_k`` by ``lr`` whatever the target's scale, so
  ``ĝ`` jumps to about ``lr·‖h‖₁`` per element (0.14 there, where ``δ`` is 0.003 per element: ``|ĝ|/|δ|`` = 36 after
  one step); the stage below steps on that, ``h`` grows (``‖h‖₁`` per sample 140, 879, 2.5e4, 4.0e9 over the
  first six micro-batches), and a linear ``M_k`` predicts in proportion to ``h``: NaN by the seventh micro-batch.
  With ``ĥ`` of norm 1, ``ĝ`` no longer grows with ``h`` (that feedback is cut) and Adam's per-step change of ``M_k(ĥ)``, at most
  ``lr·‖ĥ‖₁ ≤ lr·√d``, is measured against unit-scale targets ``δ/σ``, so its ``lr`` means the same on any model.
  These are the synthetic gradient's scale and the zero output layer of Jaderberg et al.'s recipe, with the scale
  tracked rather than tuned per model. ``normalize=False`` is the rule without them (``ĝ = M_k(h)``, trained on ``δ``).
* Its optimizer is ``torch.optim.Adam(lr=1e-4)``: with unit-scale inputs and targets, the CNN above learns with
  1e-4 (validation accuracy 0.808 / 0.939 / 0.928 after each of 3 epochs, one process; 0.886 / 0.916 / 0.958 through
  the Trainer on 2 ranks in the benchmark) and degrades with torch's default 1e-3 (0.731 / 0.636 / 0.692, the
  prediction's mean cosine with ``δ`` falling from 0.31 to 0.006); ``optimizer_factory(params) ->
  Optimizer`` replaces it.
* On a boundary cut by ``split_points`` the activation is one packed vector (header, then every value the next
  stage needs, :func:`~lightning_pdist.pipeline.ownership.pack`): ``parts(h)`` names the values that carry a
  gradient, each gets its own ``M`` (built by the factory on that value, normalised over its own last dimension) and
  the rest of ``ĝ`` is zero: the header and integers have no gradient, and a mask or positions built from the inputs
  reach no weight of this stage, so their true gradient is zero too (an ``-inf`` causal mask fed to a linear map
  would make ``ĝ`` NaN). ``σ`` is the rms over those values only.

* ``num_classes=C`` (cDNI, Jaderberg et al. 2017 §3, "conditional DNI"; ``synthetic_conditioning="labels"``):
  ``M_k`` also sees the micro-batch's labels, one-hot, concatenated to its input::

      ĝ = σ · M_k([ĥ, onehot(y)])       (normalize=True; [h, onehot(y)] without it)
      M_k trains on ½‖M_k([ĥ, onehot(y)]) − δ/σ‖²

  ``y`` is the micro-batch's class indices (1-D, one per sample, in ``[0, C)``, :func:`class_labels`); for a value of
  shape ``(B, …, d)`` the one-hot ``(B, C)`` is repeated over the middle dimensions (every position of a sequence
  sees its sample's label). The default ``M_k`` is then ``nn.Linear(d + C, d)``, zero; a ``module_factory`` is
  called with ``M_k``'s input (last dimension ``d + C``) and must still predict ``h``'s shape. The reason: a map of
  ``h`` alone cannot predict the label-dependent part of ``δ`` (for a softmax head ``δ`` contains ``−Wᵀonehot(y)``),
  which the label's column of the linear map can.

This module is the rule only (no transport, no Lightning): :class:`SyntheticGradient`, and :func:`class_labels`
(the conditioning labels of a batch).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

__all__ = ["SyntheticGradient", "class_labels", "zero_linear"]

DEFAULT_LR = 1e-4
SCALE_DECAY = 0.99  # σ's running average (normalize=True)


def zero_linear(h: Tensor, out_features: int | None = None) -> nn.Module:
    """The default ``M_k``: ``nn.Linear(d, d)`` over ``h``'s last dimension ``d`` (``out_features``: cDNI's
    ``Linear(d + C, d)``), weight and bias zero."""
    layer = nn.Linear(h.shape[-1], out_features or h.shape[-1])
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
    ``nn.ModuleList``, one ``M`` per value, and ``ĝ`` is zero elsewhere. ``normalize``: ``M`` sees ``h/‖h‖`` and
    predicts ``δ/σ`` (see the module docstring). ``num_classes``: cDNI, :meth:`predict` and :meth:`train` take the
    micro-batch's class indices ``labels`` and ``M`` sees ``[ĥ, onehot(labels)]``.
    """

    def __init__(self, module_factory: Callable[[Tensor], nn.Module] | None = None,
                 optimizer_factory: Callable[[Iterable[nn.Parameter]], Optimizer] | None = None,
                 owner: str = "PipelineStrategy", parts: Parts | None = None, normalize: bool = True,
                 num_classes: int | None = None) -> None:  # fmt: skip
        self.module_factory, self.optimizer_factory = module_factory, optimizer_factory or adam
        self.owner, self.parts, self.normalize, self.num_classes = owner, parts, normalize, num_classes
        self.scale = 0.0  # σ (normalize=True): the true gradients' running rms; 0 before the first
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

    @property
    def conditioned(self) -> bool:
        """cDNI: ``M`` also sees the labels."""
        return self.num_classes is not None

    def _make(self, h: Tensor, c: Tensor | None) -> nn.Module:
        x = _input(h.detach().float(), c, False)  # M's input, for its shape
        if self.module_factory is None:
            return zero_linear(x, h.shape[-1])
        module = self.module_factory(x)
        if not isinstance(module, nn.Module):
            raise TypeError(f"{self.owner}(synthetic_module=...): the factory returned {type(module).__name__}, not an nn.Module")
        return module

    def _onehot(self, h: Tensor, labels: Tensor | None) -> Tensor | None:
        """``onehot(labels)`` (float32, on ``h``'s device) where conditioned; the labels checked against the rule."""
        if not self.conditioned:
            if labels is not None:
                raise ValueError(f"{self.owner}: labels given to a synthetic module that is not conditioned on them")
            return None
        if labels is None:
            raise ValueError(f"{self.owner}(synthetic_conditioning='labels'): the synthetic module needs the micro-batch's "
                             "labels, and none came with it")  # fmt: skip
        check_labels(labels, self.num_classes, self.owner)
        return nn.functional.one_hot(labels.to(h.device), self.num_classes).float()

    def _build(self, h: Tensor, c: Tensor | None = None) -> None:
        module = (self._make(h, c) if self.parts is None else
                  nn.ModuleList(self._make(v, c) for _, v in self._values(h)))  # fmt: skip
        self.module = module.to(device=h.device, dtype=torch.float32)
        self.optimizer = self.optimizer_factory(self.module.parameters())
        if not isinstance(self.optimizer, Optimizer):
            raise TypeError(f"{self.owner}(synthetic_optimizer=...): the factory returned {type(self.optimizer).__name__}, "
                            "not a torch.optim.Optimizer")  # fmt: skip
        if self._pending is not None:
            self._load(self._pending)
            self._pending = None

    def _apply(self, h: Tensor, c: Tensor | None) -> Tensor:
        """``ĝ`` in float32, of ``h``'s shape (with a graph into ``M`` where grad mode is on)."""
        if self.parts is None:
            return _checked(self.module, h, c, self.owner, self.normalize)
        out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        for m, (offset, v) in zip(self.module, self._values(h)):
            out[offset : offset + v.numel()] = _checked(m, v, c, self.owner, self.normalize).reshape(-1)
        return out

    def _rms(self, h: Tensor, target: Tensor) -> float:
        """The rms of ``target`` over the values ``M`` predicts (all of it, or the gradient-carrying parts)."""
        if self.parts is None:
            return float(target.pow(2).mean().sqrt())
        return float(torch.cat([target[o : o + v.numel()] for o, v in self._values(h)]).pow(2).mean().sqrt())

    @torch.no_grad()
    def predict(self, h: Tensor, labels: Tensor | None = None) -> Tensor:
        """``ĝ = M(h)`` (cDNI: ``M([h, onehot(labels)])``) in ``h``'s dtype (no graph)."""
        c = self._onehot(h, labels)
        if self.module is None:
            self._build(h, c)
        with torch.inference_mode(False), torch.autocast(h.device.type, enabled=False):
            g = self._apply(h, c)
            return (g * self.scale if self.normalize else g).to(h.dtype)

    def train(self, h: Tensor, target: Tensor, labels: Tensor | None = None) -> float:
        """One step of ``M``'s optimizer on ``½‖M(h) − target‖²`` (``normalize``: ``½‖M(ĥ) − target/σ‖²``, ``σ``
        updated with this target first; cDNI: ``M`` sees ``onehot(labels)`` too); returns that loss (before the step)."""
        c = self._onehot(h, labels)
        if self.module is None:
            self._build(h, c)
        target = target.detach().float()
        if self.normalize:
            rms = self._rms(h, target)
            self.scale = rms if self.steps == 0 else SCALE_DECAY * self.scale + (1 - SCALE_DECAY) * rms
            if self.scale > 0:
                target = target / self.scale
        with torch.inference_mode(False), torch.enable_grad(), torch.autocast(h.device.type, enabled=False):
            loss = 0.5 * (self._apply(h, c) - target).pow(2).sum()
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return float(loss.detach())

    def state_dict(self) -> dict:
        """The module's and optimizer's state (copies), or the loaded state still waiting for the first boundary."""
        if self.module is None:
            return self._pending if self._pending is not None else {"steps": self.steps, "scale": self.scale}
        return {"module": {k: v.detach().clone() for k, v in self.module.state_dict().items()},
                "optimizer": _clone(self.optimizer.state_dict()), "steps": self.steps, "scale": self.scale}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.steps, self.scale = int(state.get("steps", 0)), float(state.get("scale", 0.0))
        if "module" not in state:
            return
        if self.module is None:
            self._pending = state
        else:
            self._load(state)

    def _load(self, state: dict) -> None:
        self.module.load_state_dict(state["module"])
        self.optimizer.load_state_dict(_clone(state["optimizer"]))


def class_labels(batch: object, num_classes: int, owner: str = "PipelineStrategy") -> Tensor:
    """cDNI's labels of a batch: its last element (a tuple or list batch, as ``x, y = batch``) or its ``"labels"``
    entry (a dict batch, as transformers'), which must be class indices (:func:`check_labels`)."""
    rule = ("the labels are the batch's last element (a tuple or list batch) or its 'labels' entry (a dict batch): "
            "a 1-D integer tensor of class indices, one per sample, in [0, synthetic_num_classes)")
    if isinstance(batch, Mapping):
        labels = batch.get("labels")
        where = f"a dict batch with keys {sorted(map(str, batch))}"
    elif isinstance(batch, (tuple, list)) and batch:
        labels, where = batch[-1], f"the last element of a {type(batch).__name__} batch"
    else:
        labels, where = None, f"a {type(batch).__name__} batch"
    if not isinstance(labels, Tensor):
        raise ValueError(f"{owner}(synthetic_conditioning='labels'): the stage that owns the boundary cannot see the "
                         f"targets in {where} ({type(labels).__name__} found); {rule}")  # fmt: skip
    check_labels(labels, num_classes, owner, where)
    return labels


def check_labels(labels: Tensor, num_classes: int, owner: str, where: str = "the labels") -> None:
    """Refuse labels that are not class indices: 1-D, an integer dtype, every value in ``[0, num_classes)``."""
    bad = ("not 1-D" if labels.ndim != 1 else
           f"of dtype {labels.dtype}, not an integer type" if labels.is_floating_point() or labels.is_complex()
           or labels.dtype == torch.bool else
           f"holding {int(labels.min())}..{int(labels.max())}, outside [0, {num_classes})"
           if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= num_classes) else "")  # fmt: skip
    if bad:
        raise ValueError(f"{owner}(synthetic_conditioning='labels', synthetic_num_classes={num_classes}): {where} is a "
                         f"tensor of shape {tuple(labels.shape)} {bad}; the targets must be class indices (a 1-D integer "
                         f"tensor, one per sample, in [0, {num_classes})) to be one-hot encoded")  # fmt: skip


def _input(h: Tensor, c: Tensor | None, normalize: bool) -> Tensor:
    """What ``M`` reads: ``ĥ`` (or ``h``), with cDNI's one-hot ``c (B, C)`` repeated over ``h``'s middle dimensions."""
    x = nn.functional.normalize(h, dim=-1) if normalize else h
    if c is None:
        return x
    if h.ndim < 2 or h.shape[0] != c.shape[0]:
        raise RuntimeError(f"PipelineStrategy(synthetic_conditioning='labels'): a boundary value of shape {tuple(h.shape)} "
                           f"does not lead with the micro-batch's {c.shape[0]} samples, so its labels cannot be attached "
                           "to it (cDNI needs batch-first boundary activations)")  # fmt: skip
    c = c.view(c.shape[0], *([1] * (h.ndim - 2)), c.shape[1]).expand(*h.shape[:-1], c.shape[1])
    return torch.cat([x, c.to(x.dtype)], dim=-1)


def _checked(module: nn.Module, h: Tensor, c: Tensor | None, owner: str, normalize: bool) -> Tensor:
    out = module(_input(h.detach().float(), c, normalize))
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
