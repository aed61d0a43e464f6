"""DiLoCo and Streaming DiLoCo: local steps of an inner optimizer, an outer optimizer on the pseudo-gradient.

Math: :mod:`.outer` (the outer step), :mod:`.fragments` (Streaming's schedule and fragments), :mod:`.quantize`
(int8/int4 codes). Transport: :mod:`.exchange` (the async mean of the pseudo-gradients), :mod:`.rounds` (the rounds
on one replica, shared by both shells). Lightning wiring: :mod:`.strategy`, :mod:`.streaming_strategy`,
:mod:`.fabric`. Card: ``docs/algorithms/diloco.md``.
"""

from lightning_pdist.diloco.fragments import StreamingSchedule
from lightning_pdist.diloco.outer import OuterConfig, outer_step_
from lightning_pdist.diloco.rounds import Rounds
from lightning_pdist.diloco.strategy import DiLoCoStrategy
from lightning_pdist.diloco.streaming_strategy import StreamingDiLoCoStrategy

__all__ = ["DiLoCoStrategy", "OuterConfig", "Rounds", "StreamingDiLoCoStrategy", "StreamingSchedule", "outer_step_"]
