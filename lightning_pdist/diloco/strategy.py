"""DiLoCo as a Lightning strategy; :mod:`.streaming_strategy` adds Streaming DiLoCo's fragments on top.

Lifecycle (every rank):

* ``setup``: the model is wrapped in DDP (which broadcasts rank 0's weights) with the counted
  :func:`~lightning_pdist.core.hooks.periodic_allreduce_hook` switched off (no gradient is ever all-reduced),
  ``broadcast_buffers`` off and DDP's backward machinery off (``require_backward_grad_sync = False``, as inside
  ``no_sync()`` for good: gradients land in ``.grad`` as without DDP, none of its buckets are filled; about 1 ms of
  CPU per step less on the benchmark's model, the difference to torchft's DiLoCo there); ``θ_global`` and the outer
  optimizer(s) are built from the synchronized weights
  (:class:`~lightning_pdist.diloco.rounds.Rounds`).
* each training step ``t`` (1-based; with several optimizers, a batch in which one stepped): the module's own
  (inner) optimizer steps on this rank's gradients, its state stays local; then the rounds run the exchanges and
  outer steps the schedule names.
* validation/test/predict during ``fit`` see the **global model** (``θ_global`` and the mean buffers), swapped in and
  out again; at the end of ``fit`` every rank loads it (exchanges in flight completed first). Mid-round that
  discards the unfinished round's local steps: the module holds the last outer step's result.
* checkpoints: ``state_dict`` holds the global model; ``checkpoint["pdist"]`` holds the step, ``θ_global``, the
  outer optimizers' state and the drained result of an exchange in flight; each rank's own replica and inner
  optimizer state go to its own file (:mod:`~lightning_pdist.core.rank_files`): resuming is exact, mid-round and
  mid-overlap included.
* non-finite values: each step's gradients are this rank's own, so one all-reduce of ``world_size`` flags per step
  (``nonfinite_flag``) makes every rank agree (``"raise"``/``"skip_step"``); the exchange's mean is checked before
  an outer step applies it (the same on every rank: no collective); ``"propagate"`` checks neither.
* ``fault_tolerant=True``: each process is one replica (``devices=1``) and the rounds go through torchft
  (:mod:`.fault_tolerance`): at setup, after a checkpoint's state (torchft's step included) is loaded, the replica
  joins (and heals from a live peer if it is behind), every round end averages the replicas present; a healed
  replica ends ``fit`` when its healed step reaches ``max_steps``.
"""

from __future__ import annotations

from typing import Any, Callable

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_pdist.core.config import OwnedDDPArguments
from lightning_pdist.core.flat import flatten
from lightning_pdist.core.guard import global_step
from lightning_pdist.core.hooks import AllReduceState, periodic_allreduce_hook
from lightning_pdist.core.nonfinite import all_finite, nonfinite_error
from lightning_pdist.core.consensus import ReplicaEvaluation, TrainingSteps
from lightning_pdist.core.strategy import PdistStrategy
from lightning_pdist.diloco.exchange import Exchange
from lightning_pdist.diloco.fault_tolerance import FaultTolerantReplica, RoundOutcome, check_ft_args
from lightning_pdist.diloco.fragments import ScheduleFields, StreamingSchedule
from lightning_pdist.diloco.outer import OuterConfig
from lightning_pdist.diloco.rounds import Rounds

__all__ = ["DiLoCoStrategy"]


