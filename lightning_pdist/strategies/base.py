"""The base every collective-based lightning_pdist strategy builds on.

:class:`PdistStrategy` is Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy` plus three
things every algorithm here needs:

1. **Comm hooks on every device type.** Lightning 2.6 registers ``ddp_comm_hook`` only when the
   root device is CUDA and silently ignores it elsewhere; we register it on CPU/gloo too. With no
   hook given, the counted :func:`~lightning_pdist.comm.hooks.allreduce_hook` is registered: the
   same arithmetic as DDP's own reduction, plus byte accounting.
2. **Byte accounting.** A :class:`~lightning_pdist.comm.accounting.CommMeter` counts the bytes this
   rank sends through our comm layer; after every optimizer step the strategy logs
   ``pdist/comm_bytes`` (that step) and ``pdist/comm_bytes_total`` (cumulative) with
   ``LightningModule.log``, so they reach the progress bar and every logger. Figures are this
   rank's own (loggers write rank 0's). Traffic for evaluation and checkpoints is not training
   traffic and is not counted.
3. **Algorithm state in checkpoints.** Lightning has no strategy ``state_dict`` hook, so
   :meth:`save_checkpoint` adds ``checkpoint["pdist"]`` and :meth:`load_checkpoint` reads it back;
   subclasses fill it through :meth:`pdist_state_dict` / :meth:`load_pdist_state_dict`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist
from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_pdist.comm.accounting import CommMeter
from lightning_pdist.comm.hooks import AllReduceState, allreduce_hook

__all__ = ["PdistStrategy"]


class PdistStrategy(DDPStrategy):
    """DDP with comm hooks on every device, byte accounting and checkpointed algorithm state.

    Registered as ``"pdist_ddp"``: gradient all-reduce every step, exactly Lightning's ``"ddp"``,
    with ``pdist/comm_bytes`` logged. All keyword arguments go to
    :class:`~lightning.pytorch.strategies.DDPStrategy` (and from there to
    ``DistributedDataParallel``), so LightningCLI exposes them too.

    Example::

        trainer = Trainer(accelerator="cpu", devices=2, strategy="pdist_ddp")
    """

    strategy_name = "pdist_ddp"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if self._ddp_comm_hook is not None:
            rank_zero_warn(
                f"{type(self).__name__}(ddp_comm_hook={getattr(self._ddp_comm_hook, '__qualname__', self._ddp_comm_hook)}):"
                " bytes sent by a hook from outside lightning_pdist are not counted in pdist/comm_bytes."
            )
        self.comm_meter = CommMeter()
        self._loaded_pdist_state: dict | None = None

    # ------------------------------------------------------------------ comm hooks
    def _default_comm_hook(self) -> tuple[object, Callable] | None:
        """(state, hook) registered when the user gives no ``ddp_comm_hook``."""
        return AllReduceState(meter=self.comm_meter), allreduce_hook

    @override
    def _register_ddp_hooks(self) -> None:
        # Lightning guards this with `root_device.type == "cuda"`; DDP comm hooks work on gloo too.
        assert isinstance(self.model, DistributedDataParallel)
        if self._ddp_comm_hook is None:
            default = self._default_comm_hook()
            if default is None:
                return
            state, hook = default
            _register_ddp_comm_hook(model=self.model, ddp_comm_state=state, ddp_comm_hook=hook)
            return
        _register_ddp_comm_hook(
            model=self.model,
            ddp_comm_state=self._ddp_comm_state,
            ddp_comm_hook=self._ddp_comm_hook,
            ddp_comm_wrapper=self._ddp_comm_wrapper,
        )

    # ------------------------------------------------------------------ step + logging
    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.after_optimizer_step(optimizer)
        self._log_comm_bytes()
        return output

    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        """Run the algorithm's per-step work (averaging, elastic steps); nothing for plain DDP."""

    def _log_comm_bytes(self) -> None:
        step_bytes = self.comm_meter.end_step()
        module = self.lightning_module
        # `log` is legal only inside a hook the Trainer is running (optimizer_step/training_step).
        if module is None or module._trainer is None or module._current_fx_name is None:
            return
        module.log("pdist/comm_bytes", float(step_bytes), on_step=True, on_epoch=False, prog_bar=True)
        module.log("pdist/comm_bytes_total", float(self.comm_meter.total_bytes), on_step=True, on_epoch=False)

    # ------------------------------------------------------------------ checkpoints
    def pdist_state_dict(self) -> dict:
        """Algorithm state stored under ``checkpoint["pdist"]`` (called on every rank)."""
        return {"strategy": type(self).__name__, "comm_meter": self.comm_meter.state_dict()}

    def load_pdist_state_dict(self, state: dict) -> None:
        """Restore what :meth:`pdist_state_dict` stored (called on every rank after ``setup``)."""
        self.comm_meter.load_state_dict(state.get("comm_meter", {}))

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        # Runs on every rank (Trainer.save_checkpoint), so pdist_state_dict may use collectives.
        checkpoint["pdist"] = self.pdist_state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._loaded_pdist_state = checkpoint.get("pdist")
        return checkpoint

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            self._loaded_pdist_state = None  # validate/test/predict: the weights are all they need
            return
        self.setup_algorithm()
        if self._loaded_pdist_state is not None:
            self.load_pdist_state_dict(self._loaded_pdist_state)
            self._loaded_pdist_state = None

    def setup_algorithm(self) -> None:
        """Create run-time algorithm state once the model is wrapped and optimizers exist."""

    @property
    def rank_world(self) -> tuple[int, int]:
        """(global rank, world size) of the default process group."""
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description=cls.__doc__.splitlines()[0] if cls.__doc__ else "", override=True
        )
        strategy_registry.register(
            f"{cls.strategy_name}_fork",
            cls,
            description=f"{cls.strategy_name} with the fork start method",
            start_method="fork",
            override=True,
        )
        strategy_registry.register(
            f"{cls.strategy_name}_spawn",
            cls,
            description=f"{cls.strategy_name} with the spawn start method",
            start_method="spawn",
            override=True,
        )
