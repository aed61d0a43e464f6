"""Sharded parameter servers in their own processes: sync (with backup workers), Downpour async, SSP, DC-ASGD,
asynchronous EASGD/EAMSGD.

Math: :mod:`.sharding`, :mod:`.rules`, :mod:`.elastic`. Transport: :mod:`.wire`, :mod:`.auth`, :mod:`.shard`, :mod:`.layout`,
:mod:`.loop`, :mod:`.server`, :mod:`.process` (``python -m lightning_pdist.parameter_server.process`` runs one by
hand), :mod:`.client`, :mod:`.workers`. Wiring: :mod:`.config`, :mod:`.precision`, :mod:`.elastic_worker`, :mod:`.strategy`. Card: ``docs/algorithms/parameter_server.md``.
"""

from lightning_pdist.parameter_server.config import ParameterServerConfig
from lightning_pdist.parameter_server.sharding import ShardingPlan, plan_sharding
from lightning_pdist.parameter_server.strategy import ParameterServerStrategy

__all__ = ["ParameterServerConfig", "ParameterServerStrategy", "ShardingPlan", "plan_sharding"]
