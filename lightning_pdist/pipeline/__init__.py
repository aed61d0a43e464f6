"""Pipeline parallelism over a module's ``nn.Sequential``: GPipe, 1F1B, PipeDream (weight stashing), PipeDream-2BW,
SpecTrain, DDG, features replay and synthetic gradients (DNI).

Math: :mod:`.schedule` (schedules as values, :class:`ScheduleSpec` the meaning of each name), :mod:`.partition`,
:mod:`.spectrain` (weight prediction), :mod:`.delayed` (DDG, features replay), :mod:`.dni` (synthetic gradients).
Transport: :mod:`.p2p`, :mod:`.executor`. Wiring: :mod:`.config`, :mod:`.stages`, :mod:`.log_mirror`,
:mod:`.precision`, :mod:`.strategy`. Card: ``docs/algorithms/pipeline.md``.
"""

from lightning_pdist.core.lazy import lazy_names

__getattr__, __dir__ = lazy_names(__name__, {  # imported on first use: importing a transport module stays Lightning-free
    "PipelineConfig": "config",
    "Action": "schedule",
    "Schedule": "schedule",
    "ScheduleSpec": "schedule",
    "build_schedule": "schedule",
    "PipelineStrategy": "strategy",
})

__all__ = ["Action", "PipelineConfig", "PipelineStrategy", "Schedule", "ScheduleSpec", "build_schedule"]
