"""Megatron-style tensor parallelism of an existing module on ``torch.distributed.tensor``; hybrid conv-DP/FC-MP.

Math: :mod:`.plan`, :mod:`.cost`. Transport: :mod:`.meter`. Wiring: :mod:`.clip`, :mod:`.strategy`. Card:
``docs/algorithms/tensor_parallel.md``.
"""

from lightning_pdist.tensor_parallel.plan import TPPlan, plan_for
from lightning_pdist.tensor_parallel.strategy import TensorParallelStrategy

__all__ = ["TPPlan", "TensorParallelStrategy", "plan_for"]
