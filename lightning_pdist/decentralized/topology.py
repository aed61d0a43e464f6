"""Gossip graphs and mixing matrices of decentralized SGD (D-PSGD, AD-PSGD): one process, torch only.

**D-PSGD** (Lian et al. 2017, "Can Decentralized Algorithms Outperform Centralized Algorithms?", Algorithm 1). Ranks
``i = 0..n-1`` sit on an undirected graph with neighbour sets ``N(i)``; the mixing matrix has uniform weights

    W_ij = 1 / (deg(i) + 1)   for j ∈ N(i) ∪ {i},   0 otherwise,

doubly stochastic for the regular graphs built here (ring, torus, exponential, complete). Each step every rank computes
``g_i = ∇F_i(x_i(t); ξ_i)`` at its own model, replaces its model by ``Σ_j W_ij x_j(t)`` (:func:`mix`) and lets the
optimizer apply ``g_i``; for SGD ``x_i(t+1) = Σ_j W_ij x_j(t) − γ g_i``. A user's matrix is accepted when it is
square, non-negative and doubly stochastic (:func:`check_mixing_matrix`): then the mean of the models moves only by
the mean of the gradient steps (with γ = 0 it is preserved).

**AD-PSGD** (Lian et al. 2018, "Asynchronous Decentralized Parallel SGD"): the graph is split into *active* ranks (even)
and *passive* ranks (odd); only edges between an active and a passive rank are used (:func:`bipartite_edges`), so an
active rank only ever waits for a passive one and no cycle of waits (deadlock) can form. Each active rank picks one of
its passive neighbours uniformly at random per step (:func:`pick_partner`) and both take ``(x_i + x_j) / 2``.

**Asynchrony as momentum** (Mitliagkas et al. 2016, "Asynchrony begets momentum"): with ``M`` asynchronous workers the
expected update carries an implicit momentum ``1 − 1/M``; :func:`compensated_momentum` lowers the explicit momentum by
that much (floored at 0). The rule lives in :mod:`lightning_pdist.core.momentum` (the parameter server's async mode
uses it too) and is re-exported here.
"""

from __future__ import annotations

import math
import random
from typing import Any

import torch
from torch import Tensor

from lightning_pdist.core.momentum import compensated_momentum, implicit_momentum

__all__ = ["TOPOLOGIES", "bipartite_edges", "check_mixing_matrix", "compensated_momentum", "implicit_momentum",
           "is_connected", "min_ranks", "mix", "mixing_matrix", "neighbour_sets", "pick_partner", "torus_shape_for", "uniform_mixing"]  # fmt: skip

#: The named graphs.
TOPOLOGIES = ("ring", "torus", "exponential", "complete")
#: Tolerance of the doubly-stochastic check on a user's matrix (row and column sums within this of 1).
STOCHASTIC_TOL = 1e-6


def torus_shape_for(n: int) -> tuple[int, int] | None:
    """The most nearly square ``r × c = n`` with ``2 <= r <= c``; None when ``n`` has no such factorization (a prime)."""
    for r in range(int(math.isqrt(n)), 1, -1):
        if n % r == 0:
            return r, n // r
    return None


def min_ranks(topology: str) -> int:
    """Fewest ranks a named graph needs (a torus: 4 = 2 × 2; the others: 2)."""
    return 4 if topology == "torus" else 2


def neighbour_sets(topology: str, n: int, torus_shape: tuple[int, int] | None = None) -> list[set[int]]:
    """``N(i)`` for every rank of a named graph on ``n`` ranks (undirected; a rank is never its own neighbour).

    * ``ring``: ``i ± 1 (mod n)``.
    * ``torus``: a 2-D ``r × c`` torus (``torus_shape``, default :func:`torus_shape_for`), rank ``i = a·c + b``
      linked to ``(a ± 1, b)`` and ``(a, b ± 1)`` modulo the sides.
    * ``exponential``: ``i ± 2^k (mod n)`` for ``2^k < n``: the static, undirected form of the exponential graph of
      Assran et al. 2019 (SGP), which cycles through these peers one per step with push-sum weights instead.
    * ``complete``: every other rank.
    """
    if topology == "ring":
        return [{(i - 1) % n, (i + 1) % n} - {i} for i in range(n)]
    if topology == "complete":
        return [set(range(n)) - {i} for i in range(n)]
    if topology == "exponential":
        hops = [2**k for k in range(max(1, n).bit_length()) if 2**k < n]
        return [({(i + h) % n for h in hops} | {(i - h) % n for h in hops}) - {i} for i in range(n)]
    if topology == "torus":
        r, c = torus_shape if torus_shape is not None else torus_shape_for(n)  # type: ignore[misc]
        out = []
        for i in range(n):
            a, b = divmod(i, c)
            out.append({((a + 1) % r) * c + b, ((a - 1) % r) * c + b, a * c + (b + 1) % c, a * c + (b - 1) % c} - {i})
        return out
    raise ValueError(f"unknown topology {topology!r}; choose one of {', '.join(TOPOLOGIES)} or a mixing matrix")


