"""The Lightning plumbing of the strategies whose ranks train replicas of their own (averaging, D-PSGD, DiLoCo).

Each rank steps on its own replica ``w_r``; evaluation during ``fit``, the checkpoint's ``state_dict`` and the end
of ``fit`` see one model, the same on every rank: the *consensus* ``c`` (the average ``mean_r w_r``, BMUF's global
model, EASGD's center, DiLoCo's ``θ_global``). :class:`ReplicaEvaluation` does what follows from that once:

* validation during ``fit``: ``on_validation_start`` keeps ``w_r`` and loads ``c``, ``on_validation_end`` loads
  ``w_r`` back (Lightning calls callbacks and the module first on both hooks: their ``on_validation_start`` sees
  ``w_r``, ``validation_step`` and their ``on_validation_end`` see ``c``);
* checkpoints: ``state_dict`` holds ``c``; each rank's own file holds ``w_r`` and its optimizer states
  (:mod:`~lightning_pdist.core.rank_files`), loaded back when ``fit`` resumes; a rank without its file resumes from
  ``c`` and rank 0's optimizer states, with a warning naming the reason;
* the end of ``fit``: every rank loads the final model (:meth:`ReplicaEvaluation.finish_replicas`); nothing of its
  own is left to checkpoint after that.

:class:`TrainingSteps` counts *training steps* (batches in which at least one optimizer stepped) for the strategies
whose schedule runs on them.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

__all__ = ["ReplicaEvaluation", "TrainingSteps"]


class TrainingSteps:
    """With one optimizer a training step ends right after its step; with several the batch may step another one yet,
    so the step is only marked open and is ended once the batch is over: at the next batch, before evaluation, at a
    checkpoint or at the end of ``fit`` (:meth:`_close_training_step`). Mix in before
    :class:`~lightning_pdist.core.strategy.PdistStrategy`; the host gives ``_end_training_step``."""

    optimizers: list[Optimizer]
    _step_open = False  # several optimizers: an optimizer stepped in the current batch

    def _end_training_step(self) -> None:
        raise NotImplementedError

    @override
    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        if len(self.optimizers) > 1:
            self._step_open = True  # the batch may step another optimizer yet: closed by _close_training_step
            return
        self._end_training_step()

    def _close_training_step(self) -> None:
        """With several optimizers: end the training step whose batch is over (collective on every rank)."""
        if self._step_open:
            self._step_open = False
            self._end_training_step()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._close_training_step()  # before the base keeps the buffers for skip_step (a synchronization changes them)
        super().on_train_batch_start(batch, batch_idx)


class ReplicaEvaluation:
    """Mix in before :class:`~lightning_pdist.core.strategy.PdistStrategy` (after :class:`TrainingSteps`, whose
    ``_close_training_step`` then runs before every swap). The host gives ``local_vector()`` / ``load_vector(v)``
    (``w_r`` as one flat vector), ``consensus()`` (``c`` as such a vector; a collective, called on every rank at the
    same points) and :meth:`finish_replicas`; :meth:`replica_state` / :meth:`load_replica` say what its file holds."""

    #: What ``state_dict`` holds, named in the warning of a rank that resumes without its own file.
    consensus_name = "the consensus model"
    lightning_module: Any
    optimizers: list[Optimizer]
    _evaluating_backup: Tensor | None = None  # w_r while the module holds c
    _finalized = False  # the end of fit has loaded the final model
    _pending_optimizer_states: list | None = None  # for PdistStrategy.load_optimizer_state_dict

    def finish_replicas(self) -> None:
        """At the end of ``fit``, once, on every rank: load the final model into the module."""
        raise NotImplementedError

    def replicas_ready(self) -> bool:
        """Whether the replicas are set up for ``fit``."""
        return True

    def hold_replica(self) -> None:
        """Keep other threads off ``w_r`` from a swap-in to its swap-out and while a checkpoint reads or writes it (a
        no-op here; AD-PSGD's passive ranks take the lock their server thread averages under)."""

    def release_replica(self) -> None:
        """Undo :meth:`hold_replica`."""

    def _close_training_step(self) -> None:
        """End an open training step before the module is read (:class:`TrainingSteps`); nothing here."""

    def evaluates_consensus(self) -> bool:
        """Whether evaluation and checkpoints see ``c`` now: during ``fit``, before its end."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return trainer is not None and trainer.state.fn == TrainerFn.FITTING and not self._finalized and self.replicas_ready()

    def _swap_in_consensus(self) -> None:
        self._close_training_step()
        if not self.evaluates_consensus() or self._evaluating_backup is not None:
            return
        consensus = self.consensus()
        self.hold_replica()
        self._evaluating_backup = self.local_vector()
        self.load_vector(consensus)

    def _swap_out_consensus(self) -> None:
        if self._evaluating_backup is not None:
            self.load_vector(self._evaluating_backup)
            self._evaluating_backup = None
            self.release_replica()

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._swap_in_consensus()

    @override
    def on_validation_end(self) -> None:
        self._swap_out_consensus()
        super().on_validation_end()

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        self._close_training_step()
        if not self._finalized and self.replicas_ready():
            self.finish_replicas()
            self._finalized = True

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        # Called on every rank by Trainer.save_checkpoint: `state_dict` holds c.
        if not self.evaluates_consensus() or self._evaluating_backup is not None:  # the module holds it (or must)
            return super().lightning_module_state_dict()
        self._close_training_step()
        consensus = self.consensus()
        self.hold_replica()
        own = self.local_vector()
        self.load_vector(consensus)
        try:
            return {k: v.detach().clone() for k, v in super().lightning_module_state_dict().items()}
        finally:
            self.load_vector(own)
            self.release_replica()

    def replica_state(self) -> dict:
        """``w_r`` for this rank's file: the module's state (with ``w_r`` in it while the module holds ``c``)."""
        module_state = self.lightning_module.state_dict()
        if self._evaluating_backup is not None:  # the module holds c right now
            held = self.local_vector()
            self.load_vector(self._evaluating_backup)
            module_state = {k: v.detach().clone() for k, v in self.lightning_module.state_dict().items()}
            self.load_vector(held)
        return {"model": {k: v.detach().cpu().clone() for k, v in module_state.items()}}

    def load_replica(self, state: dict) -> None:
        """Load what :meth:`replica_state` wrote."""
        self.lightning_module.load_state_dict(state["model"])

    @override
    def pdist_rank_state(self) -> dict | None:
        if self._finalized or not self.replicas_ready():
            return None  # after fit every rank holds the final model: nothing of its own is left to keep
        self.hold_replica()
        try:
            own = self.replica_state()
            own["optimizer_states"] = [move_data_to_device(opt.state_dict(), "cpu") for opt in self.optimizers]
        finally:
            self.release_replica()
        own.update(super().pdist_rank_state() or {})  # PdistStrategy: a compressor's residual
        return own

    @override
    def load_pdist_rank_state(self, state: dict | None, reason: str = "") -> None:
        self._pending_optimizer_states = None
        if state is None:
            rank_zero_warn(f"{type(self).__name__}: {reason}; every rank resumes from {self.consensus_name} in "
                           "state_dict and rank 0's optimizer state.")
            return
        self.hold_replica()
        try:
            self.load_replica(state)
        finally:
            self.release_replica()
        super().load_pdist_rank_state(state, reason)  # PdistStrategy: a compressor's state
        self._pending_optimizer_states = state["optimizer_states"]
