"""Decentralized SGD's settings, checked at construction, and the per-rank plan they give for a world size.

Construction refuses what is wrong whatever the world size (an unknown topology, a mixing matrix that is not doubly
stochastic, a torus shape with a side below 2, ``implicit_momentum`` on the synchronous mode). What depends on the
number of ranks (a torus on a prime number of ranks, a matrix of another size, fewer ranks than the graph needs, an
AD-PSGD graph without active–passive edges; one rank is accepted by every named graph: nothing to exchange) is refused by :meth:`DecentralizedConfig.plan`: the strategy calls it
when the ``Trainer`` is built (``devices × num_nodes`` is known then, before any process starts) and again at setup.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_pdist.core.config import ConfigErrors, is_int
from lightning_pdist.decentralized.topology import (TOPOLOGIES, bipartite_edges, check_mixing_matrix, is_connected,
                                                    min_ranks, mixing_matrix, torus_shape_for)  # fmt: skip

__all__ = ["DecentralizedConfig", "GossipRecord", "RankPlan"]

MODES = ("sync", "async")
IMPLICIT_MOMENTUM = (None, "compensate")


@dataclass(frozen=True)
class RankPlan:
    """What one rank does with the mixing matrix ``W``.

    Synchronous (D-PSGD): receive from ``recv_from`` (``W_ij ≠ 0``) with ``weights[j] = W_ij``, keep ``self_weight =
    W_ii``, send to ``send_to`` (``W_ki ≠ 0``). Asynchronous (AD-PSGD): ``active`` (an even rank) picks among
    ``partners`` (its neighbours of the other parity); a passive rank serves ``partners``.
    """

    rank: int
    world_size: int
    matrix: Tensor
    recv_from: list[int]
    send_to: list[int]
    weights: dict[int, float]
    self_weight: float
    active: bool
    partners: list[int]


@dataclass(frozen=True)
class DecentralizedConfig(ConfigErrors):
    topology: Any = "ring"
    mode: str = "sync"
    implicit_momentum: str | None = None
    torus_shape: tuple[int, int] | None = None
    seed: int = 0
    owner: str = "DecentralizedStrategy"
    matrix: Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.topology, str):
            if self.topology not in TOPOLOGIES:
                self._fail("topology", f"unknown topology; choose one of {', '.join(map(repr, TOPOLOGIES))} or give a "
                                       "doubly stochastic n × n mixing matrix (n = the number of ranks)")  # fmt: skip
        else:
            w, rule = check_mixing_matrix(self.topology)
            if w is None:
                self._fail("topology", rule)
            object.__setattr__(self, "matrix", w)
        if self.mode not in MODES:
            self._fail("mode", "mode must be 'sync' (D-PSGD, registered 'dpsgd') or 'async' (AD-PSGD, 'adpsgd')")
        if self.implicit_momentum not in IMPLICIT_MOMENTUM:
            self._fail("implicit_momentum", "implicit_momentum must be None or 'compensate'")
        if self.implicit_momentum == "compensate" and self.mode != "async":
            self._fail("implicit_momentum", "'compensate' lowers the momentum that asynchrony adds; mode='sync' (D-PSGD) "
                                            "has no asynchrony: use it with mode='async' (adpsgd)")  # fmt: skip
        if self.torus_shape is not None:
            shape = self.torus_shape
            if self.topology != "torus":
                self._fail("torus_shape", "torus_shape is for topology='torus' only")
            if not (isinstance(shape, (tuple, list)) and len(shape) == 2 and all(is_int(s) and s >= 2 for s in shape)):
                self._fail("torus_shape", "torus_shape must be (rows, columns), two ints >= 2")
            object.__setattr__(self, "torus_shape", (int(shape[0]), int(shape[1])))
        if not is_int(self.seed):
            self._fail("seed", "seed must be an int", TypeError)

    @property
    def name(self) -> str:
        """The topology for messages: its name, or ``'matrix'``."""
        return self.topology if isinstance(self.topology, str) else "matrix"

    def checkpoint_fields(self, plan: RankPlan | None) -> dict[str, Any]:
        """What a checkpoint records of the topology (read back by nothing: it says what the run mixed with)."""
        return {"topology": self.name} | ({} if plan is None else {"mixing_matrix": plan.matrix.tolist()})

    def check_world(self, world_size: int) -> Tensor:
        """W for ``world_size`` ranks; ``ValueError`` naming the argument and the rule when it cannot be built."""
        topo = "topology" if not isinstance(self.topology, str) else f"topology={self.topology!r}"
        where = f"{self.owner}({topo})"
        if self.matrix is not None:
            if self.matrix.shape[0] != world_size:
                raise ValueError(f"{where}: the mixing matrix is {self.matrix.shape[0]} × {self.matrix.shape[1]} but the "
                                 f"run has {world_size} ranks (devices × num_nodes); give an n × n matrix for n ranks")  # fmt: skip
            w = self.matrix
        elif world_size == 1:  # nothing to exchange: plain SGD (the strategy warns)
            return torch.ones(1, 1, dtype=torch.float64)
        else:
            need = min_ranks(self.topology)
            if self.torus_shape is not None:
                need = self.torus_shape[0] * self.torus_shape[1]
                if world_size != need:
                    raise ValueError(f"{self.owner}(torus_shape={self.torus_shape}): a {self.torus_shape[0]} × "
                                     f"{self.torus_shape[1]} torus needs exactly {need} ranks; the run has {world_size} "
                                     "(devices × num_nodes)")  # fmt: skip
            if world_size < need:
                raise ValueError(f"{where}: needs at least {need} ranks; the run has {world_size} (devices × num_nodes)")
            if self.topology == "torus" and self.torus_shape is None and torus_shape_for(world_size) is None:
                raise ValueError(f"{where}: {world_size} ranks cannot form an r × c torus with r, c >= 2 ({world_size} is "
                                 "prime); use 'ring' or 'exponential', or a number of ranks with a factorization")  # fmt: skip
            w = mixing_matrix(self.topology, world_size, self.torus_shape)
        if self.mode == "async" and world_size > 1:
            edges = bipartite_edges(w)
            if world_size < 2 or any(not e for e in edges) or not is_connected(edges):
                raise ValueError(f"{where}, mode='async': AD-PSGD averages only across the even (active) / odd (passive) "
                                 f"split; on {world_size} ranks this graph's edges between the two sides "
                                 f"({[sorted(e) for e in edges]}) leave a rank alone or the graph disconnected")  # fmt: skip
        return w

    def plan(self, rank: int, world_size: int) -> RankPlan:
        w = self.check_world(world_size)
        recv_from = [j for j in range(world_size) if j != rank and float(w[rank, j]) != 0.0]
        send_to = [k for k in range(world_size) if k != rank and float(w[k, rank]) != 0.0]
        partners = sorted(bipartite_edges(w)[rank]) if self.mode == "async" else []
        return RankPlan(rank=rank, world_size=world_size, matrix=w, recv_from=recv_from, send_to=send_to,
                        weights={j: float(w[rank, j]) for j in recv_from}, self_weight=float(w[rank, rank]),
                        active=rank % 2 == 0, partners=partners)  # fmt: skip


class GossipRecord:
    """Mixed into both shells (Trainer and Fabric): the checkpoint record ``"step"`` plus what the topology was
    (:meth:`DecentralizedConfig.checkpoint_fields`), written and read back once for both."""

    config: DecentralizedConfig
    plan: RankPlan | None
    step: int

    def pdist_state_dict(self) -> dict:
        state = super().pdist_state_dict()  # type: ignore[misc]
        return state | {"step": self.step} | self.config.checkpoint_fields(self.plan)

    def load_pdist_state_dict(self, state: dict) -> None:
        super().load_pdist_state_dict(state)  # type: ignore[misc]
        self.step = int(state.get("step", 0))
