"""Cutting a network into pipeline stages: find the ``nn.Sequential``, list its layers, balance the cut.

The contract with a user's module: its network is one ``nn.Sequential`` (nested ``Sequential``
containers are flattened into their layers) that holds every trainable parameter of the module, and
the module calls it exactly once per step. A stage is a contiguous run of layers; every stage must
own parameters (an empty stage would have nothing to optimize).

Balancing (``balance=``):

* ``"parameters"``: minimize the largest stage's parameter count (DeepSpeed's default), the memory
  view: one stage's weights, gradients and optimizer state scale with it.
* ``"time"``: minimize the largest stage's measured forward + backward time per layer on an example
  input, the throughput view (a pipeline runs at the pace of its slowest stage).

Both solve the linear-partition problem exactly (dynamic programming over cut points placed just
before a parameterized layer, so parameter-free layers such as ``ReLU`` stay with the layer before).
``split_points`` names the layers that start stages 1..K-1 instead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["BALANCES", "Partition", "find_network", "layer_times", "list_layers", "partition", "split_by_names"]

BALANCES = ("parameters", "time")


@dataclass(frozen=True)
class Partition:
    """Stage ``s`` runs ``layers[bounds[s][0]:bounds[s][1]]``; ``names`` are the layers' qualified names."""

    names: tuple[str, ...]
    bounds: tuple[tuple[int, int], ...]
    weights: tuple[float, ...]  # per stage: parameters or seconds, whatever the balance measured

    def stage_names(self, stage: int) -> tuple[str, ...]:
        a, b = self.bounds[stage]
        return self.names[a:b]

    def __str__(self) -> str:
        return "; ".join(f"stage {s}: {n[0]}..{n[-1]}" if len(n) > 1 else f"stage {s}: {n[0]}"
                         for s, n in enumerate(self.stage_names(s) for s in range(len(self.bounds))))  # fmt: skip


def _trainable(module: nn.Module) -> set[int]:
    return {id(p) for p in module.parameters() if p.requires_grad}


def find_network(module: nn.Module, name: str | None = None) -> tuple[str, nn.Sequential]:
    """The ``(qualified name, nn.Sequential)`` holding all of ``module``'s trainable parameters.

    With ``name`` given, that submodule (it must be an ``nn.Sequential``). Otherwise the outermost
    ``nn.Sequential`` whose parameters are all the module's; ``ValueError`` says what is outside.
    """
    owner = type(module).__name__
    everything = _trainable(module)
    if name is not None:
        try:
            net = module.get_submodule(name)
        except AttributeError:
            raise ValueError(f"network={name!r}: {owner} has no submodule {name!r}") from None
        if not isinstance(net, nn.Sequential):
            raise ValueError(f"network={name!r}: {owner}.{name} is a {type(net).__name__}; the pipeline splits an nn.Sequential")
        outside = everything - _trainable(net)
        if outside:
            names = [n for n, p in module.named_parameters() if id(p) in outside]
            raise ValueError(f"network={name!r}: parameters outside it would never train: {', '.join(names[:4])}")
        return name, net
    best: tuple[str, nn.Sequential, int] | None = None
    for qualname, sub in module.named_modules():
        if isinstance(sub, nn.Sequential):
            held = len(_trainable(sub) & everything)
            if _trainable(sub) == everything and everything:
                return qualname, sub
            if best is None or held > best[2]:
                best = (qualname, sub, held)
    total = sum(p.numel() for p in module.parameters() if p.requires_grad)
    if best is None:
        raise ValueError(
            f"{owner} has no nn.Sequential: the pipeline splits one nn.Sequential holding the whole network. "
            f"Build the network as nn.Sequential(...) (its forward must run the layers in order), or name it with network='...'"
        )
    qualname, sub, _ = best
    inside = _trainable(sub)
    held = sum(p.numel() for p in sub.parameters() if p.requires_grad)
    outside = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in inside]
    raise ValueError(
        f"{owner}'s parameters are not all inside one nn.Sequential ({qualname or 'the module'} holds {held:,} of {total:,}; "
        f"outside: {', '.join(outside[:4])}{', ...' if len(outside) > 4 else ''}). Put the whole network in one nn.Sequential "
        "whose forward runs the layers in order, or name it with network='...'"
    )


