"""Megatron-style tensor parallelism of an existing module on ``torch.distributed.tensor``; hybrid conv-DP/FC-MP.

Math: :mod:`.plan`, :mod:`.cost`. Transport: :mod:`.meter`, :mod:`.comm`, :mod:`.layers`, :mod:`.shard`.
Wiring: :mod:`.clip`, :mod:`.strategy`. Card: ``docs/algorithms/tensor_parallel.md``.
"""

from lightning_pdist.core.lazy import lazy_names

__getattr__, __dir__ = lazy_names(__name__, {  # imported on first use: importing a transport module stays Lightning-free
    "TPPlan": "plan",
    "plan_for": "plan",
    "TensorParallelStrategy": "strategy",
})

__all__ = ["TPPlan", "TensorParallelStrategy", "plan_for"]
