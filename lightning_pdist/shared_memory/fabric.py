"""Hogwild! as a Lightning Fabric strategy: your own loop, every process steps lock-free on one copy of the weights.

The mechanism of :class:`~lightning_pdist.shared_memory.strategy.HogwildStrategy` (Recht et al. 2011; the weights in
``/dev/shm``, :mod:`~lightning_pdist.shared_memory.memory`), driven by Fabric calls:

* ``fabric.setup(model, optimizer)``: nothing is wrapped in DDP; rank 0 writes the parameters and float buffers into
  shared memory and every process maps them (one broadcast of the run's name, two barriers). The optimizer stays
  each process's own (its state: momentum, Adam's moments).
* ``fabric.backward(loss)``: this process's gradient at the shared weights as it read them; nothing is sent.
* ``optimizer.step()``: the update lands in the shared weights at once, with no lock and no message (``lock=True``:
  under a process lock, the locking baseline). Updates can be lost when two processes write one coordinate.
* ``with fabric.strategy.consensus_weights(): ...`` evaluates with every process stopped (a barrier on entry and on
  exit); ``fabric.strategy.load_consensus()`` at the end waits for every process's last step (a barrier) and gives
  each a private copy of the final shared weights.
* ``fabric.save(path, {"model": model, "optimizer": optimizer, ...})`` saves the shared weights with every process
  stopped (barriers around the write), each process's optimizer state in its own file; ``fabric.load`` after
  ``fabric.setup`` restores both. One machine, CPU only (refused otherwise); no AsySVRG here (its snapshot needs the
  epoch's batches, which only the loop knows).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_pdist.core.fabric import PdistFabricStrategy
from lightning_pdist.core.guard import float_buffers
from lightning_pdist.core.strategy import register_variants
from lightning_pdist.shared_memory.config import HogwildConfig
from lightning_pdist.shared_memory.memory import ProcessLock, SharedTensors, release, share

__all__ = ["HogwildFabricStrategy"]


class HogwildFabricStrategy(PdistFabricStrategy):
    """Hogwild!/HogBatch under Fabric: N processes on one machine step lock-free on parameters in shared memory.

    Args:
        lock: ``True`` holds a process lock around each ``optimizer.step()`` (the locking baseline).
        **kwargs: passed to Fabric's :class:`~lightning.fabric.strategies.DDPStrategy` (``start_method``, ...).

    Example::

        fabric = Fabric(accelerator="cpu", devices=2, strategy="hogwild")
    """

    strategy_name = "hogwild"

    def __init__(self, lock: bool = False, **kwargs: Any) -> None:
        self.config = HogwildConfig(lock=lock, owner=type(self).__name__)
        super().__init__(**kwargs)
        self.lock = lock
        self.shared: SharedTensors | None = None
        self._lock: ProcessLock | None = None
        self.steps = 0  # optimizer steps this process applied to the shared weights

    @override
    def _configure_launcher(self) -> None:
        self.config.check_placement(self.num_nodes, self.parallel_devices)
        super()._configure_launcher()

    @override
    def setup_module(self, module: Module) -> Module:
        owner = type(self).__name__
        if self.module is not None:
            raise RuntimeError(f"{owner}: fabric.setup was called for a second module ({type(module).__name__}); put "
                               "the modules in one nn.Module and set that up once")  # fmt: skip
        self.module = module
        tensors = list(module.parameters()) + float_buffers(module)
        self.shared, self._lock = share(tensors, self.config.lock, self.global_rank, self.broadcast, self.barrier)
        return module

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if self._lock is None:
            output = super().optimizer_step(optimizer, **kwargs)
        else:
            with self._lock:
                output = super().optimizer_step(optimizer, **kwargs)
        self.steps += 1
        return output

    def _sharing(self) -> bool:
        return self.shared is not None and self.shared.shared()

    @contextmanager
    def consensus_weights(self) -> Iterator[None]:
        """Inside the block no process steps: every one has finished its steps (collective on entry and exit)."""
        if self._sharing():
            self.barrier()
        try:
            yield
        finally:
            if self._sharing():
                self.barrier()

    def load_consensus(self) -> None:
        """Once training is over: wait for every process's last step, then keep a private copy of the weights."""
        if self._sharing():
            self.barrier()
            self.shared.detach()

    @override
    def checkpoint_weights(self) -> Any:
        return self.consensus_weights()

    @override
    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None) -> Any:
        # Every process copies the saved weights into the shared memory; nobody steps until all have.
        if self._sharing():
            self.barrier()
        try:
            return super().load_checkpoint(path, state=state, strict=strict, weights_only=weights_only)
        finally:
            if self._sharing():
                self.barrier()

    @override
    def pdist_state_dict(self) -> dict:
        state = super().pdist_state_dict()
        state.update(lock=self.config.lock)
        return state

    @override
    def rank_state(self, objects: dict[str, Any]) -> dict | None:
        """This process's own optimizer states and step count (the weights are shared: they are in the main file)."""
        if self.module is None:
            return None
        return {"optimizers": {k: o.state_dict() for k, o in objects.items() if isinstance(o, Optimizer)},
                "steps": self.steps}  # fmt: skip

    @override
    def load_rank_state(self, state: dict | None, objects: dict[str, Any], reason: str) -> None:
        if state is None:
            return  # every process keeps rank 0's optimizer state, as fabric.load gave it
        for key, saved in state["optimizers"].items():
            if isinstance(objects.get(key), Optimizer):
                objects[key].load_state_dict(saved)
        self.steps = int(state["steps"])

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        description = f"{cls.__doc__.splitlines()[0]} (Lightning Fabric)" if cls.__doc__ else ""
        register_variants(strategy_registry, cls, cls.strategy_name, description, find_unused=False)  # no DDP

    @override
    def teardown(self) -> None:
        shared, lock, self.shared, self._lock = self.shared, self._lock, None, None
        release(shared, lock)
        super().teardown()
