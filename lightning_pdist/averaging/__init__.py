"""Periodic model averaging: local SGD, one-shot averaging (SimuParallelSGD), BMUF and EASGD.

Math: :mod:`.schedule`, :mod:`.bmuf`, :mod:`.easgd`. Lightning wiring: :mod:`.strategy` (+ one file per Trainer
strategy) and :mod:`.fabric` (+ one file per Fabric strategy). Cards: ``docs/algorithms/{local_sgd,bmuf,easgd}.md``.
"""

from lightning_pdist.averaging.bmuf import BMUFConfig, BMUFState, bmuf_block_update_, bmuf_global_model
from lightning_pdist.averaging.bmuf_fabric import BMUFFabricStrategy
from lightning_pdist.averaging.bmuf_strategy import BMUFStrategy
from lightning_pdist.averaging.easgd import EASGDConfig, EASGDState, easgd_update_
from lightning_pdist.averaging.easgd_fabric import EASGDFabricStrategy
from lightning_pdist.averaging.easgd_strategy import EASGDStrategy
from lightning_pdist.averaging.local_sgd_fabric import LocalSGDFabricStrategy
from lightning_pdist.averaging.local_sgd_strategy import LocalSGDStrategy
from lightning_pdist.averaging.schedule import PeriodicSchedule
from lightning_pdist.averaging.simuparallel_fabric import SimuParallelSGDFabricStrategy
from lightning_pdist.averaging.simuparallel_strategy import SimuParallelSGDStrategy

__all__ = ["BMUFConfig", "BMUFFabricStrategy", "BMUFState", "BMUFStrategy", "EASGDConfig", "EASGDFabricStrategy",
           "EASGDState", "EASGDStrategy", "LocalSGDFabricStrategy", "LocalSGDStrategy", "PeriodicSchedule",
           "SimuParallelSGDFabricStrategy", "SimuParallelSGDStrategy", "bmuf_block_update_", "bmuf_global_model",
           "easgd_update_"]  # fmt: skip
