"""Lightning's collectives (``barrier``, ``broadcast``, ``reduce``, ``all_gather``) over a strategy's own
:class:`~lightning_pdist.core.control_group.ControlGroup` instead of torch's default group (which such strategies
never initialize: Lightning would broadcast on it before every batch). Used by the parameter server and Hogwild!."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from lightning_pdist.core.control_group import ControlGroup

__all__ = ["ControlGroupCollectives"]


class ControlGroupCollectives:
    """Mix in before the Lightning strategy class; ``control_group`` is ``None`` until set-up (and with one process)."""

    control_group: ControlGroup | None
    world_size: int
    lightning_module: Any

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if self.control_group is not None:
            self.control_group.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.control_group.broadcast_object(obj, src) if self.control_group is not None else obj

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if not isinstance(tensor, Tensor) or self.control_group is None or self.world_size == 1:
            return tensor
        op = str(getattr(reduce_op, "name", reduce_op) if reduce_op is not None else "sum").lower()
        mean = op in ("mean", "avg")
        if mean and not tensor.is_floating_point():
            tensor = tensor.float()
        out = self.control_group.all_reduce_(tensor.detach().clone(), "sum" if mean else op)
        return out / self.world_size if mean else out

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        if self.control_group is None or self.world_size == 1:
            return tensor
        return torch.stack(self.control_group.all_gather(tensor.detach()))

    def _broadcast_module_from_rank_zero(self) -> None:
        """validate/test/predict outside fit: every process evaluates rank 0's weights (on its shard of the data)."""
        if self.control_group is None or self.world_size == 1:
            return
        module = self.lightning_module
        module.load_state_dict(self.control_group.broadcast_object({k: v.detach().cpu() for k, v in module.state_dict().items()}))

    def _route_metric_sync(self) -> None:
        """torchmetrics syncs over torch's default group only if it exists, which it never does here: point every
        Metric at the control group, so epoch-level metrics cover every process's data."""
        if self.control_group is None or self.world_size == 1:
            return
        try:
            from torchmetrics import Metric
        except ImportError:
            return
        gather = lambda tensor, group=None: self.control_group.all_gather_varying(tensor)  # noqa: E731
        for module in self.lightning_module.modules():
            if isinstance(module, Metric):
                module.dist_sync_fn = gather
                module.distributed_available_fn = lambda: True
