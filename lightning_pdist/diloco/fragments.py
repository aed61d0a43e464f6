"""Streaming DiLoCo's schedule and fragments: which part of the model synchronizes at which inner step.

Douillard et al., *Streaming DiLoCo with overlapping communication*, arXiv 2501.18512. The model is cut into
``P`` fragments (contiguous blocks of layers, or the user's lists of module names). With ``H`` inner steps per
round, fragment ``p`` starts its synchronization after inner step ``t`` (1-based) when ``t mod H = p·H/P``
(and ``t ≥ 1``), so the fragments take turns and the peak traffic is ``1/P`` of the model. The fragment's
exchange runs during the next ``τ`` (``overlap_steps``) inner steps; after step ``t + τ`` its outer step is taken
and the replica merges: ``θ_r ← α·θ_r + (1−α)·θ_global`` (``fragment_alpha``; ``α = 0`` loads ``θ_global``).
``τ < H/P`` so a fragment's merge comes before the next fragment starts. ``P = 1, τ = 0, α = 0`` is DiLoCo.

The peak traffic is the largest fragment's: ``balance="layers"`` cuts ``P`` blocks of (nearly) equal numbers of
layers, whose parameter counts can differ a lot (an embedding beside a LayerNorm); ``balance="params"`` cuts the
contiguous blocks whose largest parameter count is the smallest possible (exact, by dynamic programming over the
cut points), so the peak comes as close to ``d/P`` as the layer granularity allows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

__all__ = ["ScheduleFields", "StreamingSchedule", "balanced_cuts", "fragment_modules", "fragment_tensors", "layer_names"]

QUANTIZE = (None, "int8", "int4")
BALANCE = ("layers", "params")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class StreamingSchedule:
    """``H`` (``sync_every``), ``P`` (``num_fragments``), ``τ`` (``overlap_steps``), ``α`` (``fragment_alpha``) and
    the quantization of the exchange; checks itself on construction (errors name argument, value and rule)."""

    sync_every: int = 100
    num_fragments: int = 1
    overlap_steps: int = 0
    fragment_alpha: float = 0.0
    quantize: str | None = None
    balance: str = "layers"
    owner: str = "StreamingSchedule"

    def __post_init__(self) -> None:
        o, h, p, tau, a = self.owner, self.sync_every, self.num_fragments, self.overlap_steps, self.fragment_alpha
        if not _is_int(h) or h < 1:
            raise ValueError(f"{o}(sync_every={h!r}): sync_every must be an int >= 1")
        if not _is_int(p) or p < 1:
            raise ValueError(f"{o}(num_fragments={p!r}): num_fragments must be an int >= 1")
        if h % p:
            raise ValueError(f"{o}(num_fragments={p}): num_fragments must divide sync_every={h}, so that the "
                             "fragments synchronize at evenly spaced steps p·H/P")  # fmt: skip
        if not _is_int(tau) or not 0 <= tau < h // p:
            raise ValueError(f"{o}(overlap_steps={tau!r}): overlap_steps must be an int with 0 <= overlap_steps < "
                             f"sync_every/num_fragments = {h // p}, so a fragment merges before the next one starts")  # fmt: skip
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not (math.isfinite(a) and 0.0 <= a <= 1.0):
            raise ValueError(f"{o}(fragment_alpha={a!r}): fragment_alpha must be a number in [0, 1]")
        if self.quantize not in QUANTIZE:
            raise ValueError(f"{o}(quantize={self.quantize!r}): quantize must be None, 'int8' or 'int4'")
        if self.balance not in BALANCE:
            raise ValueError(f"{o}(balance={self.balance!r}): balance must be 'layers' (equal numbers of layers) or "
                             "'params' (equal parameter counts, as near as contiguous blocks of layers allow)")  # fmt: skip

    def offset(self, fragment: int) -> int:
        """``p·H/P``: where in the round fragment ``p`` starts its synchronization."""
        return fragment * (self.sync_every // self.num_fragments)

    def starts_after(self, step: int) -> list[int]:
        """Fragments whose synchronization starts after inner step ``step`` (1-based)."""
        return [p for p in range(self.num_fragments) if step >= 1 and step % self.sync_every == self.offset(p)]

    def merges_after(self, step: int) -> list[int]:
        """Fragments whose outer step and merge come after inner step ``step`` (started ``τ`` steps before)."""
        return self.starts_after(step - self.overlap_steps)


class ScheduleFields:
    """Mixin: the schedule's settings read as the strategy's own attributes (``strategy.sync_every``, ...)."""

    schedule: StreamingSchedule

    @property
    def sync_every(self) -> int:
        return self.schedule.sync_every

    @property
    def num_fragments(self) -> int:
        return self.schedule.num_fragments

    @property
    def overlap_steps(self) -> int:
        return self.schedule.overlap_steps

    @property
    def fragment_alpha(self) -> float:
        return self.schedule.fragment_alpha

    @property
    def quantize(self) -> str | None:
        return self.schedule.quantize

    @property
    def balance(self) -> str:
        return self.schedule.balance


def layer_names(module: nn.Module) -> list[str]:
    """The model's layers, in registration order: the modules that own parameters directly (``recurse=False``)."""
    return [name for name, m in module.named_modules() if any(True for _ in m.parameters(recurse=False))]