def uniform_mixing(neighbours: list[set[int]]) -> Tensor:
    """Lian et al.'s weights: ``W_ij = 1/(deg(i)+1)`` for ``j ∈ N(i) ∪ {i}`` (float64)."""
    n = len(neighbours)
    w = torch.zeros(n, n, dtype=torch.float64)
    for i, nbrs in enumerate(neighbours):
        for j in nbrs | {i}:
            w[i, j] = 1.0 / (len(nbrs) + 1)
    return w


def check_mixing_matrix(matrix: Any) -> tuple[Tensor | None, str]:
    """``(W as float64, "")`` when ``matrix`` is square, non-negative and doubly stochastic, else ``(None, the rule broken)``."""
    try:
        w = torch.as_tensor(matrix, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as err:
        return None, f"a mixing matrix must be a square array of numbers ({err})"
    if w.ndim != 2 or w.shape[0] != w.shape[1] or w.shape[0] == 0:
        return None, f"a mixing matrix must be square (n × n, n = the number of ranks); got shape {tuple(w.shape)}"
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        return None, "a mixing matrix must hold finite, non-negative weights"
    rows, cols = w.sum(1), w.sum(0)
    if not (bool(torch.allclose(rows, torch.ones_like(rows), atol=STOCHASTIC_TOL, rtol=0))
            and bool(torch.allclose(cols, torch.ones_like(cols), atol=STOCHASTIC_TOL, rtol=0))):  # fmt: skip
        return None, (f"a mixing matrix must be doubly stochastic (every row and every column sums to 1 within "
                      f"{STOCHASTIC_TOL}); row sums {[round(float(s), 6) for s in rows]}, column sums "
                      f"{[round(float(s), 6) for s in cols]}")  # fmt: skip
    return w, ""


def mixing_matrix(topology: str | Tensor, n: int, torus_shape: tuple[int, int] | None = None) -> Tensor:
    """W (float64, ``n × n``) for a named graph (uniform weights) or a checked user matrix."""
    if isinstance(topology, str):
        return uniform_mixing(neighbour_sets(topology, n, torus_shape))
    w, rule = check_mixing_matrix(topology)
    if w is None:
        raise ValueError(rule)
    return w


def mix(own: Tensor, received: dict[int, Tensor], weights: dict[int, float], self_weight: float) -> Tensor:
    """``Σ_j W_ij x_j``: ``self_weight · own + Σ_j weights[j] · received[j]`` (a new tensor, ``own``'s dtype)."""
    out = own * self_weight
    for j in sorted(received):
        out.add_(received[j], alpha=weights[j])
    return out


def bipartite_edges(support: Tensor) -> list[set[int]]:
    """AD-PSGD's graph: for each rank, its neighbours on the other side of the even (active) / odd (passive) split.

    ``support[i, j]`` non-zero means ``i`` and ``j`` are linked (either direction counts).
    """
    n = support.shape[0]
    linked = (support != 0) | (support.T != 0)
    return [{j for j in range(n) if j != i and bool(linked[i, j]) and (i - j) % 2 == 1} for i in range(n)]


def is_connected(edges: list[set[int]]) -> bool:
    """Whether the undirected graph given by neighbour sets is connected."""
    seen, todo = {0}, [0]
    while todo:
        for j in edges[todo.pop()]:
            if j not in seen:
                seen.add(j)
                todo.append(j)
    return len(seen) == len(edges)


def pick_partner(rng: random.Random, partners: list[int]) -> int:
    """One passive neighbour, uniformly at random (AD-PSGD's per-step choice)."""
    return partners[rng.randrange(len(partners))]
