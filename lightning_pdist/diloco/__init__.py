"""DiLoCo and Streaming DiLoCo: local steps of an inner optimizer, an outer optimizer on the pseudo-gradient.

Math: :mod:`.outer` (the outer step), :mod:`.fragments` (Streaming's schedule and fragments), :mod:`.quantize`
(int8/int4 codes). Transport: :mod:`.exchange` (the async mean of the pseudo-gradients), :mod:`.rounds` (the rounds
on one replica, shared by both shells). Lightning wiring: :mod:`.strategy`, :mod:`.streaming_strategy`,
:mod:`.fabric`. Card: ``docs/algorithms/diloco.md``.
"""

from lightning_pdist.core.lazy import lazy_names

__getattr__, __dir__ = lazy_names(__name__, {  # imported on first use: importing a transport module stays Lightning-free
    "StreamingSchedule": "fragments",
    "OuterConfig": "outer",
    "outer_step_": "outer",
    "Rounds": "rounds",
    "DiLoCoStrategy": "strategy",
    "StreamingDiLoCoStrategy": "streaming_strategy",
})

__all__ = ["DiLoCoStrategy", "OuterConfig", "Rounds", "StreamingDiLoCoStrategy", "StreamingSchedule", "outer_step_"]
