"""Where to cut any module into pipeline stages, from the order in which its forward calls its submodules.

A *call trace* is the list of submodule names in the order their ``forward`` was entered during one
call of the network (pre-order: a container before its children; a module called twice appears twice).
A stage boundary is the entry of a named submodule (torch pipelining's split-spec semantics: the
split point starts the next stage) or :data:`END`, the network's output (a stage after it only
computes the loss). Stage ``s`` runs the calls in ``[b_{s-1}, b_s)`` of the trace.

* :func:`check_split_points`: the user's names must be submodules that the forward calls exactly
  once, listed in execution order.
* :func:`auto_split_points`: ``K - 1`` boundaries among the *candidate* calls (blocks: children of an
  ``nn.ModuleList``/``nn.Sequential``, or of the network itself, called once) minimizing the largest
  stage's parameter count, the linear-partition problem solved exactly by dynamic programming
  (DeepSpeed's ``partition_method="parameters"``); trailing stages may be empty when there are
  fewer candidates than stages.
* :func:`owners`: each module holding weights lives on the one stage whose calls use it; a module
  called from two stages (tied or reused across the cut) is refused.

Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["END", "auto_split_points", "check_split_points", "owners", "stage_of_calls"]

END = "<end>"  # the boundary after the network's last call: the next stage receives its output


def check_split_points(points: Sequence[str], trace: Sequence[str], modules: Sequence[str], network: str,
                       owner: str = "PipelineStrategy") -> list[int]:  # fmt: skip
    """Positions in ``trace`` where each split point is entered; ``ValueError`` naming the point and the rule."""
    known, positions = set(modules), []
    for point in points:
        if point not in known:
            near = [m for m in modules if m.rsplit(".", 1)[-1] == point.rsplit(".", 1)[-1]][:3] or list(modules)[:4]
            raise ValueError(f"{owner}(split_points=[..., {point!r}, ...]): {point!r} is not a submodule of "
                             f"{network or 'the module'} (split points name submodules, e.g. {', '.join(map(repr, near))})")  # fmt: skip
        at = [i for i, name in enumerate(trace) if name == point]
        if len(at) != 1:
            rule = "is never called by its forward" if not at else f"is called {len(at)} times per forward"
            raise ValueError(f"{owner}(split_points=[..., {point!r}, ...]): {point!r} {rule}; a split point must be a "
                             "submodule the network's forward calls exactly once")  # fmt: skip
        if positions and at[0] <= positions[-1]:
            before = points[len(positions) - 1]
            raise ValueError(f"{owner}(split_points={list(points)!r}): {point!r} runs before {before!r} in the forward; "
                             "list split points in execution order")  # fmt: skip
        positions.append(at[0])
    return positions


def stage_of_calls(trace_len: int, boundaries: Sequence[int]) -> list[int]:
    """Stage of each call: the number of boundaries at or before it (``END`` is ``trace_len``)."""
    return [sum(1 for b in boundaries if b <= i) for i in range(trace_len)]


def owners(trace: Sequence[str], boundaries: Sequence[int], holders: Mapping[str, Sequence[int]],
           owner: str = "PipelineStrategy") -> dict[str, int]:  # fmt: skip
    """Stage of every module holding weights: the stage of its calls (never called: its nearest called ancestor's).

    ``holders`` maps a module name to the ids of the tensors it holds directly (parameters, buffers), so
    a tensor shared by two modules (tied weights) counts for both. ``ValueError`` when one is used on two stages.
    """
    stages = stage_of_calls(len(trace), boundaries)
    by_name: dict[str, set[int]] = {}
    for name, stage in zip(trace, stages):
        by_name.setdefault(name, set()).add(stage)
    result, tensor_stage = {}, {}
    for name, tensors in holders.items():
        up = name
        while up and up not in by_name:  # never called itself: its weights are used by an enclosing module's code
            up = up.rpartition(".")[0]
        used = by_name.get(up, {0})
        if len(used) > 1:
            raise ValueError(f"{owner}: {name or 'the network'} is called on stages {sorted(used)}; a module's weights live "
                             "on one stage, so choose split points that keep all of its calls in one stage")  # fmt: skip
        result[name] = stage = next(iter(used))
        for t in tensors:
            other = tensor_stage.setdefault(t, (name, stage))
            if other[1] != stage:
                raise ValueError(f"{owner}: {name} and {other[0]} share a weight (tied) but run on stages {other[1]} and "
                                 f"{stage}; keep tied modules in one stage with split_points")  # fmt: skip
    return result


def auto_split_points(num_stages: int, weights: Sequence[float], candidates: Sequence[int],
                      exclude: frozenset[int] = frozenset()) -> list[int]:  # fmt: skip
    """``num_stages - 1`` boundaries (positions, ``END`` as ``len(weights)``) minimizing the largest stage weight.

    ``weights[i]``: what call ``i`` adds to its stage (the parameters of the modules it enters first).
    Boundaries are chosen among ``candidates`` (increasing positions) minus ``exclude``; ``END`` may repeat.
    """
    n = len(weights)
    cuts = [c for c in sorted(set(candidates)) if 0 < c < n and c not in exclude]
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    points = [0] + cuts + [n]  # index 0: the start; the last: END
    inf = float("inf")
    k_max = num_stages - 1
    # best[k][q]: smallest max stage weight with k boundaries, the k-th at points[q] (q=0 only for k=0)
    best = [[inf] * len(points) for _ in range(k_max + 1)]
    back = [[-1] * len(points) for _ in range(k_max + 1)]
    best[0][0] = 0.0
    for k in range(1, k_max + 1):
        for q in range(1, len(points)):
            for r in range(0, q + 1 if q == len(points) - 1 else q):  # END may follow END
                if best[k - 1][r] == inf or (r == 0 and k > 1):
                    continue
                cost = max(best[k - 1][r], prefix[points[q]] - prefix[points[r]])
                if cost < best[k][q]:
                    best[k][q], back[k][q] = cost, r
    total = [max(best[k_max][q], prefix[n] - prefix[points[q]]) for q in range(len(points))]
    q = min(range(1, len(points)), key=lambda i: (total[i], -i)) if k_max else 0
    chosen = []
    for k in range(k_max, 0, -1):
        chosen.append(points[q])
        q = back[k][q]
    return sorted(chosen)
