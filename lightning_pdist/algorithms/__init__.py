"""Pure math: what each algorithm computes (update rules, schedules, votes, sharding plans).

Imports torch only; every function runs in one process without a process group
(``tests/test_layering.py`` enforces this).
"""

from lightning_pdist.algorithms.bmuf import BMUFConfig, BMUFState, bmuf_block_update_, bmuf_global_model
from lightning_pdist.algorithms.easgd import EASGDConfig, EASGDState, easgd_update_
from lightning_pdist.algorithms.periodic import PeriodicSchedule
from lightning_pdist.algorithms.sharding import ShardingPlan, plan_sharding

__all__ = [
    "BMUFConfig",
    "BMUFState",
    "EASGDConfig",
    "EASGDState",
    "PeriodicSchedule",
    "ShardingPlan",
    "bmuf_block_update_",
    "bmuf_global_model",
    "easgd_update_",
    "plan_sharding",
]
