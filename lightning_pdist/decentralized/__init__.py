"""Decentralized SGD without a parameter server: D-PSGD (synchronous gossip) and AD-PSGD (asynchronous pairs).

Math: :mod:`.topology` (graphs, mixing matrices, the mixing step, AD-PSGD's bipartite split, the implicit-momentum
rule), :mod:`.config` (the settings and each rank's plan). Transport: :mod:`.gossip` (point-to-point gloo messages).
Lightning wiring: :mod:`.strategy`. Card: ``docs/algorithms/dpsgd.md``.
"""

from lightning_pdist.decentralized.config import DecentralizedConfig, RankPlan
from lightning_pdist.decentralized.strategy import DecentralizedStrategy
from lightning_pdist.decentralized.topology import (TOPOLOGIES, compensated_momentum, implicit_momentum, mix,
                                                    mixing_matrix, neighbour_sets, uniform_mixing)  # fmt: skip

__all__ = ["DecentralizedConfig", "DecentralizedStrategy", "RankPlan", "TOPOLOGIES", "compensated_momentum",
           "implicit_momentum", "mix", "mixing_matrix", "neighbour_sets", "uniform_mixing"]  # fmt: skip