def list_layers(network: nn.Sequential, prefix: str) -> list[tuple[str, nn.Module]]:
    """The layers of ``network`` in order, nested ``nn.Sequential`` containers flattened."""
    layers = []
    for name, child in network.named_children():
        qualname = f"{prefix}.{name}" if prefix else name
        if isinstance(child, nn.Sequential):
            layers += list_layers(child, qualname)
        else:
            layers.append((qualname, child))
    return layers


def _param_count(layer: nn.Module) -> int:
    return sum(p.numel() for p in layer.parameters() if p.requires_grad)


def _groups(layers: list[tuple[str, nn.Module]]) -> list[int]:
    """Indices where a stage may start: each parameterized layer but the first (and 0)."""
    starts = [i for i, (_, layer) in enumerate(layers) if _param_count(layer) > 0]
    return [0] + starts[1:] if starts else [0]


def partition(layers: list[tuple[str, nn.Module]], num_stages: int, weights: list[float] | None = None) -> Partition:
    """Contiguous ``num_stages``-way cut of ``layers`` minimizing the largest stage weight.

    ``weights`` per layer (default: trainable parameter counts). Raises ``ValueError`` when fewer than
    ``num_stages`` layers hold parameters.
    """
    names = tuple(n for n, _ in layers)
    weights = [float(_param_count(m)) for _, m in layers] if weights is None else [float(w) for w in weights]
    starts = _groups(layers)
    if sum(1 for _, m in layers if _param_count(m) > 0) < num_stages:
        held = sum(1 for _, m in layers if _param_count(m) > 0)
        raise ValueError(
            f"num_stages={num_stages}: the network has {held} layer{'s' * (held != 1)} with parameters "
            f"({len(layers)} layers in all); every stage needs one"
        )
    # group g spans layers[starts[g]:starts[g+1]]
    ends = starts[1:] + [len(layers)]
    gw = [sum(weights[a:b]) for a, b in zip(starts, ends)]
    n = len(gw)
    prefix = [0.0]
    for w in gw:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: smallest max-stage weight cutting the first i groups into k stages
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds, i = [], n
    for k in range(num_stages, 0, -1):
        j = cut[k][i]
        bounds.append((starts[j], ends[i - 1]))
        i = j
    bounds.reverse()
    return Partition(names, tuple(bounds), tuple(sum(weights[a:b]) for a, b in bounds))


def split_by_names(layers: list[tuple[str, nn.Module]], split_points: list[str]) -> Partition:
    """Stages starting at the layers named in ``split_points`` (stage 0 starts at the first layer)."""
    names = tuple(n for n, _ in layers)
    starts = [0]
    for point in split_points:
        matches = [i for i, n in enumerate(names) if n == point or n.startswith(point + ".")]
        if not matches:
            raise ValueError(f"split_points: {point!r} is not a layer of the network (layers: {', '.join(names[:6])}, ...)")
        if matches[0] <= starts[-1]:
            raise ValueError(f"split_points: {point!r} must come after {names[starts[-1]]!r}; list split points in network order")
        starts.append(matches[0])
    bounds = tuple(zip(starts, starts[1:] + [len(names)]))
    for s, (a, b) in enumerate(bounds):
        if not any(_param_count(m) > 0 for _, m in layers[a:b]):
            raise ValueError(f"split_points: stage {s} ({', '.join(names[a:b])}) holds no parameters; every stage needs some")
    return Partition(names, bounds, tuple(float(sum(_param_count(m) for _, m in layers[a:b])) for a, b in bounds))


def layer_times(layers: list[tuple[str, nn.Module]], example: Tensor, repeats: int = 3) -> list[float]:
    """Median forward + backward seconds of each layer, feeding each the previous layer's output."""
    times, x = [], example
    for _, layer in layers:
        samples = []
        for _ in range(repeats):
            inp = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            out = layer(inp)
            if out.requires_grad:
                out.float().sum().backward()
            samples.append(time.perf_counter() - start)
        layer.zero_grad(set_to_none=True)
        times.append(sorted(samples)[len(samples) // 2])
        with torch.no_grad():
            x = layer(x)
    return times
