"""The base of our Fabric strategies: Fabric's DDP with our comm hook, a byte meter and checkpointed state.

Fabric has no training loop, so a strategy learns about training only from the calls the user's loop makes:

* ``fabric.setup(model, optimizer)`` → :meth:`setup_module`: wrap the module in DDP (which broadcasts rank 0's
  weights, so every replica starts equal), register the algorithm's comm hook (Fabric's DDP has no comm-hook
  argument; DDP runs hooks on gloo too), and create the algorithm's state from the synchronized weights.
* ``optimizer.step()`` → :meth:`optimizer_step` (Fabric's ``_FabricOptimizer`` routes it here): the step, then the
  algorithm's per-step work (:meth:`after_optimizer_step`).
* ``fabric.save(path, state)`` / ``fabric.load(path, state)`` → :meth:`save_checkpoint` / :meth:`load_checkpoint`
  (called on every rank). The saved dict gets a ``"pdist"`` entry (the algorithm state, the same on every rank);
  what differs per rank (a replica and its optimizer state, a sign vote's residuals) goes to one file per rank next
  to the checkpoint, in the Trainer strategies' format (:mod:`lightning_pdist.core.rank_files`), so a resumed
  run continues exactly. Load after ``fabric.setup``: setup broadcasts rank 0's weights over every replica.

Bytes sent through our comm layer are counted in :attr:`comm_meter` (``total_bytes``; ``end_step()`` returns the
bytes since its last call): Fabric logs nothing by itself, so log them with ``fabric.log`` if you want them.

``PdistFabricStrategy(compression=TopK(0.01))`` itself is Fabric's DDP with compressed gradients, the twin of the
Trainer's ``PdistStrategy(compression=...)`` (the same compressor objects and hook, :mod:`lightning_pdist.core.compression`);
without ``compression`` it is DDP with a counted all-reduce. Each rank's compressor state (error-feedback residuals)
goes to its own file next to the checkpoint.
"""

from __future__ import annotations

import inspect

from contextlib import nullcontext
from typing import Any, Callable

from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch.nn import Module
from torch.optim import Optimizer
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_pdist.core.accounting import CommMeter
from lightning_pdist.core.compression import CompressionState, Compressor, refuse_compression
from lightning_pdist.core.hooks import AllReduceState, allreduce_hook, settle_comm_callbacks
from lightning_pdist.core import lifetime, rank_files
from lightning_pdist.core.collectives import rank_world
from lightning_pdist.core.strategy import check_keywords, register_variants
from lightning_pdist.core.safe_io import SafeCheckpointIO

__all__ = ["PDIST_KEY", "NoSkipStep", "PdistFabricStrategy"]

#: The key of the algorithm state in the dict ``fabric.save`` writes (the Trainer strategies use the same).
PDIST_KEY = "pdist"


class NoSkipStep:
    """Mixin of the Fabric strategies whose comm hook applies a non-finite policy, placed between a family's arguments
    class (whose config holds ``nonfinite``) and ``PdistFabricStrategy``: ``"skip_step"`` is refused, since your loop,
    not the strategy, calls ``optimizer.step()``."""

    def __init__(self, nonfinite: str = "raise", **kwargs: Any) -> None:
        if nonfinite == "skip_step":
            raise ValueError(f"{type(self).__name__}(nonfinite='skip_step'): under Fabric your loop calls "
                             "optimizer.step(), so the strategy cannot skip it; use 'raise' (every rank raises in that "
                             "backward) or 'propagate' and skip the step in your loop when a gradient is not finite")
        super().__init__(**kwargs)