class DiLoCoStrategy(ScheduleFields, TrainingSteps, ReplicaEvaluation, OwnedDDPArguments, PdistStrategy):
    """DiLoCo: ``H`` local steps of the module's optimizer, then an outer optimizer step on the pseudo-gradient.

    Douillard et al., *DiLoCo: Distributed Low-Communication Training of Language Models*, arXiv 2311.08105. Every
    replica starts a round from ``θ_global`` and takes ``sync_every = H`` steps of its own optimizer (whose state
    stays local across rounds), reaching ``θ_r``; then::

        Δ = θ_global − mean_r θ_r                      (one all-reduce)
        θ_global ← OuterOpt(θ_global, grad = Δ)       (SGD(lr=0.7, momentum=0.9, nesterov=True) by default)
        every replica loads θ_global; float buffers ← mean_r of the replicas' buffers

    Outer ``"sgd"`` with ``outer_lr=1, outer_momentum=0`` is local SGD with period ``H`` (and with ``H = 1`` and an
    SGD inner optimizer, synchronous DDP). Communication: one all-reduce of the model every ``H`` steps.

    Args:
        sync_every: ``H``, inner steps per round (>= 1; default 100).
        outer_optimizer: ``"nesterov"`` (default), ``"sgd"`` (plain momentum), or a ``torch.optim.Optimizer`` class or
            dotted path (``"torch.optim.Adam"``) built as ``cls([θ_global], lr=outer_lr, **outer_kwargs)``.
        outer_lr: the outer learning rate (0.7, the paper's).
        outer_momentum: the outer momentum for ``"nesterov"``/``"sgd"`` (0.9, the paper's).
        outer_kwargs: further keyword arguments of an optimizer class (``{"betas": (0.9, 0.95)}``).
        nonfinite: ``"raise"`` (default), ``"skip_step"`` or ``"propagate"`` (see the method card).
        fault_tolerant: run the rounds on torchft (one process per replica, started and restarted on its own): a
            replica that dies is left out of the rounds it misses, a restarted one loads ``θ_global``, the outer
            optimizer state and the step from a live peer and rejoins at the next round end (see the card).
        lighthouse: the torchft lighthouse address (default ``TORCHFT_LIGHTHOUSE``); ``fault_tolerant`` only.
        replica_id: this replica's id, kept across its restarts (default ``REPLICA_GROUP_ID``).
        min_replicas: a round commits only with at least this many replicas in the quorum (1).
        ft_timeout: seconds for torchft's collectives, commit and state transfer (60; the quorum waits 10×).
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy`, e.g. ``timeout``.

    Example::

        Trainer(accelerator="cpu", devices=4, strategy=DiLoCoStrategy(sync_every=50))
    """

    strategy_name = "diloco"
    consensus_name = "the global model"
    owned_reason = "{owner} owns communication (it never all-reduces gradients)"

    def __init__(self, sync_every: int = 100, outer_optimizer: Any = "nesterov", outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, outer_kwargs: dict | None = None, nonfinite: str = "raise",
                 fault_tolerant: bool = False, lighthouse: str | None = None, replica_id: str | None = None,
                 min_replicas: int = 1, ft_timeout: float = 60.0, **kwargs: Any) -> None:  # fmt: skip
        schedule = StreamingSchedule(sync_every=sync_every, owner=type(self).__name__)
        self.ft_settings = check_ft_args(type(self).__name__, fault_tolerant, lighthouse, replica_id, min_replicas,
                                         ft_timeout)  # fmt: skip
        self.fault_tolerant, self.lighthouse, self.replica_id = fault_tolerant, lighthouse, replica_id
        self.min_replicas, self.ft_timeout = min_replicas, ft_timeout
        self._init_rounds(schedule, outer_optimizer, outer_lr, outer_momentum, outer_kwargs, None, nonfinite, **kwargs)

    def _init_rounds(self, schedule: StreamingSchedule, outer_optimizer: Any, outer_lr: float, outer_momentum: float,
                     outer_kwargs: dict | None, fragments: list[list[str]] | None, nonfinite: str,
                     **kwargs: Any) -> None:  # fmt: skip
        owner = type(self).__name__
        kwargs_in = {} if outer_kwargs is None else outer_kwargs
        self.config = OuterConfig(outer_optimizer, outer_lr, outer_momentum, kwargs_in, owner=owner)
        self.schedule = schedule
        # super() as a bare call means this class's next one; spelled out, because jsonargparse reads a bare super() from
        # the class it inspects (StreamingDiLoCoStrategy's next is DiLoCoStrategy, whose ft arguments it refuses). So
        # LightningCLI offers DDP's arguments through **kwargs (OwnedDDPArguments hides the comm-hook ones).
        super(DiLoCoStrategy, self).__init__(nonfinite=nonfinite, **kwargs)
        self.rounds = Rounds(schedule, self.config, fragments, owner)
        self.rounds.check = self._refuse_nonfinite_mean
        self.rounds.note = lambda norm: self._diagnostics.note("pdist/diloco/outer_grad_norm", norm)
        self.step = 0  # training steps taken (1-based count of the last finished one)
        self._hook_state = AllReduceState(meter=self.comm_meter, allreduce=False)
        self._ft: FaultTolerantReplica | None = None
        #: fault_tolerant: one record per torchft round on this replica (step, contributors, participants, ...).
        self.ft_history: list[dict] = []

    @property
    def outer_optimizer(self) -> str:
        return self.config.describe()

    # ------------------------------------------------------------------ setup and steps
    @override
    def _default_comm_hook(self) -> tuple[object, Callable]:
        return self._hook_state, periodic_allreduce_hook  # allreduce=False: every rank keeps its own gradient

    @override
    def setup_algorithm(self) -> None:
        _, world_size = self.rank_world
        if getattr(self, "ft_settings", None) is not None:
            return self._setup_fault_tolerant(world_size)
        if world_size == 1:
            rank_zero_warn(f"{type(self).__name__}: world_size == 1: the outer optimizer still acts on the one "
                           "replica's pseudo-gradient (Lookahead-like); there is nothing to average")  # fmt: skip
        if isinstance(self.model, DistributedDataParallel):
            self.model.broadcast_buffers = False  # buffers are averaged at the rounds, never broadcast from rank 0
            self.model.require_backward_grad_sync = False  # no gradient is reduced: DDP's backward work is skipped
        self._finalized, self._step_open, self._evaluating_backup = False, False, None
        self.rounds.start(self.lightning_module, self.comm_meter)

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        if isinstance(self.model, DistributedDataParallel):  # manual optimization: Lightning set it back after forward
            self.model.require_backward_grad_sync = False
        super().pre_backward(closure_loss)

    def _end_training_step(self) -> None:
        self.step += 1
        if self._ft is None:
            self.rounds.after_step(self.step)
            return
        if self.step % self.schedule.sync_every == 0:
            self._ft_round(contribute=True)
        trainer = self.lightning_module.trainer
        if trainer.max_steps > 0 and self.step >= trainer.max_steps:
            trainer.should_stop = True  # a healed replica's Lightning step lags the run's

    # ------------------------------------------------------------------ fault tolerance (torchft)
    def _setup_fault_tolerant(self, world_size: int) -> None:
        owner = type(self).__name__
        if world_size != 1:
            raise ValueError(f"{owner}(fault_tolerant=True): each process is one replica (devices=1, num_nodes=1); "
                             f"this run has world_size={world_size}. Start one process per replica.")  # fmt: skip
        self._finalized, self._step_open, self._evaluating_backup = False, False, None
        self.rounds.start(self.lightning_module, self.comm_meter)
        self.ft_history = []
        self._ft = FaultTolerantReplica(**self.ft_settings, state_dict=self._ft_state, load_state_dict=self._ft_load)
        # the join (the first quorum, where a replica behind heals) waits for a checkpoint's state: see setup

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)  # setup_algorithm, then a checkpoint's state (torchft's step included)
        if self._ft is not None and not self.ft_history:
            self._ft_round(contribute=False)  # the join: after the checkpoint, so a heal is not overwritten by it

    def _ft_state(self) -> dict:
        return self.rounds.checkpoint(self.step)

    def _ft_load(self, state: dict) -> None:
        self.step = self.rounds.restore(state)

    def _ft_round(self, contribute: bool) -> None:
        """One round end on torchft: the mean over the replicas present, the outer step, every replica loads it."""
        part = self.rounds.parts[0]
        sizes = (part.global_params.numel(), part.global_buffers.numel())
        own = lambda: (part.global_params.detach() - flatten(part.params), flatten(part.buffers))  # noqa: E731
        out: RoundOutcome = self._ft.average(own if contribute else (lambda: None), sizes, self.comm_meter, self.step)
        if out.mean_delta is not None:
            self.step = out.step  # a replica resumed from its checkpoint into the others' round takes their step
            part.pending = Exchange.done(out.mean_delta, out.mean_buffers)
            self.rounds.merge(0)
        elif out.healed or not out.committed:  # back to θ_global (not committed: the round's local steps are lost)
            self.rounds.load_vector(self.rounds.global_vector())
        # else nobody contributed (the join of a fresh or resumed run): the module keeps its (mid-round) weights
        self.ft_history.append({"step": self.step, "contributors": out.contributors, "participants": out.participants,
                                "committed": out.committed, "healed": out.healed, "contributed": out.contributed,
                                "manager_step": self._ft.manager.current_step()})  # fmt: skip

    @override
    def teardown(self) -> None:
        if self._ft is not None:
            self._ft.shutdown()
            self._ft = None
        super().teardown()

    # ------------------------------------------------------------------ non-finite policy
    @override
    def nonfinite_ranks(self, optimizer: Optimizer) -> list[int] | None:
        """Each rank's own gradients, agreed through one all-reduce of ``world_size`` flags (``nonfinite_flag``)."""
        return self.agreed_nonfinite_ranks(optimizer)

    def _refuse_nonfinite_mean(self, mean_delta: Tensor, mean_buffers: Tensor) -> None:
        if self.nonfinite == "propagate" or all_finite([mean_delta, mean_buffers]):
            return
        raise nonfinite_error(type(self).__name__, "mean pseudo-gradient or buffers", [],
                              global_step(self.lightning_module), "the outer step", self.nonfinite,
                              "A replica's weights became non-finite (a diverging inner learning rate); skipping an "
                              "outer step cannot bring them back.", skippable=False)  # fmt: skip

    # ------------------------------------------------------------------ the global model (ReplicaEvaluation)
    def local_vector(self) -> Tensor:
        return self.rounds.local_vector()

    def load_vector(self, vector: Tensor) -> None:
        self.rounds.load_vector(vector)

    def consensus(self) -> Tensor:
        return self.rounds.global_vector()

    @override
    def finish_replicas(self) -> None:
        self._swap_out_consensus()
        self.rounds.finish()
        self.rounds.load_vector(self.rounds.global_vector())

    # ------------------------------------------------------------------ checkpoints
    @override
    def pdist_state_dict(self) -> dict:
        self._close_training_step()
        state = super().pdist_state_dict()
        state.update(self.rounds.checkpoint(self.step))
        if self._ft is not None:
            state["torchft"] = self._ft.manager.state_dict()  # its step: whether a resumed replica is behind
        return state

    @override
    def load_pdist_state_dict(self, state: dict) -> None:
        super().load_pdist_state_dict(state)
        self.step = self.rounds.restore(state)
        if self._ft is not None and "torchft" in state:
            self._ft.manager.load_state_dict(state["torchft"])

    @override
    def replica_state(self) -> dict:
        own = self.rounds.local_vector() if self._evaluating_backup is None else self._evaluating_backup
        return {"replica": own.cpu()}

    @override
    def load_replica(self, state: dict) -> None:
        self.rounds.load_vector(state["replica"].to(self.root_device))
