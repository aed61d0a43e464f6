"""Shared Lightning wiring of the periodic model-averaging family (local SGD, one-shot, BMUF, EASGD).

Lifecycle of one run (every rank):

* ``setup``: the model is wrapped in DDP (which broadcasts rank 0's weights), the counted
  :func:`~lightning_pdist.core.hooks.periodic_allreduce_hook` is registered, the algorithm creates
  its state from the synchronized weights, and a resumed run loads its own replica.
* each optimizer step ``t`` (1-based): during warm-up the hook all-reduces gradients (exactly DDP);
  afterwards it returns the local gradient and the optimizer steps locally. After the step,
  :meth:`synchronize` runs when the schedule says so.
* validation/test/predict during ``fit`` evaluate the **consensus model** (what the algorithm would
  output if stopped now: the average of the replicas, BMUF's global model, EASGD's center), swapped
  in at the start of the loop and swapped out at its end, so training continues undisturbed.
* ``trainer.save_checkpoint``: ``state_dict`` holds the consensus model (what users load for
  inference); each rank writes its own weights and optimizer state to its own file next to the
  checkpoint (:mod:`~lightning_pdist.core.rank_files`), so a resumed run continues exactly,
  mid-period included, and no rank ever holds another's replica.
* end of ``fit``: every rank loads the consensus model, so the module the user holds is the output.

Decisions a user meets:

* **Several optimizers** (GANs, actor-critic; manual optimization) work. The period counts
  *training steps* (batches in which at least one optimizer stepped), not optimizer steps, and
  the synchronization averages the whole module (every optimizer's parameters, one BMUF/EASGD
  state for the whole model). With several optimizers a step is closed, and synchronized if the
  schedule says so, once the batch is over: at the next batch, before evaluation, at a checkpoint
  or at the end of fit (with one optimizer, right after its step). Each optimizer keeps its own
  local state (momentum, Adam moments), which is never averaged, as with one optimizer.
* **Gradient accumulation** works: the period counts optimizer steps, not batches (Lightning skips
  the DDP hook on accumulating batches).
* **Manual optimization** works: ``optimizer.step()`` routes through :meth:`optimizer_step`.
* **Learning-rate schedulers** run unchanged on each rank (they count the same steps).
* **BatchNorm buffers**: floating-point buffers are averaged with the parameters; during warm-up
  DDP's ``broadcast_buffers`` stays as configured (default True, as in DDP), afterwards it is off.
* **Non-finite values** (``nonfinite=``, :mod:`lightning_pdist.core.nonfinite`) are checked at two points,
  both before any state changes. *The step*: the gradients the optimizer is about to apply. During warm-up they
  are DDP's average (the same on every rank: no extra collective); afterwards each rank's own, so one all-reduce
  of ``world_size`` flags per step (counted as ``nonfinite_flag``) makes every rank agree and learn who. ``"raise"``
  stops every rank there; ``"skip_step"`` skips that step on every rank (no optimizer step, float buffers
  restored, the step not counted towards ``period`` or ``warmup_steps``). *The synchronization*: the combined
  vector (the average, EASGD's sum, the final consensus) is checked before it is applied, so the replicas, BMUF's
  anchor and block momentum and EASGD's center never take a NaN; it is the same on every rank, so this costs no
  collective unless it is not finite. A replica that became non-finite from finite gradients (a diverging learning
  rate) stops every rank there under ``"skip_step"`` too: skipping a synchronization cannot bring it back.
  ``"propagate"`` checks neither and sends no flag (the local steps then meet at synchronizations only).
* **Replica divergence** is logged as ``pdist/avg/divergence``: before each synchronization, this rank's
  relative distance to the mean of the replicas, ``‖w_r − mean(w)‖ / ‖mean(w)‖`` (parameters and float buffers),
  computed from the vector the synchronization all-reduces anyway (no extra collective; one pass over the
  model). Logged at the next logged step as the mean over the synchronizations since the previous one (loggers
  show rank 0's); absent from intervals without a synchronization. It says how far apart local steps take the
  replicas: it grows with ``period`` and the learning rate; BMUF's block momentum and EASGD's ``alpha`` act on
  top of it.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, Callable

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_pdist.core.flat import averaged_tensors, relative_distance
from lightning_pdist.core.nonfinite import all_finite, culprit_ranks, nonfinite_error, one_hot_flag
from lightning_pdist.averaging.replicas import RuleShell
from lightning_pdist.averaging.rules import AveragingRule
from lightning_pdist.core.collectives import all_reduce_sum_
from lightning_pdist.core.hooks import AllReduceState, periodic_allreduce_hook
from lightning_pdist.core.consensus import ReplicaEvaluation, TrainingSteps
from lightning_pdist.core.strategy import PdistStrategy
from lightning_pdist.core.config import OwnedDDPArguments
from lightning_pdist.core.guard import global_step

__all__ = ["ModelAveragingStrategy"]


class ModelAveragingStrategy(RuleShell, TrainingSteps, ReplicaEvaluation, OwnedDDPArguments, PdistStrategy):
    """Base of the strategies whose ranks step locally and synchronize their models periodically.

    The rule (:mod:`lightning_pdist.averaging.rules`) holds the schedule, the update and its state; subclasses give
    it and say what a synchronization changes (:attr:`sync_changes`). Abstract, so LightningCLI does not offer it as
    a ``--trainer.strategy`` choice.

    Args:
        rule: the algorithm (schedule, update, state), shared with the Fabric strategies.
        nonfinite: ``"raise"`` (default), ``"skip_step"`` or ``"propagate"`` (see the module docstring).
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy`.
    """

    #: ``compression=`` (BMUF, local SGD) compresses the model delta since the last synchronization.
    compression_use = "deltas"
    owned_reason = "{owner} owns gradient communication and model averaging"
    #: What the rule does with one rank, for the one-rank warning.
    one_rank_behaviour = "the result is plain single-process training"

    def __init__(self, rule: AveragingRule, nonfinite: str = "raise", **kwargs: Any) -> None:
        self._user_broadcast_buffers = bool(kwargs.get("broadcast_buffers", True))
        super().__init__(nonfinite=nonfinite, **kwargs)  # OwnedDDPArguments refuses and hides DDP's comm-hook arguments
        self.rule = rule
        self.step = 0  # optimizer steps taken (1-based count of the last finished step)
        self._hook_state = AllReduceState(meter=self.comm_meter, track_nonfinite=nonfinite != "propagate")

    @property
    @abstractmethod
    def sync_changes(self) -> str:
        """What a synchronization changes, for the non-finite error ("... every rank stops here, before ...")."""

    # ------------------------------------------------------------------ algorithm hooks
    def averages_gradients(self, step: int) -> bool:
        """Whether optimizer step ``step`` all-reduces gradients (warm-up)."""
        return self.schedule.averages_gradients(step)

    def syncs_after(self, step: int) -> bool:
        """Whether the replicas synchronize right after optimizer step ``step``."""
        return self.schedule.syncs_after(step)

    def synchronize(self) -> None:
        """Synchronize the replicas (called on every rank after a step the schedule names).

        The combined vector is checked before the rule applies it (the non-finite policy).
        """
        combined = self.reduce_replicas()
        self.refuse_nonfinite(combined, before=self.sync_changes)
        # The module still holds this rank's replica: its distance to the mean costs no collective.
        divergence = relative_distance(self.averaged_tensors, self.rule.replica_mean(combined))
        self._diagnostics.note("pdist/avg/divergence", divergence)
        self.rule.apply(combined, self)
        self.refresh_anchor()

    def nonfinite_ranks(self, optimizer: Optimizer) -> list[int] | None:
        """The step's check: during warm-up DDP's (see the base); afterwards each rank's own gradients, agreed
        through one all-reduce of ``world_size`` flags (counted as ``nonfinite_flag``)."""
        if self.averages_gradients(self.step + 1):
            return super().nonfinite_ranks(optimizer)
        return self.agreed_nonfinite_ranks(optimizer)

    def refuse_nonfinite(self, combined: Tensor, before: str) -> None:
        """Stop every rank when ``combined`` (the same on every rank) is not finite, naming the replicas that were not.

        A NaN on one rank reaches every replica through the average; stopping here, before anything is applied,
        keeps it out of the replicas, the algorithm's state and every checkpoint. The ranks are gathered on this
        failure path only. Not consulted under ``nonfinite="propagate"``.
        """
        if self.nonfinite == "propagate" or all_finite([combined]):
            return
        bad = not all_finite(self.averaged_tensors)
        rank, world_size = self.rank_world
        flags = one_hot_flag(bad, rank, world_size, device=combined.device)
        if world_size > 1:
            all_reduce_sum_(flags)
        note = ("The step's check saw finite gradients: these weights became non-finite in the optimizer (a diverging "
                "learning rate) or outside it, and skipping a synchronization cannot bring them back.")  # fmt: skip
        raise nonfinite_error(type(self).__name__, "replica parameters or buffers", culprit_ranks(flags),
                              global_step(self.lightning_module), before, self.nonfinite, note, skippable=False)  # fmt: skip

    # ------------------------------------------------------------------ helpers
    @override
    def replica_module(self) -> Any:
        assert self.lightning_module is not None
        return self.lightning_module

    @property
    def averaged_tensors(self) -> list[Tensor]:
        return averaged_tensors(self.replica_module())

    # ------------------------------------------------------------------ comm hook
    @override
    def _default_comm_hook(self) -> tuple[object, Callable]:
        return self._hook_state, periodic_allreduce_hook

    def _set_phase(self) -> None:
        """Configure gradient all-reduce and buffer broadcast for the *next* optimizer step."""
        every_step = self.averages_gradients(self.step + 1)
        self._hook_state.allreduce = every_step
        if isinstance(self.model, DistributedDataParallel):
            self.model.broadcast_buffers = self._user_broadcast_buffers and every_step

    # ------------------------------------------------------------------ lifecycle
    @override
    def setup_algorithm(self) -> None:
        owner = type(self).__name__
        _, world_size = self.rank_world
        if world_size == 1:
            rank_zero_warn(
                f"{owner}: world_size == 1, so there is nothing to average across ranks; the rule still runs on the "
                f"single replica ({self.one_rank_behaviour})."
            )
        self._hook_state.process_group = None
        self._finalized = False
        self._step_open = False
        self._set_phase()
        self.rule.start(self, world_size)
        self.start_compression()

    def _end_training_step(self) -> None:
        self.step += 1
        if self.averages_gradients(self.step):
            self._count_buffer_broadcast()
            self.rule.after_warmup(self)
            self.refresh_anchor()
        elif self.syncs_after(self.step):
            self.synchronize()
        self._set_phase()

    def _count_buffer_broadcast(self) -> None:
        # DDP broadcast rank 0's buffers before this step's forward (broadcast_buffers); count them.
        model = self.model
        if not (isinstance(model, DistributedDataParallel) and model.broadcast_buffers):
            return
        rank, world_size = self.rank_world
        if world_size > 1 and rank == 0:
            nbytes = sum(b.numel() * b.element_size() for b in self.lightning_module.buffers())
            if nbytes:
                self.comm_meter.add("buffer_broadcast", nbytes)

    @override
    def finish_replicas(self) -> None:
        consensus = self.consensus()
        self.refuse_nonfinite(consensus, before="every rank loads the consensus model")
        self.load_vector(consensus)

    # ------------------------------------------------------------------ checkpoints
    @override
    def pdist_state_dict(self) -> dict:
        self._close_training_step()
        return super().pdist_state_dict()
