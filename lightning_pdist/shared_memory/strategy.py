"""Hogwild! / HogBatch / AsySVRG as a Lightning strategy: N processes on one machine, one copy of the weights.

Hogwild! (Recht, Ré, Wright, Niu, NeurIPS 2011): every process reads the shared parameters, computes the gradient of
its own mini-batch and applies its optimizer's update to the shared tensors, with no lock and no collective; an
update may overwrite one that landed in between (a lost update), which sparse problems (few coordinates per step)
make rare. With batches larger than one it is HogBatch (Sallinen et al., IPDPS 2016). ``nn.Embedding(sparse=True)``
with SGD or SparseAdam writes only the rows its batch touched. ``lock=True`` holds a process lock from the end of
each gradient to the end of its write (the locking baseline). AsySVRG (Zhao & Li, AAAI 2016):
``variance_reduction="svrg"`` (:mod:`~lightning_pdist.shared_memory.svrg`).

How the processes share: any Lightning launcher on one machine starts them (``popen``, ``fork``, ``spawn``, torchrun);
in ``setup`` rank 0 writes the module's parameters and float buffers into ``/dev/shm`` and every process maps them
(:mod:`~lightning_pdist.shared_memory.memory`). Each process keeps its own optimizer (and state: momentum, Adam's
moments), its own shard of the data (``DistributedSampler``) and its own Trainer loop. Lightning's bookkeeping
(barriers at validation, checkpoints and the end; ``sync_dist``) goes through a private gloo group
(:mod:`~lightning_pdist.core.control_group`); torch's default group is never created, so Lightning's per-batch
broadcast does not run and no step waits for another process. At the end of ``fit`` every process waits for the
others' last step and keeps a private copy of the final shared weights (rank 0's Trainer, and a fork/spawn launcher's
parent, see them). Method card: ``docs/algorithms/hogwild.md``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.fabric.utilities.seed import reset_seed
from torch.optim import Optimizer
from typing_extensions import override

from lightning_pdist.core.config import OwnedDDPArguments
from lightning_pdist.core.guard import float_buffers
from lightning_pdist.core.nonfinite import grads_finite
from lightning_pdist.core.guard import optimizer_grads
from lightning_pdist.core.momentum import compensate_optimizers
from lightning_pdist.core.strategy import PdistStrategy, register_variants
from lightning_pdist.shared_memory.config import HogwildConfig
from lightning_pdist.core.control_collectives import ControlGroupCollectives
from lightning_pdist.core.control_group import ControlGroup
from lightning_pdist.shared_memory.memory import ProcessLock, SharedTensors, release, share
from lightning_pdist.shared_memory.snapshot import Snapshot
from lightning_pdist.shared_memory.svrg import snapshot_due, variance_reduced

__all__ = ["HogwildStrategy"]


class HogwildStrategy(ControlGroupCollectives, OwnedDDPArguments, PdistStrategy):
    """Hogwild!/HogBatch: lock-free optimizer steps of N processes on parameters in shared memory (one machine, CPU).

    Args:
        lock: ``True`` holds a process lock around each update (the locking baseline); ``False`` is Hogwild!.
        variance_reduction: ``None`` (Hogwild!) or ``"svrg"`` (AsySVRG: ``g − g̃ + μ``; one optimizer, automatic
            optimization).
        snapshot_every_epochs: epochs between AsySVRG snapshots ``w̃`` and full gradients ``μ``.
        implicit_momentum: ``"compensate"`` lowers every optimizer's momentum (SGD's ``momentum``, Adam's ``beta1``)
            by ``1 − 1/N`` for ``N`` processes, floored at 0 (Mitliagkas et al. 2016), when fit starts; ``None`` keeps
            it. Each process's own momentum buffer sees only its own gradients, and two of them stepping one tensor in
            turns are far less stable than one (the method card's "The locking baseline and momentum").
        nonfinite: what a process does with a step whose gradients hold NaN/Inf: ``"raise"``, ``"skip_step"`` (that
            process skips its own step) or ``"propagate"``.

    Example::

        trainer = Trainer(accelerator="cpu", devices=2, strategy="hogwild")
        trainer = Trainer(accelerator="cpu", devices=2, strategy=HogwildStrategy(variance_reduction="svrg"))
    """

    strategy_name = "hogwild"
    wraps_in_ddp = False
    owned_reason = "Hogwild! has no gradient communication"

    def __init__(self, lock: bool = False, variance_reduction: str | None = None, snapshot_every_epochs: int = 1,
                 implicit_momentum: str | None = None, nonfinite: str = "raise", **kwargs: Any) -> None:  # fmt: skip
        owner = type(self).__name__
        self.config = HogwildConfig(lock=lock, variance_reduction=variance_reduction, snapshot_every_epochs=snapshot_every_epochs,
                                    implicit_momentum=implicit_momentum, owner=owner)  # fmt: skip
        self.config.check_placement(1, kwargs.get("parallel_devices"))  # the nodes are checked when launching
        super().__init__(nonfinite=nonfinite, **kwargs)  # OwnedDDPArguments refuses and hides DDP's comm-hook arguments
        self.lock, self.variance_reduction, self.snapshot_every_epochs = lock, variance_reduction, snapshot_every_epochs
        self.control_group: ControlGroup | None = None
        self.shared: SharedTensors | None = None
        self.steps = 0  # optimizer steps this process applied to the shared weights
        self.momentum_from: list[float] = []  # implicit_momentum="compensate": each param group's momentum before
        self._lock: ProcessLock | None = None
        self._snapshot: Snapshot | None = None
        self._batch: tuple[Any, int] | None = None
        self._pending_snapshot: dict | None = None

    # ------------------------------------------------------------------ world
    @override
    def _configure_launcher(self) -> None:
        self.config.check_placement(self.num_nodes, self.parallel_devices)  # the Trainer is built, no process started
        super()._configure_launcher()

    @override
    def setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        env = self.cluster_environment
        timeout = self._timeout if isinstance(self._timeout, timedelta) else timedelta(minutes=30)
        self.control_group = ControlGroup(env.main_address, env.main_port, self.global_rank, self.world_size, timeout=timeout,
                                          name="hogwild", noun="process")  # fmt: skip

    @property
    def rank_world(self) -> tuple[int, int]:
        return self.global_rank, self.world_size

    # ------------------------------------------------------------------ setup
    @override
    def setup_optimizers(self, trainer: Any) -> None:
        """When fitting (``ControlGroupCollectives.setup``): the weights shared first, so that the optimizers hold the
        shared tensors; then their momentum compensated."""
        self._share()
        super().setup_optimizers(trainer)
        self._compensate_momentum()

    def _share(self) -> None:
        """Rank 0's parameters and float buffers into shared memory, mapped by every process (and the lock file)."""
        module = self.lightning_module
        tensors = list(module.parameters()) + float_buffers(module)
        self.shared, self._lock = share(tensors, self.config.lock, self.global_rank, self.broadcast, self.barrier)

    def _compensate_momentum(self) -> None:
        """``implicit_momentum="compensate"``: the freshly configured optimizers' momentum lowered by ``1 − 1/N`` (a
        resumed run then loads each process's own states, whose param groups hold the lowered value already)."""
        if self.config.implicit_momentum != "compensate":
            return
        self.momentum_from, warning = compensate_optimizers(self.optimizers, self.world_size, type(self).__name__)
        if warning:
            rank_zero_warn(warning)

    @override
    def setup_algorithm(self) -> None:
        if self.config.variance_reduction != "svrg":
            return
        owner = type(self).__name__
        if not self.lightning_module.automatic_optimization or len(self.optimizers) != 1:
            raise ValueError(f"{owner}(variance_reduction='svrg'): AsySVRG needs automatic optimization and one "
                             f"optimizer (this module: automatic_optimization={self.lightning_module.automatic_optimization}, "
                             f"{len(self.optimizers)} optimizers); use variance_reduction=None for it")  # fmt: skip
        params = [p for group in self.optimizers[0].param_groups for p in group["params"]]
        self._snapshot = Snapshot(params)

    # ------------------------------------------------------------------ the step
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self._snapshot is None:
            return
        self._batch = (batch, batch_idx)
        trainer = self.lightning_module.trainer
        epoch = trainer.current_epoch
        if snapshot_due(epoch, self.config.snapshot_every_epochs) and self._snapshot.epoch != epoch:
            self.barrier()  # nobody steps while w̃ is read and μ computed
            loader = trainer.fit_loop._combined_loader.flattened[0]
            self._snapshot.take(trainer, epoch, iter(loader), trainer.num_training_batches, self.batch_to_device,
                                lambda t: self.control_group.all_reduce_(t) if self.control_group is not None else t)  # fmt: skip
            self.barrier()

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self._snapshot is not None:
            closure = self._svrg_closure(closure)
        if self._lock is None:
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
        else:
            output = self._locked_step(optimizer, closure, model, **kwargs)
        self.steps += 1
        return output

    def _locked_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any, **kwargs: Any) -> Any:
        """The gradient is computed unlocked; the lock is taken when it is ready and released after the write."""
        held = [False]

        def then_lock() -> Any:
            out = closure()
            if not held[0]:
                self._lock.__enter__()
                held[0] = True
            return out

        try:
            return super().optimizer_step(optimizer, then_lock, model, **kwargs)
        finally:
            if held[0]:
                self._lock.__exit__()

    def _svrg_closure(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        def corrected() -> Any:
            out = closure()
            batch, batch_idx = self._batch
            trainer = self.lightning_module.trainer
            params = self._snapshot.params
            at_snapshot = self._snapshot.grads_at_snapshot(trainer, batch, batch_idx)
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            for p, v in zip(params, variance_reduced(grads, at_snapshot, self._snapshot.mu)):
                p.grad = v
            return out

        return corrected

    @override
    def nonfinite_ranks(self, optimizer: Optimizer) -> list[int] | None:
        """Each process steps on its own gradient: it decides alone (no collective), naming itself."""
        grads = [g._values() if g.is_sparse else g for g in optimizer_grads(optimizer)]  # a sparse row's values
        return None if grads_finite(grads) else [self.global_rank]

    # ------------------------------------------------------------------ evaluation, checkpoints, the end
    def _fitting_shared(self) -> bool:
        return self.shared is not None and self.shared.shared()

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        if self._fitting_shared():
            self.barrier()  # every process has finished its steps: validation reads weights nobody is writing

    @override
    def on_validation_end(self) -> None:
        if self._fitting_shared():
            self.barrier()  # nobody steps again before every process has validated
        super().on_validation_end()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not self._fitting_shared():
            return super().lightning_module_state_dict()
        self.barrier()  # Lightning saves on every process at the same point: the last steps have landed
        state = {k: v.detach().clone() for k, v in super().lightning_module_state_dict().items()}
        self.barrier()  # nobody writes before every process has its copy
        return state

    @override
    def on_train_end(self) -> None:
        if self._fitting_shared():
            self.barrier()  # every process's last step has landed
            self.shared.detach()  # a private copy of the final shared weights, the same in every process
        super().on_train_end()

    @override
    def pdist_state_dict(self) -> dict:
        state = super().pdist_state_dict()
        state.update(lock=self.config.lock, variance_reduction=self.config.variance_reduction)
        if self._snapshot is not None:
            state["snapshot"] = self._snapshot.state_dict()
        return state

    @override
    def load_pdist_state_dict(self, state: dict) -> None:
        super().load_pdist_state_dict(state)
        if self._snapshot is not None and "snapshot" in state:
            self._snapshot.load_state_dict(state["snapshot"])

    @override
    def pdist_rank_state(self) -> dict | None:
        """Each process's own optimizer states and step count (its file next to the checkpoint)."""
        return {"optimizers": [o.state_dict() for o in self.optimizers], "steps": self.steps}

    @override
    def load_pdist_rank_state(self, state: dict | None, reason: str = "") -> None:
        if state is None:
            return  # Lightning restores rank 0's optimizer states into every process
        self._pending_optimizer_states = state["optimizers"]
        self.steps = int(state["steps"])

    @override
    def teardown(self) -> None:
        shared, lock, self.shared, self._lock = self.shared, self._lock, None, None
        release(shared, lock)
        group, self.control_group = self.control_group, None
        self.close_control_group(group)
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        description = cls.__doc__.splitlines()[0] if cls.__doc__ else ""
        register_variants(strategy_registry, cls, cls.strategy_name, description, find_unused=False)
        register_variants(strategy_registry, cls, "asysvrg", "AsySVRG: Hogwild! with SVRG's variance reduction",
                          find_unused=False, variance_reduction="svrg")  # fmt: skip
