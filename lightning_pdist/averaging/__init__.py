"""Periodic model averaging: local SGD, one-shot averaging (SimuParallelSGD), BMUF and EASGD.

Math: :mod:`.schedule`, :mod:`.rules`, :mod:`.bmuf`, :mod:`.easgd` (one rule object per algorithm, driven by both
shells). Transport: :mod:`.replicas`. Lightning wiring: :mod:`.strategy` (+ one file per Trainer strategy) and
:mod:`.fabric` (+ one file per Fabric strategy). Cards: ``docs/algorithms/{local_sgd,bmuf,easgd}.md``.
"""

from lightning_pdist.averaging.bmuf import BMUFConfig, BMUFRule, BMUFState, bmuf_block_update_, bmuf_global_model
from lightning_pdist.averaging.bmuf_fabric import BMUFFabricStrategy
from lightning_pdist.averaging.bmuf_strategy import BMUFStrategy
from lightning_pdist.averaging.easgd import EASGDConfig, EASGDRule, EASGDState, easgd_update_
from lightning_pdist.averaging.easgd_fabric import EASGDFabricStrategy
from lightning_pdist.averaging.easgd_strategy import EASGDStrategy
from lightning_pdist.averaging.local_sgd_fabric import LocalSGDFabricStrategy
from lightning_pdist.averaging.local_sgd_strategy import LocalSGDStrategy
from lightning_pdist.averaging.rules import AveragingRule, LocalSGDRule, SimuParallelRule
from lightning_pdist.averaging.schedule import OneShotSchedule, PeriodicSchedule
from lightning_pdist.averaging.simuparallel_fabric import SimuParallelSGDFabricStrategy
from lightning_pdist.averaging.simuparallel_strategy import SimuParallelSGDStrategy

__all__ = ["AveragingRule", "BMUFConfig", "BMUFFabricStrategy", "BMUFRule", "BMUFState", "BMUFStrategy", "EASGDConfig",
           "EASGDFabricStrategy", "EASGDRule", "EASGDState", "EASGDStrategy", "LocalSGDFabricStrategy", "LocalSGDRule",
           "LocalSGDStrategy", "OneShotSchedule", "PeriodicSchedule", "SimuParallelRule", "SimuParallelSGDFabricStrategy",
           "SimuParallelSGDStrategy", "bmuf_block_update_", "bmuf_global_model", "easgd_update_"]  # fmt: skip
