"""What every family shares, and the only folder a family may import (``tests/test_layering.py``).

Byte accounting and counted collectives, the base comm hooks, flat views, the non-finite policy and its guard, rank
files and atomic saves, run logging, process lifetime and liveness, fork safety, multi-node checks, the house error
format, the agreed-scaling precision base, and the two base strategies (:mod:`~lightning_pdist.core.strategy` for the
Trainer, :mod:`~lightning_pdist.core.fabric` for Fabric).
"""

from lightning_pdist.core.accounting import CommMeter
from lightning_pdist.core.hooks import AllReduceState, allreduce_hook, periodic_allreduce_hook

__all__ = ["AllReduceState", "CommMeter", "allreduce_hook", "periodic_allreduce_hook"]