class PdistFabricStrategy(DDPStrategy):
    """Fabric's :class:`~lightning.fabric.strategies.DDPStrategy` running one of our algorithms on one module.

    Used as it is, it is DDP: gradients are all-reduced (counted) every step, or compressed with ``compression``.
    Subclasses give their comm hook (:meth:`comm_hook`) and fill in :meth:`setup_algorithm`,
    :meth:`after_optimizer_step` and the checkpoint methods. Keyword arguments go to Fabric's ``DDPStrategy``
    (``start_method``, ``process_group_backend``, ``timeout``, ...) and from there to ``DistributedDataParallel``;
    an unknown one is refused at construction.

    Args:
        compression: a compressor from :mod:`lightning_pdist.compression` (``TopK(0.01)``, ``DGC()``, ...); here it
            compresses each step's gradients (``docs/algorithms/compression.md``). Only the strategies whose
            constructor names it take it.

    Example::

        fabric = Fabric(accelerator="cpu", devices=2, strategy=PdistFabricStrategy(compression=TopK(0.01)))
    """

    #: The name registered with Fabric's ``STRATEGY_REGISTRY`` (with ``_fork``/``_spawn`` variants).
    strategy_name = ""
    #: What the rule does with one rank, for the one-rank warning.
    one_rank_behaviour = "the result is plain single-process training"
    #: What ``compression=`` compresses here (``core.compression.USES``).
    compression_use = "gradients"

    def __init__(self, compression: Compressor | None = None, **kwargs: Any) -> None:
        owner = type(self).__name__
        if compression is not None and "compression" not in inspect.signature(type(self).__init__).parameters:
            raise TypeError(f"{owner}(compression={compression!r}): unknown argument; {owner} owns its communication "
                            "and takes no compression")  # fmt: skip
        self.compression = refuse_compression(owner, compression, self.compression_use)
        self.compression_state: CompressionState | None = None
        check_keywords(type(self), kwargs, base=DDPStrategy, base_label="Fabric DDPStrategy's")
        kwargs.setdefault("checkpoint_io", SafeCheckpointIO())  # a failed save never destroys the previous file
        super().__init__(**kwargs)
        self.comm_meter = CommMeter()
        self.module: Module | None = None  # the user's module (inside ddp_module)
        self.ddp_module: DistributedDataParallel | None = None

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        self._launcher = lifetime.own_launcher(self._launcher)  # fork: no process group copied into the ranks

    @property
    def rank_world(self) -> tuple[int, int]:
        """(global rank, world size) of the default process group."""
        return rank_world()

    # ------------------------------------------------------------------ algorithm hooks
    def comm_hook(self) -> tuple[object, Callable]:
        """(state, hook) registered on the DDP module; ``self.ddp_module`` is set when this is called.

        Here: the compressor's hook (its state created now, keyed by the parameter's index), else a counted all-reduce.
        """
        if self.compression is not None:
            keys = {id(p): i for i, p in enumerate(self.ddp_module.parameters())}  # stable across bucket rebuilds
            self.compression_state = self.compression.new_state()
            return self.compression.ddp_hook(self.compression_state, self.comm_meter, keys, False)
        return AllReduceState(meter=self.comm_meter), allreduce_hook

    def check_setup(self, module: Module) -> None:
        """Refuse a setting the algorithm cannot run with, before anything is wrapped."""

    def setup_algorithm(self) -> None:
        """Create the algorithm's run-time state from the synchronized weights."""

    def after_optimizer_step(self) -> None:
        """The algorithm's work after each ``optimizer.step()`` (collective where it synchronizes)."""

    # ------------------------------------------------------------------ lifecycle
    @override
    def setup_module(self, module: Module) -> DistributedDataParallel:
        owner = type(self).__name__
        if self.module is not None:
            raise RuntimeError(
                f"{owner}: fabric.setup was called for a second module ({type(module).__name__}) after "
                f"{type(self.module).__name__}; {owner} runs its algorithm on one module. Put the modules in one "
                "nn.Module (an nn.ModuleDict, for instance) and set that up once."
            )
        self.check_setup(module)
        ddp = super().setup_module(module)  # DDP broadcasts rank 0's parameters and buffers: replicas start equal
        self.module, self.ddp_module = module, ddp
        state, hook = self.comm_hook()
        ddp.register_comm_hook(state=state, hook=hook)
        if self.rank_world[1] == 1:
            rank_zero_warn(f"{owner}: world_size == 1, so there is nothing to communicate; {self.one_rank_behaviour}.")
        self.setup_algorithm()
        return ddp

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, **kwargs)
        self.after_optimizer_step()
        return output

    @override
    def teardown(self) -> None:
        settle_comm_callbacks()  # no hook callback left on gloo's threads when the DDP wrap and its group are freed
        super().teardown()

    # ------------------------------------------------------------------ checkpoints
    def pdist_state_dict(self) -> dict:
        """The algorithm state saved under ``"pdist"`` (the same on every rank; called on every rank)."""
        return {"strategy": type(self).__name__, "comm_meter": self.comm_meter.state_dict()}

    def load_pdist_state_dict(self, state: dict) -> None:
        """Restore what :meth:`pdist_state_dict` saved."""
        self.comm_meter.load_state_dict(state.get("comm_meter", {}))

    def rank_state(self, objects: dict[str, Any]) -> dict | None:
        """This rank's own state for its own file (``objects``: what the user saves), or None (nothing per rank).

        Must be None on every rank or on none. Here: the compressor's state (its residuals), if any.
        """
        return None if self.compression_state is None else {"compression": self.compression_state.state_dict()}

    def load_rank_state(self, state: dict | None, objects: dict[str, Any], reason: str) -> None:
        """Restore :meth:`rank_state`'s output into ``objects``; ``state`` is None (``reason`` says why) without one."""
        if self.compression_state is not None and state is not None and "compression" in state:
            self.compression_state.load_state_dict(state["compression"], device=self.root_device)

    def replica_objects_state(self, objects: dict[str, Any]) -> dict:
        """This replica's own modules and optimizers of ``objects`` (for strategies whose replicas differ)."""
        own = {}
        for key, obj in objects.items():
            if isinstance(obj, Module):
                own[key] = self.get_module_state_dict(obj)
            elif isinstance(obj, Optimizer):
                own[key] = obj.state_dict()
        return {"objects": own}

    def load_replica_objects_state(self, state: dict, objects: dict[str, Any]) -> None:
        """Restore :meth:`replica_objects_state`'s output into ``objects``."""
        for key, saved in state["objects"].items():
            obj = objects.get(key)
            if isinstance(obj, Module):
                self.load_module_state_dict(obj, saved)
            elif isinstance(obj, Optimizer):
                obj.load_state_dict(saved)

    def load_replica_or_warn(self, state: dict | None, objects: dict[str, Any], reason: str, resumes_from: str) -> None:
        """:meth:`load_replica_objects_state`; a rank without its file (``state`` None, ``reason`` says why) warns
        that every rank resumes from ``resumes_from`` (what the main file holds) and rank 0's optimizer state."""
        if state is None:
            rank_zero_warn(f"{type(self).__name__}: {reason}; every rank resumes from {resumes_from} and rank 0's "
                           "optimizer state")
            return
        self.load_replica_objects_state(state, objects)

    def checkpoint_weights(self) -> Any:
        """Context in which the module holds the weights ``fabric.save`` writes as the model (a collective)."""
        return nullcontext()

    @override
    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Any | None = None, filter: dict | None = None
    ) -> None:
        owner = type(self).__name__
        if PDIST_KEY in state:
            raise ValueError(f"{owner}: fabric.save(state) has a key {PDIST_KEY!r}, where {owner} keeps its algorithm "
                             "state; rename that entry")  # fmt: skip
        pdist = self.pdist_state_dict()
        rank_files.save_rank_files(self.rank_state(state), path, pdist, *self.rank_world, barrier=self.barrier)
        with self.checkpoint_weights():
            super().save_checkpoint(path, {**state, PDIST_KEY: pdist}, storage_options=storage_options, filter=filter)

    @override
    def load_checkpoint(
        self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        remainder = super().load_checkpoint(path, state=state, strict=strict, weights_only=weights_only)
        if not isinstance(state, dict) or not state:
            return remainder  # a raw module/optimizer, or the whole checkpoint returned: Fabric's own behaviour
        pdist = remainder.pop(PDIST_KEY, None)
        if pdist is None:
            return remainder  # not saved by one of our strategies: the weights are all there is
        owner = type(self).__name__
        if self.module is None:
            raise RuntimeError(f"{owner}: fabric.load({path!r}, state) came before fabric.setup(model, optimizer); "
                               "setup broadcasts rank 0's weights over every replica, so load after it to "
                               "resume")  # fmt: skip
        saved = pdist.get("strategy")
        if saved != owner:
            raise ValueError(f"{owner}: {path} was saved by {saved}; its algorithm state does not carry over to "
                             f"{owner}. Resume it with {saved}, or load the model alone: fabric.load(path, "
                             "{'model': model}, strict=False) with a plain Fabric strategy")  # fmt: skip
        self.load_pdist_state_dict(pdist)
        own, reason = rank_files.agree_on_rank_state(*rank_files.load_own(path, pdist, *self.rank_world),
                                                     *self.rank_world, device=self.root_device)  # fmt: skip
        self.load_rank_state(own, state, reason)
        return remainder

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name:
            description = f"{cls.__doc__.splitlines()[0]} (Lightning Fabric)" if cls.__doc__ else ""
            register_variants(strategy_registry, cls, cls.strategy_name, description)

