"""Pipeline parallelism over a module's ``nn.Sequential``: GPipe, 1F1B, PipeDream (weight stashing), PipeDream-2BW.

Math: :mod:`.schedule` (schedules as values), :mod:`.partition`. Transport: :mod:`.p2p`, :mod:`.executor`. Wiring:
:mod:`.stages`, :mod:`.log_mirror`, :mod:`.precision`, :mod:`.strategy`. Card: ``docs/algorithms/pipeline.md``.
"""

from lightning_pdist.pipeline.schedule import Action, Schedule, build_schedule
from lightning_pdist.pipeline.strategy import PipelineConfig, PipelineStrategy

__all__ = ["Action", "PipelineConfig", "PipelineStrategy", "Schedule", "build_schedule"]
