"""Shared Fabric wiring of the periodic model-averaging family (local SGD, BMUF, EASGD).

The same schedule and rules as the Trainer strategies (:mod:`lightning_pdist.averaging.strategy`), driven by
the calls of a Fabric loop:

* ``fabric.setup(model, optimizer)``: DDP broadcasts rank 0's weights, the counted
  :func:`~lightning_pdist.core.hooks.periodic_allreduce_hook` is registered, and the algorithm's state is created
  from the synchronized weights.
* ``fabric.backward(loss)``: during warm-up the hook all-reduces the gradients (exactly DDP); afterwards it hands
  each rank its own gradient back and nothing is sent.
* ``optimizer.step()`` (optimizer step ``t``, 1-based): the step, then the synchronization when the schedule says
  so (:class:`~lightning_pdist.averaging.schedule.PeriodicSchedule`). The period counts ``optimizer.step()``
  calls: with several optimizers each call counts. ``fabric.no_backward_sync(model)`` (gradient accumulation)
  works unchanged: DDP skips the hook on accumulating backward passes.
* **The algorithm's output** (the average of the replicas, BMUF's global model, EASGD's center) is not what any
  rank holds between synchronizations. Evaluate it inside ``with fabric.strategy.consensus_weights(): ...``
  (the module holds it inside the block, its own replica again after), and call
  ``fabric.strategy.load_consensus()`` once training is over so that every rank holds it. Both are collectives.
* ``fabric.save(path, {"model": model, "optimizer": optimizer, ...})``: the ``"model"`` entry holds the consensus
  (what to load for inference), each rank's own replica and optimizer state go to its own file next to the
  checkpoint, and ``"pdist"`` holds the step and the algorithm state; ``fabric.load(path, same dict)`` after
  ``fabric.setup`` resumes every rank exactly, mid-period included.
* Floating-point buffers (BatchNorm statistics) are averaged with the parameters; DDP's ``broadcast_buffers``
  applies during warm-up only. Non-finite values are not checked (the Trainer strategies' ``nonfinite=`` is not
  available here): check your loss if a run can diverge.
* ``compression=`` (BMUF, local SGD): a synchronization sends the compressed model delta since the last one, with
  error feedback per rank (:meth:`~lightning_pdist.averaging.replicas.RuleShell.reduce_replicas`); each rank's
  residual goes to its own checkpoint file, the anchor to ``"pdist"``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

from torch import Tensor
from torch.nn import Module
from typing_extensions import override

from lightning_pdist.averaging.replicas import RuleShell
from lightning_pdist.averaging.rules import AveragingRule
from lightning_pdist.core.hooks import AllReduceState, periodic_allreduce_hook
from lightning_pdist.core.fabric import PdistFabricStrategy

__all__ = ["ModelAveragingFabricStrategy"]


class ModelAveragingFabricStrategy(RuleShell, PdistFabricStrategy):
    """Base of the Fabric strategies whose ranks step locally and synchronize their models periodically.

    The rule (:mod:`lightning_pdist.averaging.rules`; the same objects the Trainer strategies drive) holds the
    schedule, the update and its state; subclasses give it.

    Args:
        rule: the algorithm (schedule, update, state).
        **kwargs: passed to Fabric's :class:`~lightning.fabric.strategies.DDPStrategy` (and ``compression``, where the
            leaf class names it).
    """

    #: ``compression=`` (BMUF, local SGD) compresses the model delta since the last synchronization.
    compression_use = "deltas"

    def __init__(self, rule: AveragingRule, **kwargs: Any) -> None:
        self._user_broadcast_buffers = bool(kwargs.get("broadcast_buffers", True))
        super().__init__(**kwargs)
        self.rule = rule
        self.step = 0  # optimizer steps taken (1-based count of the last finished step)
        self._hook_state = AllReduceState(meter=self.comm_meter)
        self._backup: Tensor | None = None  # this rank's replica while the consensus is swapped in

    # ------------------------------------------------------------------ flat views
    @override
    def replica_module(self) -> Module:
        if self.module is None:
            raise RuntimeError(f"{type(self).__name__}: no module is set up yet; call fabric.setup(model, optimizer) "
                               "first")  # fmt: skip
        return self.module

    # ------------------------------------------------------------------ the user's calls
    @contextmanager
    def consensus_weights(self) -> Iterator[None]:
        """Inside the block the module holds the consensus model; on exit, this rank's replica again.

        Collective on entry (every rank must enter). Training steps inside the block would be lost on exit.
        """
        if self._backup is not None:  # nested: the consensus is in already
            yield
            return
        consensus = self.consensus()
        self._backup = self.local_vector()
        self.load_vector(consensus)
        try:
            yield
        finally:
            self.load_vector(self._backup)
            self._backup = None

    def load_consensus(self) -> None:
        """Every rank loads the consensus model: call once training is over (collective)."""
        self.load_vector(self.consensus())

    # ------------------------------------------------------------------ lifecycle
    @override
    def comm_hook(self) -> tuple[object, Callable]:
        return self._hook_state, periodic_allreduce_hook

    @override
    def check_setup(self, module: Module) -> None:
        self.rule.check(self.rank_world[1])  # before anything is wrapped

    @override
    def setup_algorithm(self) -> None:
        self.step = 0
        self._set_phase()
        self.rule.start(self, self.rank_world[1])
        self.start_compression()

    @override
    def after_optimizer_step(self) -> None:
        self.step += 1
        if self.schedule.averages_gradients(self.step):
            self.rule.after_warmup(self)
            self.refresh_anchor()
        elif self.schedule.syncs_after(self.step):
            self.rule.apply(self.reduce_replicas(), self)
            self.refresh_anchor()
        self._set_phase()

    def _set_phase(self) -> None:
        """Configure gradient all-reduce and buffer broadcast for the *next* optimizer step."""
        every_step = self.schedule.averages_gradients(self.step + 1)
        self._hook_state.allreduce = every_step
        if self.ddp_module is not None:
            self.ddp_module.broadcast_buffers = self._user_broadcast_buffers and every_step

    # ------------------------------------------------------------------ checkpoints
    @override
    def checkpoint_weights(self) -> Any:
        return super().checkpoint_weights() if self.module is None else self.consensus_weights()

    @override
    def rank_state(self, objects: dict[str, Any]) -> dict | None:
        # Written at once (before the consensus is swapped in for the main file), so no copies are needed.
        if self.module is None:
            return None
        own = self.replica_objects_state(objects)
        if self.compression_state is not None:
            own["compression"] = self.compression_state.state_dict()  # this rank's residual
        return own

    @override
    def load_rank_state(self, state: dict | None, objects: dict[str, Any], reason: str) -> None:
        self.load_replica_or_warn(state, objects, reason, resumes_from="the consensus model")
        super().load_rank_state(state, objects, reason)  # the compressor's state (none without the file)
