"""Sharded parameter servers in their own processes: sync (with backup workers), Downpour async, SSP, DC-ASGD,
asynchronous EASGD/EAMSGD; Sandblaster L-BFGS (:mod:`.sandblaster`, :mod:`.sandblaster_server`, :mod:`.sandblaster_strategy`).

Math: :mod:`.sharding`, :mod:`.rules`, :mod:`.elastic`. Transport: :mod:`.wire`, :mod:`.auth`, :mod:`.shard`, :mod:`.layout`,
:mod:`.loop`, :mod:`.server`, :mod:`.process` (``python -m lightning_pdist.parameter_server.process`` runs one by
hand), :mod:`.client`, :mod:`.workers`. Wiring: :mod:`.config`, :mod:`.precision`, :mod:`.elastic_worker`, :mod:`.strategy`; Parallax: :mod:`.parallax` (math), :mod:`.parallax_rows` (transport), :mod:`.parallax_strategy`. Card: ``docs/algorithms/parameter_server.md``.
"""

from lightning_pdist.core.lazy import lazy_names

__getattr__, __dir__ = lazy_names(__name__, {  # imported on first use: importing a transport module stays Lightning-free
    "ParameterServerConfig": "config",
    "ShardingPlan": "sharding",
    "plan_sharding": "sharding",
    "ParameterServerStrategy": "strategy",
    "ParallaxStrategy": "parallax_strategy",
    "SandblasterStrategy": "sandblaster_strategy",
})

__all__ = ["ParallaxStrategy", "ParameterServerConfig", "ParameterServerStrategy", "SandblasterStrategy", "ShardingPlan", "plan_sharding"]
