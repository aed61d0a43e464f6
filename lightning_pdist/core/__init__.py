"""What every family shares, and the only folder a family may import (``tests/test_layering.py``).

Byte accounting and counted collectives, the base comm hooks, flat views, the non-finite policy and its guard, rank
files and atomic saves, run logging, process lifetime and liveness, fork safety, multi-node checks, the house error
format, the agreed-scaling precision base, and the two base strategies (:mod:`~lightning_pdist.core.strategy` for the
Trainer, :mod:`~lightning_pdist.core.fabric` for Fabric).
"""

from lightning_pdist.core.lazy import lazy_names

__getattr__, __dir__ = lazy_names(__name__, {  # imported on first use: `lightning_pdist.core.startup` runs before torch
    "CommMeter": "accounting",
    "AllReduceState": "hooks",
    "allreduce_hook": "hooks",
    "periodic_allreduce_hook": "hooks",
})

__all__ = ["AllReduceState", "CommMeter", "allreduce_hook", "periodic_allreduce_hook"]
