"""Periodic model averaging: local SGD, one-shot averaging (SimuParallelSGD), BMUF and EASGD.

Math: :mod:`.schedule`, :mod:`.rules`, :mod:`.bmuf`, :mod:`.easgd` (one rule object per algorithm, driven by both
shells). Transport: :mod:`.replicas`. Lightning wiring: :mod:`.strategy` (+ one file per Trainer strategy) and
:mod:`.fabric` (+ one file per Fabric strategy). Cards: ``docs/algorithms/{local_sgd,bmuf,easgd}.md``.
"""

from lightning_pdist.core.lazy import lazy_names

__getattr__, __dir__ = lazy_names(__name__, {  # imported on first use: importing a transport module stays Lightning-free
    "BMUFConfig": "bmuf",
    "BMUFRule": "bmuf",
    "BMUFState": "bmuf",
    "bmuf_block_update_": "bmuf",
    "bmuf_global_model": "bmuf",
    "BMUFFabricStrategy": "bmuf_fabric",
    "BMUFStrategy": "bmuf_strategy",
    "EASGDConfig": "easgd",
    "EASGDRule": "easgd",
    "EASGDState": "easgd",
    "easgd_update_": "easgd",
    "EASGDFabricStrategy": "easgd_fabric",
    "EASGDStrategy": "easgd_strategy",
    "LocalSGDFabricStrategy": "local_sgd_fabric",
    "LocalSGDStrategy": "local_sgd_strategy",
    "AveragingRule": "rules",
    "LocalSGDRule": "rules",
    "SimuParallelRule": "rules",
    "OneShotSchedule": "schedule",
    "PeriodicSchedule": "schedule",
    "SimuParallelSGDFabricStrategy": "simuparallel_fabric",
    "SimuParallelSGDStrategy": "simuparallel_strategy",
})

__all__ = ["AveragingRule", "BMUFConfig", "BMUFFabricStrategy", "BMUFRule", "BMUFState", "BMUFStrategy", "EASGDConfig",
           "EASGDFabricStrategy", "EASGDRule", "EASGDState", "EASGDStrategy", "LocalSGDFabricStrategy", "LocalSGDRule",
           "LocalSGDStrategy", "OneShotSchedule", "PeriodicSchedule", "SimuParallelRule", "SimuParallelSGDFabricStrategy",
           "SimuParallelSGDStrategy", "bmuf_block_update_", "bmuf_global_model", "easgd_update_"]  # fmt: skip