def balanced_cuts(sizes: list[int], parts: int) -> list[int]:
    """Where to cut ``sizes`` into ``parts`` non-empty contiguous blocks so the largest block sum is the smallest.

    Returns the block lengths. Dynamic programming over ``best[k][i]`` = the smallest largest sum of the first ``i``
    sizes in ``k`` blocks (``O(parts·n²)``; ties keep the earliest cut).
    """
    n = len(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    lengths, i = [], n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        lengths.append(i - j)
        i = j
    return lengths[::-1]


def fragment_modules(module: nn.Module, num_fragments: int, fragments: list[list[str]] | None, owner: str,
                     balance: str = "layers") -> list[list[str]]:  # fmt: skip
    """The module names of each fragment: the user's ``fragments``, or ``P`` contiguous blocks of layers (``balance``:
    ``"layers"``, equal numbers of layers; ``"params"``, :func:`balanced_cuts` of the layers' own parameter counts).

    Every parameter must fall in exactly one fragment; buffers go with the fragment of the module holding them
    (buffers of modules outside every fragment go with fragment 0).
    """
    if fragments is None:
        layers = layer_names(module)
        if num_fragments > len(layers):
            raise ValueError(f"{owner}(num_fragments={num_fragments}): the model has {len(layers)} layers with "
                             "parameters; num_fragments must not exceed that (a fragment is a block of layers)")  # fmt: skip
        if balance == "params":
            modules = dict(module.named_modules())
            sizes = [sum(t.numel() for t in modules[name].parameters(recurse=False)) for name in layers]
            lengths = balanced_cuts(sizes, num_fragments)
        else:
            size, extra = divmod(len(layers), num_fragments)
            lengths = [size + (1 if p < extra else 0) for p in range(num_fragments)]
        out, start = [], 0
        for length in lengths:
            out.append(layers[start : start + length])
            start += length
        return out
    modules = dict(module.named_modules())
    owners: dict[int, int] = {}
    for p, names in enumerate(fragments):
        for name in names:
            if name not in modules:
                raise ValueError(f"{owner}(fragments={fragments!r}): {name!r} is not a module name of the model")
            for param in modules[name].parameters():
                if owners.setdefault(id(param), p) != p:
                    raise ValueError(f"{owner}(fragments={fragments!r}): a parameter of {name!r} is in fragments "
                                     f"{owners[id(param)]} and {p}; every parameter must be in exactly one")  # fmt: skip
    missing = [n for n, prm in module.named_parameters() if id(prm) not in owners]
    if missing:
        raise ValueError(f"{owner}(fragments={fragments!r}): parameters {missing[:4]} are in no fragment; every "
                         "parameter must be in exactly one")  # fmt: skip
    return [list(names) for names in fragments]


def fragment_tensors(module: nn.Module, groups: list[list[str]]) -> list[tuple[list, list]]:
    """``(parameters, float buffers)`` of each fragment, in the model's registration order.

    A tensor belongs to the fragment listing the longest prefix of its name (its own module, or the nearest listed
    ancestor); a buffer under no listed module goes with fragment 0.
    """
    listed = {name: p for p, names in enumerate(groups) for name in names}

    def fragment_of(full_name: str) -> int | None:
        parts = full_name.split(".")
        for k in range(len(parts) - 1, -1, -1):
            owner = ".".join(parts[:k])
            if owner in listed:
                return listed[owner]
        return None

    out: list[tuple[list, list]] = [([], []) for _ in groups]
    for name, param in module.named_parameters():
        out[fragment_of(name)][0].append(param)
    for name, buf in module.named_buffers():
        if buf.is_floating_point():
            p = fragment_of(name)
            out[0 if p is None else p][1].append(buf)
    return out
