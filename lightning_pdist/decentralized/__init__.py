"""Decentralized SGD without a parameter server: D-PSGD (synchronous gossip) and AD-PSGD (asynchronous pairs).

Math: :mod:`.topology` (graphs, mixing matrices, the mixing step, AD-PSGD's bipartite split, the implicit-momentum
rule), :mod:`.config` (the settings and each rank's plan). Transport: :mod:`.gossip` (point-to-point gloo messages).
Lightning wiring: :mod:`.strategy` (the Trainer), :mod:`.fabric` (D-PSGD under Fabric). Card: ``docs/algorithms/dpsgd.md``.
"""

from lightning_pdist.core.lazy import lazy_names

__getattr__, __dir__ = lazy_names(__name__, {  # imported on first use: importing a transport module stays Lightning-free
    "DecentralizedConfig": "config",
    "RankPlan": "config",
    "DecentralizedStrategy": "strategy",
    "DecentralizedFabricStrategy": "fabric",
    "TOPOLOGIES": "topology",
    "compensated_momentum": "topology",
    "implicit_momentum": "topology",
    "mix": "topology",
    "mixing_matrix": "topology",
    "neighbour_sets": "topology",
    "uniform_mixing": "topology",
})

__all__ = ["DecentralizedConfig", "DecentralizedFabricStrategy", "DecentralizedStrategy", "RankPlan", "TOPOLOGIES", "compensated_momentum",
           "implicit_momentum", "mix", "mixing_matrix", "neighbour_sets", "uniform_mixing"]  # fmt: skip
