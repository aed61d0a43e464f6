"""Pipeline parallelism over a module's ``nn.Sequential``: GPipe, 1F1B, PipeDream (weight stashing), PipeDream-2BW.

Math: :mod:`.schedule` (schedules as values, :class:`ScheduleSpec` the meaning of each name), :mod:`.partition`.
Transport: :mod:`.p2p`, :mod:`.executor`. Wiring: :mod:`.config`, :mod:`.stages`, :mod:`.log_mirror`,
:mod:`.precision`, :mod:`.strategy`. Card: ``docs/algorithms/pipeline.md``.
"""

from lightning_pdist.pipeline.config import PipelineConfig
from lightning_pdist.pipeline.schedule import Action, Schedule, ScheduleSpec, build_schedule
from lightning_pdist.pipeline.strategy import PipelineStrategy

__all__ = ["Action", "PipelineConfig", "PipelineStrategy", "Schedule", "ScheduleSpec", "build_schedule"]
