"""Lightning's collectives (``barrier``, ``broadcast``, ``reduce``, ``all_gather``) over a strategy's own
:class:`~lightning_pdist.core.control_group.ControlGroup` instead of torch's default group (which such strategies
never initialize: Lightning would broadcast on it before every batch), and the ``setup`` and closing that go with
having no default group and no DDP. Used by the parameter server and Hogwild!."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from torch import Tensor
from typing_extensions import override

from lightning_pdist.core.control_group import ControlGroup

__all__ = ["ControlGroupCollectives"]


class ControlGroupCollectives:
    """Mix in before :class:`~lightning_pdist.core.strategy.PdistStrategy`; ``control_group`` is ``None`` until set-up
    (and with one process)."""

    control_group: ControlGroup | None
    world_size: int
    global_rank: int
    lightning_module: Any

    @override
    def setup(self, trainer: Any) -> None:
        """``DDPStrategy.setup`` without DDP or torch's default group, in ``PdistStrategy.setup``'s order: the module
        converted and on its device, the optimizers (when fitting; a subclass extends :meth:`setup_optimizers` for
        what must come before or after them), the precision plugin, metrics synced over the control group, the
        settings announced. Then outside ``fit`` every process takes rank 0's weights; in ``fit`` the algorithm starts
        and a resumed run loads its state (``setup_algorithm``, ``load_resumed_state``)."""
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self._route_metric_sync()
        self.announce(trainer)
        if not fitting:
            self._loaded_pdist_state = None
            self._broadcast_module_from_rank_zero()
            return
        self.setup_algorithm()
        self.load_resumed_state()

    def agree_on_rank_state(self, own: dict | None, reason: str) -> tuple[dict | None, str]:
        """This process's state, or None in every process when any lacks its file (one all-reduce)."""
        if self.control_group is None or self.world_size == 1:
            return own, reason
        missing = self.control_group.all_reduce_(torch.tensor([0 if own is not None else 1 + self.global_rank]), "max")
        if own is not None and missing.item():
            return None, f"rank {missing.item() - 1} has no part of this checkpoint"
        return own, reason

    def close_control_group(self, group: ControlGroup | None) -> None:
        """Close ``group`` at teardown: rank 0's store is gone before any other process returns from here; after a
        failure the others may be stopped or dead, so the closing barrier waits a second, not 30 s."""
        if group is None:
            return
        module = self.lightning_module
        failed = module is not None and module._trainer is not None and module.trainer.state.status == TrainerStatus.INTERRUPTED
        group.close(timeout=timedelta(seconds=1 if failed else 30))

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
