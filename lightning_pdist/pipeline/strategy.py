"""Pipeline parallelism as a Lightning strategy: GPipe, 1F1B, PipeDream (weight stashing), PipeDream-2BW, the
delayed-gradient family (SpecTrain, DDG, features replay) and synthetic gradients (DNI).

Process layout: ``world_size = num_stages · R``. Global rank ``r`` runs stage ``r // R`` of pipeline
replica ``r % R`` (stage-major, as Megatron places pipeline stages outermost)::

    replica 0:  rank 0 (stage 0) ──p2p──> rank R (stage 1) ──p2p──> ... rank (K-1)·R (stage K-1)
    replica 1:  rank 1 (stage 0) ──p2p──> rank R+1         ──p2p──> ...
    each stage's R replicas all-reduce their gradients before every update (PipeDream's replicated stages)

Every rank loads the same batches as the other stages of its replica (the sampler shards the data
over the ``R`` replicas). Per Lightning training step, one batch becomes ``num_microbatches``
micro-batches and each stage runs its *window* of the schedule
(:class:`~lightning_pdist.pipeline.executor.StageExecutor`): flushed schedules (``gpipe``,
``1f1b``) finish the batch with one update; ``pipedream`` and ``2bw`` leave micro-batches in flight
across steps and drain only before validation, at the end of ``fit`` and when a checkpoint is written.

The contract with the user's module (checked at setup, refusals say what to add): a *network* holding
every trainable parameter that the module's hooks call once per step, and automatic optimization with
one optimizer. Where one ``nn.Sequential`` is the network (found automatically, or named by
``network=``) it is cut into runs of layers at setup (:class:`~lightning_pdist.pipeline.stages.StageSplit`);
any other module (a ``ModuleList`` called in a loop, Lightning's demo Transformer, a ``transformers``
model) is cut at named submodules in execution order by module ownership, at its first batch
(:class:`~lightning_pdist.pipeline.stages.OwnedSplit`, :mod:`~lightning_pdist.pipeline.ownership`). Nothing else changes:
on the last stage the module's own ``training_step``/``validation_step``/``test_step``/``predict_step``
run per micro-batch with the network's output in place of the network (the loss comes from the
module), and whatever they log is logged on every stage. The first stage learns the network's input
by running the same hook up to the network call.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_pdist.core.flat import flatten, unflatten_into_
from lightning_pdist.core.nonfinite import all_finite, culprit_ranks, one_hot_flag
from lightning_pdist.pipeline.config import PipelineConfig
from lightning_pdist.pipeline.dni import SyntheticGradient, class_labels
from lightning_pdist.pipeline.ownership import gradient_parts
from lightning_pdist.pipeline.partition import Partition
from lightning_pdist.core.accounting import all_reduce_bytes
from lightning_pdist.core.collectives import all_reduce_mean_, all_reduce_sum_
from lightning_pdist.pipeline.executor import StageExecutor
from lightning_pdist.pipeline.p2p import P2P
from lightning_pdist.pipeline.precision import PipelineMixedPrecision
from lightning_pdist.pipeline.spectrain import check_momentum, predicted_weights
from lightning_pdist.core.strategy import PdistStrategy, register_variants
from lightning_pdist.core.config import OwnedDDPArguments
from lightning_pdist.core.guard import SkipStep
from lightning_pdist.pipeline.log_mirror import LogRecorder, aggregate, replay
from lightning_pdist.pipeline.stages import NetworkInput, OwnedSplit, StageSplit, batch_size_of, make_split, split_batch

__all__ = ["PipelineConfig", "PipelineStrategy"]

class PipelineStrategy(OwnedDDPArguments, PdistStrategy):
    """Pipeline-parallel training of an ``nn.Sequential`` network, optionally replicated (pipeline × data parallel).

    Schedules (:mod:`lightning_pdist.pipeline.schedule` has the rules, the method card the timelines):

    * ``"gpipe"``: all forwards, all backwards, one update per batch. Exact: equals one-process training
      with gradient accumulation over the micro-batches. Bubble ``(K-1)/(m+K-1)``.
    * ``"1f1b"`` (default, PipeDream-Flush): the same update and bubble, activation memory for at most
      ``K - s`` micro-batches on stage ``s``.
    * ``"pipedream"``: asynchronous 1F1B, no flush; every micro-batch is a mini-batch with its own
      update on each stage (so ``num_microbatches`` updates per Lightning step; the learning rate is per
      micro-batch). Weight stashing keeps ``K - s`` weight versions on stage ``s``; ``vertical_sync``
      makes every stage use the input stage's version (``K`` versions each).
    * ``"2bw"``: PipeDream-2BW, ``W(t+1) = W(t) - ν·∇f(W(t-1))`` with gradients accumulated over the
      batch's micro-batches; two weight versions per stage.
    * ``"spectrain"``, ``"ddg"``, ``"features_replay"``: the delayed-gradient family on ``pipedream``'s timing
      without stashed versions (:mod:`lightning_pdist.pipeline.spectrain`, :mod:`lightning_pdist.pipeline.delayed`):
      forward and backward on weights predicted from SGD's momentum, ``w − s·ν·v`` (needs ``momentum > 0``); the
      delayed gradient through the stored activations with the current weights; or through the forward replayed on
      the stored input with the current weights.
    * ``synthetic_gradients=True`` with ``schedule="pipedream"`` (DNI, Jaderberg et al. 2017; the simulator's
      ``"dni"``): each stage but the last updates right after its forward on the gradient a small module at its
      output predicts (:mod:`lightning_pdist.pipeline.dni`), and trains that module on the gradient the next stage
      sends back. One replica per stage (``num_stages == world_size``).

    Logged per step: ``pdist/comm_bytes`` (this rank: activations, gradients, headers, replica all-reduce),
    ``pdist/pipeline/bubble`` (mean over stages of the share of the step spent waiting for a neighbour),
    and per stage ``pdist/pipeline/stage{s}/bubble``, ``/comm_bytes`` and ``/stash_depth`` (weight versions
    alive, measured from the storages). Checkpoints hold the whole model (``state_dict``, readable by
    ``load_from_checkpoint`` in one process), every stage's optimizer state and, for ``2bw``, the older
    weight version; the asynchronous schedules drain first, so a checkpoint is a drained pipeline.

    fp16 with a ``GradScaler`` (``precision="16-mixed"``, or on CPU ``plugins=[MixedPrecision("16-mixed", "cpu")]``),
    ``gpipe``, ``1f1b`` and ``2bw``: the Trainer's ``MixedPrecision`` is swapped for
    :class:`~lightning_pdist.pipeline.precision.PipelineMixedPrecision` with the user's scaler. Forwards
    run under autocast, backwards outside it; the last stage scales each micro-batch's loss by ``S`` (the gradients
    travel scaled between stages); before the batch's update every stage unscales its gradients, one all-reduce of a
    float over the world (counted as ``overflow_flag``) says whether any stage or replica overflowed, and then every
    rank steps or every rank skips, and ``S`` backs off or grows identically everywhere (torch's rule, through the
    scaler's public API). ``2bw`` starts the flag's all-reduce at each stage's update and defers the step until its
    weights or the next scale are needed (its version is first read by the batch after next), so no stage blocks
    on one that has not reached the update; every batch needs at least ``num_stages`` micro-batches then. The
    scaler's state is checkpointed by Lightning. ``pipedream`` refuses a scaler at setup (a stage updates and uses
    the result before the earlier stages have run the same micro-batch's backward; the method card explains);
    ``bf16-mixed`` works with every schedule.

    Non-finite gradients (``nonfinite=``, :mod:`lightning_pdist.core.nonfinite`; without a GradScaler): at each
    update every stage checks its own gradients per tensor, before the replicas' average. ``gpipe``/``1f1b``: one
    all-reduce of ``world_size`` flags over the world (counted as ``nonfinite_flag``; every rank is at the same
    update) tells every rank whether, and on which ranks, one was not finite; ``"raise"`` stops every rank there,
    ``"skip_step"`` skips that batch's update on every rank (no average, no optimizer step; float buffers restored).
    ``pipedream``/``2bw``: the stages update at different moments, so nothing is agreed: ``"raise"`` stops the rank
    whose gradients are not finite before its update (the others stop when their next exchange with it fails, or
    when the launcher ends the job), and ``"skip_step"`` is refused at construction. ``"propagate"`` checks nothing.

    Args:
        num_stages: pipeline depth ``K``; ``None``: the world size (no replicas). ``world_size`` must be a
            multiple of it.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"pipedream"``, ``"2bw"``, ``"spectrain"``, ``"ddg"`` or
            ``"features_replay"`` (``"dni"``, the simulator's name, is ``"pipedream"`` with ``synthetic_gradients=True``).
        num_microbatches: micro-batches per batch ``m``; ``None``: ``2K``, which keeps the flushed bubble at
            ``(K-1)/(3K-1) <= 1/3`` while micro-batches stay large. ``1f1b`` and ``2bw`` need ``m >= K``. A batch
            smaller than ``m`` is cut into as many micro-batches as it has samples.
        balance: ``"parameters"`` (default) or ``"time"`` (profiles each layer on the module's
            ``example_input_array``).
        split_points: names of the submodules that start stages 1..K-1, in execution order (torch pipelining's
            split spec), e.g. ``["model.net.4"]`` or ``["net.bert.encoder.layer.2"]``; ``"auto"`` or ``None``:
            balanced by parameters. A module without one ``nn.Sequential`` is cut by module ownership at its first
            batch: each submodule's weights live on the stage that calls it; a name that is not a submodule is
            refused at setup, one that the forward does not call exactly once, that is out of execution order, or
            whose cut the forward cannot run (a value crossing it outside the split point's inputs) at the first batch.
        network: name of the ``nn.Sequential`` to split when it cannot be found automatically.
        vertical_sync: ``pipedream`` only.
        weight_stashing: ``pipedream`` only; ``False`` is the ablation in which a backward uses the newest
            weights (PipeDream paper, Fig. 13): warned, never a default.
        max_message_bytes: a received header announcing a larger tensor is refused before allocating.
        nonfinite: ``"raise"`` (default), ``"skip_step"`` (``gpipe``/``1f1b`` only) or ``"propagate"``: see
            "Non-finite gradients" above.
        synthetic_gradients: DNI on ``pipedream``'s timing (refused with any other schedule).
        synthetic_module: ``h -> nn.Module`` predicting ``dL/dh`` (called once per boundary with its first
            activation); default a zero-initialised linear map of ``h``'s last dimension.
        synthetic_optimizer: ``params -> Optimizer`` for the synthetic modules; default ``Adam(lr=1e-4)``.
        synthetic_normalize: ``True`` (default): each synthetic module sees ``h/‖h‖`` and predicts ``δ/σ``, ``σ`` the
            true gradients' running rms, and ``ĝ = σ·M(h/‖h‖)``; ``False``: ``ĝ = M(h)`` trained on ``δ``
            (:mod:`lightning_pdist.pipeline.dni` has the measured reason).
        synthetic_conditioning: ``None`` (default, DNI) or ``"labels"`` (cDNI, Jaderberg et al. 2017 §3): each synthetic
            module also sees the micro-batch's one-hot labels, concatenated to its input. The labels are the batch's
            last element (a tuple or list batch) or its ``"labels"`` entry (a dict batch), class indices (1-D integer,
            one per sample, in ``[0, C)``); anything else is refused at the first batch. Every stage of the pipeline
            loads the same batch, so each stage takes its micro-batches' labels from its own copy: no message.
        synthetic_num_classes: ``C``, the one-hot width; ``None``: the module's ``hparams.num_classes`` (or its
            ``num_classes`` attribute), refused at setup when it has neither.
        post_ahead: post each activation's and gradient's receive as soon as the schedule knows it will come, so the
            bytes travel while the stage computes (:mod:`lightning_pdist.pipeline.p2p`); off by default: measured
            slower on this project's 2-core machine with 2 and with 4 processes (docs/benchmarks.md).
        **kwargs: :class:`~lightning.pytorch.strategies.DDPStrategy` arguments (``start_method``,
            ``process_group_backend``, ``timeout``). Nothing is wrapped in ``DistributedDataParallel``.
    """

    strategy_name = "pipeline"
    wraps_in_ddp = False  # no DistributedDataParallel: no find_unused_parameters variants
    owned_reason = "the pipeline moves activations, not DDP buckets"

    def __init__(
        self,
        num_stages: int | None = None,
        schedule: str = "1f1b",
        num_microbatches: int | None = None,
        balance: str | None = None,
        split_points: list[str] | None = None,
        network: str | None = None,
        vertical_sync: bool = False,
        weight_stashing: bool = True,
        max_message_bytes: int = 1 << 31,
        nonfinite: str = "raise",
        synthetic_gradients: bool = False,
        synthetic_module: Callable[[Tensor], Any] | None = None,
        synthetic_optimizer: Callable[[Any], Optimizer] | None = None,
        synthetic_normalize: bool = True,
        synthetic_conditioning: str | None = None,
        synthetic_num_classes: int | None = None,
        post_ahead: bool = False,
        **kwargs: Any,
    ) -> None:
        owner = type(self).__name__
        if split_points == "auto":
            split_points = None  # balanced by parameters, as when none are given
        if split_points is not None and not isinstance(split_points, (list, tuple)):
            raise TypeError(f"{owner}(split_points={split_points!r}): split_points must be a list of layer names "
                            "(the first layer of stages 1..K-1), 'auto' or None")  # fmt: skip
        self.config = PipelineConfig(
            num_stages=num_stages, schedule=schedule, num_microbatches=num_microbatches, balance=balance,
            split_points=tuple(split_points) if split_points is not None else None, network=network,
            vertical_sync=vertical_sync, weight_stashing=weight_stashing, max_message_bytes=max_message_bytes,
            nonfinite=nonfinite, synthetic_gradients=synthetic_gradients, synthetic_module=synthetic_module,
            synthetic_optimizer=synthetic_optimizer, synthetic_normalize=synthetic_normalize,
            synthetic_conditioning=synthetic_conditioning, synthetic_num_classes=synthetic_num_classes,
            post_ahead=post_ahead, owner=owner,
        )  # fmt: skip
        if not weight_stashing:
            rank_zero_warn(f"{owner}(weight_stashing=False): backwards will use newer weights than their forwards "
                           "(PipeDream's no-stashing ablation); gradients are not those of any one weight version")  # fmt: skip
        super().__init__(nonfinite=nonfinite, **kwargs)  # OwnedDDPArguments refuses and hides DDP's comm-hook arguments
        self.num_stages, self.schedule, self.num_microbatches = num_stages, schedule, num_microbatches
        self.split: StageSplit | OwnedSplit | None = None
        self.executor: StageExecutor | None = None
        self._pp_group: Any = None
        self._dp_group: Any = None
        self._groups_made = False
        self._failed = False
        self._window: dict[str, Any] = {}
        self._step_stats = (0.0, 0.0)
        self._flag_group: Any = None  # 2bw under loss scaling: the overflow flags' own all-rank group
        self._defer_steps = False  # 2bw under loss scaling on several ranks: steps wait for the agreed flag
        self._deferred: list[_DeferredStep] = []
        self._pending_pdist_state: dict | None = None  # any module: resumed state waits for the cut at the first batch
        self._num_classes: int | None = None  # cDNI: the one-hot width (resolved at setup)

    # ------------------------------------------------------------------ layout
    @property
    def pipeline_stages(self) -> int:
        return self.config.stages_for(self.world_size)

    @property
    def replicas(self) -> int:
        return self.world_size // self.pipeline_stages

    @property
    def stage(self) -> int:
        return self.global_rank // self.replicas

    @property
    def replica(self) -> int:
        return self.global_rank % self.replicas

    def stage_rank(self, stage: int) -> int:
        """Global rank of ``stage`` in this rank's replica."""
        return stage * self.replicas + self.replica

    @override
    def set_world_ranks(self) -> None:
        super().set_world_ranks()
        self.config.check_world_size(self.world_size)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every stage of a replica reads the same batches; replicas read disjoint shards.
        return {"num_replicas": self.replicas, "rank": self.replica}

    def _make_groups(self) -> None:
        if self._groups_made or self.world_size == 1:
            return
        K, R = self.pipeline_stages, self.replicas
        for r in range(R):  # every rank creates every group, in the same order
            group = dist.new_group([s * R + r for s in range(K)])
            if r == self.replica:
                self._pp_group = group
        for s in range(K):
            group = dist.new_group([s * R + r for r in range(R)])
            if s == self.stage:
                self._dp_group = group
        self._groups_made = True

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        module = self.lightning_module
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self._check_trainer(trainer)
        self.accelerator.setup(trainer)
        self.model_to_device()
        self._make_groups()
        self._broadcast_module_from_rank_zero()
        self._use_pipeline_precision()
        self._defer_steps = (isinstance(self.precision_plugin, PipelineMixedPrecision)
                             and self.config.spec.defers_scaled_steps and self.world_size > 1)  # fmt: skip
        if self._defer_steps and self._flag_group is None:
            # Non-blocking flag all-reduces, issued at different moments on different ranks: a group of their own
            # keeps them from pairing with Lightning's collectives on the default group.
            self._flag_group = dist.new_group(list(range(self.world_size)))
        try:
            self.split = make_split(module, self.pipeline_stages, self.stage, self.config.network, self.config.balance,
                                    list(self.config.split_points) if self.config.split_points else None,
                                    getattr(module, "example_input_array", None), self._rank_zeros_partition)  # fmt: skip
        except ValueError as err:
            raise ValueError(f"{type(self).__name__}: {err}") from None
        self.precision_plugin.convert_module(self.model)
        if fitting:
            try:
                self.setup_optimizers(trainer)
            except Exception as err:
                held = self.split.partition.stage_names(self.stage)
                raise ValueError(f"{type(self).__name__}: configure_optimizers failed on stage {self.stage}, which holds only "
                                 f"{held[0]}..{held[-1]} ({type(err).__name__}: {err}); under a pipeline it must build one "
                                 "optimizer over self.parameters(), which on each stage are that stage's layers") from err  # fmt: skip
        if fitting:
            self._check_optimizer_unscaling()
            if self.config.spec.predicts_weights:
                check_momentum(self.optimizers[0], type(self).__name__, self.config.schedule)
            self._num_classes = self._conditioning_classes()
        self.setup_precision_plugin()
        # Any module (OwnedSplit) is cut at its first batch: its executor and resumed state wait until then.
        self.executor = self._make_executor() if self.split.ready else None
        self.announce(trainer)
        self._pending_pdist_state = self._loaded_pdist_state if fitting else None
        self._loaded_pdist_state = None
        if self.split.ready and self._pending_pdist_state is not None:
            self.load_pdist_state_dict(self._pending_pdist_state)
            self._pending_pdist_state = None

    def _ensure_split(self, hook: str, batch: Any, rest: tuple) -> None:
        """Any module: cut the network at its first batch, from one real call (every rank, the same batch shape)."""
        if self.split.ready:
            return
        call = self._capture_call(hook, batch, rest)
        try:
            self.split.plan(call)
        except ValueError as err:
            raise ValueError(f"{type(self).__name__}: {err}") from None
        self.executor = self._make_executor()
        if self._pending_pdist_state is not None:
            self.load_pdist_state_dict(self._pending_pdist_state)
            self._pending_pdist_state = None

    def _check_trainer(self, trainer: Any) -> None:
        owner, module = type(self).__name__, self.lightning_module
        if not module.automatic_optimization:
            raise ValueError(f"{owner}: {type(module).__name__}.automatic_optimization is False; the pipeline runs every "
                             "backward and update inside its schedule, so it needs automatic optimization")  # fmt: skip
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(f"{owner}: Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}): the pipeline "
                             "already accumulates over micro-batches; raise num_microbatches or the batch size instead")  # fmt: skip
        algorithm = str(getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm or "norm"))
        if trainer.gradient_clip_val and algorithm != "value":
            raise ValueError(f"{owner}: Trainer(gradient_clip_algorithm={algorithm!r}): the gradient "
                             "norm spans all stages; use gradient_clip_algorithm='value' (stage-local)")  # fmt: skip
        plugin = self.precision_plugin
        if getattr(plugin, "scaler", None) is not None:
            if not isinstance(plugin, MixedPrecision):
                raise ValueError(f"{owner}: the precision plugin {type(plugin).__name__} has a gradient scaler; the pipeline "
                                 "agrees on overflows only for Lightning's MixedPrecision('16-mixed') (or use bf16-mixed)")  # fmt: skip
            if not self.config.spec.scalable:
                raise ValueError(f"{owner}(schedule={self.config.schedule!r}): precision with a gradient scaler (16-mixed) is "
                                 f"not supported: {_UNSCALABLE}; use schedule='1f1b', 'gpipe' "
                                 "or '2bw' with 16-mixed, or bf16-mixed (no loss scaling) with this schedule")  # fmt: skip

    def _use_pipeline_precision(self) -> None:
        """Swap a ``MixedPrecision`` with a scaler for :class:`PipelineMixedPrecision` (the same scaler)."""
        plugin = self.precision_plugin
        if isinstance(plugin, MixedPrecision) and not isinstance(plugin, PipelineMixedPrecision) and plugin.scaler is not None:
            self.precision_plugin = PipelineMixedPrecision.replacing(plugin)

    def _check_optimizer_unscaling(self) -> None:
        plugin, optimizer = self.precision_plugin, self.optimizers[0]
        if isinstance(plugin, PipelineMixedPrecision) and plugin.handles_unscaling(optimizer):
            raise ValueError(f"{type(self).__name__}: {type(optimizer).__name__} unscales its gradients inside step() (a fused "
                             "optimizer), so the stages cannot agree on an overflow before it steps; use the non-fused "
                             "optimizer with 16-mixed")  # fmt: skip

    def _broadcast_module_from_rank_zero(self) -> None:
        # Every stage starts from rank 0's weights, as with DDP (and a resumed run's are equal anyway).
        if self.world_size == 1:
            return
        tensors = [t for t in self.lightning_module.state_dict().values() if isinstance(t, Tensor) and t.is_floating_point()]
        flat = flatten(tensors).to(self.root_device)
        dist.broadcast(flat, src=0)
        unflatten_into_(flat.cpu(), tensors)

    def _rank_zeros_partition(self, mine: Partition) -> Partition:
        # balance="time" measures on every rank and timings differ: everyone uses rank 0's cut.
        if self.world_size == 1 or self.config.balance != "time":
            return mine
        chosen = [mine]
        dist.broadcast_object_list(chosen, src=0)
        return chosen[0]

    def _make_executor(self) -> StageExecutor:
        K, s, config = self.pipeline_stages, self.stage, self.config
        # A split_points cut packs the boundary's values in one vector: one synthetic module per value with a gradient.
        parts = gradient_parts if isinstance(self.split, OwnedSplit) else None
        synthetic = (SyntheticGradient(config.synthetic_module, config.synthetic_optimizer, type(self).__name__, parts,
                                       config.synthetic_normalize, self._num_classes)
                     if config.spec.synthetic and s < K - 1 else None)  # fmt: skip
        p2p = P2P(self._pp_group, max_message_bytes=self.config.max_message_bytes, meter=self.comm_meter, device=self.root_device,
                  post_ahead=self.config.post_ahead)  # fmt: skip
        return StageExecutor(
            self.split.stage_module, s, K, config.spec.name, p2p,
            prev_rank=self.stage_rank(s - 1) if s > 0 else None, next_rank=self.stage_rank(s + 1) if s < K - 1 else None,
            input_fn=lambda j: self._window["inputs"][j - self._window["start"]],
            loss_fn=self._loss, update_fn=self._update,
            weight_stashing=self.config.weight_stashing, vertical_sync=self.config.vertical_sync,
            # Megatron's rule: the seed plus 100 per pipeline stage, so stages draw different dropout masks.
            seed=torch.initial_seed() + 100 * s,
            # Autocast around forwards only, as Lightning runs backward outside training_step's context.
            forward_context=self.precision_plugin.train_step_context, settle_fn=self._settle,
            weight_predictor=(lambda params, s: predicted_weights(params, self.optimizers[0], s))
            if self.config.spec.predicts_weights else None, synthetic=synthetic,
            label_fn=lambda j: self._window["labels"][j - self._window["start"]],
        )  # fmt: skip

    def _conditioning_classes(self) -> int | None:
        """cDNI's one-hot width: ``synthetic_num_classes``, else the module's ``num_classes`` (refused without one)."""
        if self.config.synthetic_conditioning is None:
            return None
        if self.config.synthetic_num_classes is not None:
            return self.config.synthetic_num_classes
        module = self.lightning_module
        found = getattr(module, "hparams", {}).get("num_classes", getattr(module, "num_classes", None))
        if not (isinstance(found, int) and not isinstance(found, bool) and found >= 2):
            raise ValueError(f"{type(self).__name__}(synthetic_conditioning='labels', synthetic_num_classes=None): the "
                             f"labels' one-hot needs the number of classes, and {type(module).__name__} has no "
                             f"hparams.num_classes or num_classes >= 2 (found {found!r}); pass synthetic_num_classes=C")  # fmt: skip
        return found

    # ------------------------------------------------------------------ the user's hooks, per stage
    def _stage_inputs(self, hook: str, batch: Any, rest: tuple, n: int, first_key: int) -> Any:
        """The network's input of each of the ``n`` micro-batches (keys ``first_key + j``)."""
        return self.split.microbatch_inputs(self._capture_call(hook, batch, rest), n, hook, batch_size_of(batch), first_key)

    def _capture_call(self, hook: str, batch: Any, rest: tuple) -> tuple[tuple, dict]:
        """Run ``hook`` up to its network call and return that call's ``(args, kwargs)``."""

        def hand_over(*args: Any, **kwargs: Any) -> Any:
            raise NetworkInput((args, kwargs))

        module = self.lightning_module
        try:
            with self.split.calling(hand_over), LogRecorder(module), torch.no_grad():
                getattr(module, hook)(batch, *rest)
        except NetworkInput as captured:
            return captured.value
        reason = getattr(self.split, "reason", "")
        raise RuntimeError(f"{type(self).__name__}: {type(module).__name__}.{hook} never called its network "
                           f"{self.split.path or type(module).__name__ + '.forward'!r} (the smallest submodule holding "
                           "every trainable parameter); the pipeline runs that network once per step"
                           + (f". {reason}" if reason else ""))  # fmt: skip

    def _call_user(self, hook: str, batch: Any, rest: tuple, network: Callable[..., Any], recorder: LogRecorder) -> Any:
        module = self.lightning_module
        with self.split.calling(network) as calls, recorder:
            out = getattr(module, hook)(batch, *rest)
        if calls[0] != 1:
            raise RuntimeError(f"{type(self).__name__}: {type(module).__name__}.{hook} never called its network {self.split.path!r}")
        return out

    def _loss(self, j: int, forward: Callable[[Any], Tensor]) -> Tensor:
        """Last stage: the module's training_step on micro-batch ``j``, the network replaced by the pipeline."""
        self._settle()  # 2bw: the previous batch's agreed flag sets the scale this loss is multiplied by
        w = self._window
        chunk = w["chunks"][j - w["start"]]
        recorder = LogRecorder(self.lightning_module, batch_size_of(chunk))
        out = self._call_user("training_step", chunk, w["rest"], lambda *a, **k: forward(self.split.stage_input(a, k)), recorder)
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, Tensor):
            raise RuntimeError(f"{type(self).__name__}: training_step returned {type(out).__name__} for a micro-batch; under a "
                               "pipeline it must return the loss (a tensor, or a dict with 'loss'): a step cannot be skipped")  # fmt: skip
        w["records"] += recorder.records
        w["losses"].append((float(loss.detach()), batch_size_of(chunk)))
        if isinstance(self.precision_plugin, PipelineMixedPrecision):
            # S·loss: every gradient the backwards send between stages is scaled (no fp16 underflow on the way).
            return self.precision_plugin.scale_loss(loss)
        return loss

    def _update(self) -> None:
        """One optimizer step of this stage (called by the executor), after the replicas' gradient average.

        Under 16-mixed the stage first unscales its gradients, and every rank of the world agrees whether any
        stage or replica overflowed: then all ranks skip this update, or none does.
        """
        optimizer, plugin = self.optimizers[0], self.precision_plugin
        scaled = isinstance(plugin, PipelineMixedPrecision)
        overflowed = plugin.unscale_(optimizer) if scaled else False
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if self.nonfinite_guard.consulted(plugin) and self._skips_nonfinite(grads):
            return  # skip_step: every rank skips this batch's update
        if self.replicas > 1 and grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            all_reduce_mean_(flat, self._dp_group, meter=self.comm_meter, kind="replica_all_reduce")
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        if scaled:
            flag = torch.tensor([float(overflowed)], device=self.root_device)
            if self._defer_steps:
                # 2bw: the last stage reaches this update a Lightning step before the first stage does, so the
                # flag's all-reduce is started here and the step waits (see _settle) until its version is needed.
                work = dist.all_reduce(flag, group=self._flag_group, async_op=True)
                self.comm_meter.add("overflow_flag", all_reduce_bytes(flag.numel() * flag.element_size(), self.world_size))
                params = [p for group in optimizer.param_groups for p in group["params"]]
                self._deferred.append(_DeferredStep(work, flag, [(p, p.grad) for p in params]))
                return
            # One float over the whole world: flushed schedules run the update of a batch in the same window
            # on every rank, so this blocking all-reduce meets every rank at the same update.
            all_reduce_sum_(flag, meter=self.comm_meter, kind="overflow_flag")
            plugin.overflowed = bool(flag.item() > 0)
        self.precision_plugin.optimizer_step(optimizer, model=self.lightning_module, closure=_no_closure)

    def _skips_nonfinite(self, grads: list[Tensor]) -> bool:
        """Whether this update is skipped for non-finite gradients (``"raise"`` raises instead); before the average.

        Flushed schedules agree over the world (one all-reduce of ``world_size`` flags); the others cannot (see the
        class docstring): the rank acts alone, and only ``"raise"`` is allowed there.
        """
        bad = not all_finite(grads)
        if self.config.spec.flushed:
            flags = one_hot_flag(bad, self.global_rank, self.world_size, device=self.root_device)
            all_reduce_sum_(flags, meter=self.comm_meter, kind="nonfinite_flag")
            ranks, scope = culprit_ranks(flags), "every rank"
        else:
            ranks, scope = ([self.global_rank] if bad else []), f"rank {self.global_rank}"
        if not ranks:
            return False
        try:
            self.nonfinite_guard.act("gradients", ranks, self.lightning_module, scope=scope,
                                     before="this update (the replicas' gradient average and the optimizer step)",
                                     skipped="that batch's update")  # fmt: skip
        except SkipStep:
            return True
        return False

    def _settle(self) -> None:
        """Apply the deferred 2bw steps, in order: wait for each agreed flag, then every rank steps or skips.

        Called before the newest weights are read (a forward on them, the next update), before the last stage
        scales a loss, and after a drain. No rank waits on one that needs it to move first: the last stage waits
        at its first loss of batch ``b+1`` for stage 0's update of batch ``b``, which depends only on gradients
        already sent (every batch has at least ``num_stages`` micro-batches, checked in training_step).
        """
        while self._deferred:
            deferred = self._deferred.pop(0)
            deferred.work.wait()
            for p, g in deferred.grads:  # Lightning's zero_grad has run since: the gradients came with the step
                p.grad = g
            self.precision_plugin.overflowed = bool(deferred.flag.item() > 0)
            self.precision_plugin.optimizer_step(self.optimizers[0], model=self.lightning_module, closure=_no_closure)
            for p, _ in deferred.grads:
                p.grad = None

    # ------------------------------------------------------------------ training
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        batch, rest = args[0], tuple(args[1:]) + tuple(kwargs.values())
        self._ensure_split("training_step", batch, rest)
        executor = self.executor
        n = min(self.config.microbatches_for(self.world_size), batch_size_of(batch))
        start = executor.cursor.available
        self._window = {"start": start, "rest": rest, "records": [], "losses": []}
        if self._defer_steps and n < self.pipeline_stages:
            raise RuntimeError(f"{type(self).__name__}(schedule={self.config.schedule!r}): a batch of "
                               f"{batch_size_of(batch)} samples gives {n} micro-batches, fewer than num_stages "
                               f"({self.pipeline_stages}); under 16-mixed the stages could then wait on each other's "
                               "overflow flags across steps (use drop_last=True or a batch size of at least num_stages)")  # fmt: skip
        if executor.is_last or self._num_classes is not None:
            self._window["chunks"] = split_batch(batch, n)
        if self._num_classes is not None:  # cDNI: every stage reads its own copy of the labels (and refuses alike)
            self._window["labels"] = [class_labels(chunk, self._num_classes, type(self).__name__) for chunk in self._window["chunks"]]
        if self.split.needs_call(executor.is_first, executor.is_last):
            self._window["inputs"] = self._stage_inputs("training_step", batch, rest, n, start)
        wait0, began = executor.p2p.wait_s, time.perf_counter()
        executor.admit(n)
        executor.run()  # forwards under the plugin's train_step_context (autocast), backwards outside it
        self._step_stats = (executor.p2p.wait_s - wait0, time.perf_counter() - began)
        payload = self._share_step(self._window)
        replay(self.lightning_module, payload["records"])
        self._log_pipeline_stats(payload["stats"])
        return torch.tensor(payload["loss"], device=self.root_device)

    def _share_step(self, window: dict) -> dict:
        """Last stage's loss and logs, and every stage's step statistics, on every stage of the replica."""
        executor = self.executor
        mine: dict[str, Any] = {"stats": self._stage_stats()}
        if executor.is_last:
            losses = window["losses"]
            total = sum(size for _, size in losses)
            mine["loss"] = sum(v * size for v, size in losses) / total if total else float("nan")
            mine["records"] = aggregate(self.lightning_module, window["records"])
        if self.pipeline_stages == 1:
            gathered = [mine]
        else:
            gathered = [None] * self.pipeline_stages
            dist.all_gather_object(gathered, mine, group=self._pp_group)
        last = gathered[-1]
        return {"loss": last.get("loss", float("nan")), "records": last.get("records", []), "stats": [g["stats"] for g in gathered]}

    def _stage_stats(self) -> dict:
        wait, wall = self._step_stats
        versions, _ = self.executor.weight_versions()
        return {"bubble": wait / wall if wall > 0 else 0.0, "bytes": float(self.comm_meter.step_bytes),
                "stash": float(max(versions, self.executor.max_versions))}  # fmt: skip

    def _log_pipeline_stats(self, stats: list[dict]) -> None:
        module = self.lightning_module
        module.log("pdist/pipeline/bubble", sum(s["bubble"] for s in stats) / len(stats), on_step=True, on_epoch=False)
        for s, st in enumerate(stats):
            for key in ("bubble", "stash"):
                name = "stash_depth" if key == "stash" else key
                module.log(f"pdist/pipeline/stage{s}/{name}", float(st[key]), on_step=True, on_epoch=False)
            module.log(f"pdist/pipeline/stage{s}/comm_bytes", st["bytes"], on_step=True, on_epoch=False)
        self.executor.max_versions = 1

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Nothing: the backwards ran inside the schedule (training_step)."""
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        # closure() runs training_step, i.e. this stage's window, whose U actions step the optimizer.
        output = closure()
        self.nonfinite_guard.step_done()
        self._log_comm_bytes()
        return output

    def drain(self) -> None:
        """Finish every micro-batch in flight (pipedream/2bw); every stage marks the point (vertical sync counts from it)."""
        if self.executor is not None:
            self.executor.run(draining=True)
            self._settle()

    @override
    def on_validation_start(self) -> None:
        self.drain()

    @override
    def on_train_end(self) -> None:
        self.drain()

    # ------------------------------------------------------------------ evaluation
    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._evaluate("validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._evaluate("test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._evaluate("predict_step", args, kwargs)

    def _evaluate(self, hook: str, args: tuple, kwargs: dict) -> Any:
        """Forward-only pipeline over the batch's micro-batches, then the module's hook on the last stage."""
        module = self.lightning_module
        if self.pipeline_stages == 1:
            return getattr(module, hook)(*args, **kwargs)
        batch, rest = args[0], tuple(args[1:]) + tuple(kwargs.values())
        self._ensure_split(hook, batch, rest)
        executor = self.executor
        n = min(self.config.microbatches_for(self.world_size), batch_size_of(batch))
        inputs = self._stage_inputs(hook, batch, rest, n, -n) if self.split.needs_call(executor.is_first, False) else None
        outputs = executor.forward_only(n, (lambda j: inputs[j]) if executor.is_first else None)
        mine: dict[str, Any] = {}
        if executor.is_last:
            network_output = self.split.join_outputs(outputs)
            recorder = LogRecorder(module, batch_size_of(batch))
            result = self._call_user(hook, batch, rest, lambda *a, **k: network_output, recorder)
            mine = {"records": aggregate(module, recorder.records), "result": result if hook == "predict_step" else None}
        gathered = [None] * self.pipeline_stages
        dist.all_gather_object(gathered, mine, group=self._pp_group)
        replay(module, gathered[-1]["records"])
        if executor.is_last:
            return result
        return gathered[-1]["result"]

    # ------------------------------------------------------------------ checkpoints
    def _gather_stages(self, obj: Any) -> list[Any] | None:
        """``obj`` of every stage of replica 0, on global rank 0 (``None`` elsewhere)."""
        if self.pipeline_stages == 1:
            return [obj] if self.global_rank == 0 else None
        if self.replica != 0:
            return None
        out = [None] * self.pipeline_stages if self.global_rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self._pp_group)
        return out

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The whole model on rank 0 (each stage's layers gathered), after draining the pipeline."""
        if self.split is None:
            return super().lightning_module_state_dict()
        self.drain()
        parts = self._gather_stages(self.split.local_state())
        if parts is None:
            return {}
        merged = _merge(parts)
        return {k: merged[k] for k in self.split.full_keys if k in merged}

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        parts = self._gather_stages(super().optimizer_state(optimizer))
        return {"pipeline_stages": parts} if parts is not None else {}

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        states = checkpoint["optimizer_states"]
        if len(states) != 1 or "pipeline_stages" not in states[0]:
            raise ValueError(f"{type(self).__name__}: the checkpoint's optimizer state was not written by a pipeline; "
                             "resume it with the strategy that wrote it, or load only the weights")  # fmt: skip
        stages = states[0]["pipeline_stages"]
        if len(stages) != self.pipeline_stages:
            raise ValueError(f"{type(self).__name__}(num_stages={self.pipeline_stages}): the checkpoint holds "
                             f"{len(stages)} stages' optimizer state; resume with the same num_stages")  # fmt: skip
        self.optimizers[0].load_state_dict(stages[self.stage])

    @override
    def pdist_state_dict(self) -> dict:
        state = super().pdist_state_dict()
        if self.executor is None or self.split is None:
            return state
        self.drain()
        stages = self._gather_stages(self.executor.state_dict())
        state["pipeline"] = {"schedule": self.config.schedule, "bounds": [list(b) for b in self.split.partition.bounds],
                             "names": list(self.split.partition.names), "stages": stages}  # fmt: skip
        return state

    @override
    def load_pdist_state_dict(self, state: dict) -> None:
        super().load_pdist_state_dict(state)
        pipeline = state.get("pipeline")
        if pipeline is None:
            return
        bounds = [tuple(b) for b in pipeline["bounds"]]
        if bounds != list(self.split.partition.bounds) or pipeline["names"] != list(self.split.partition.names):
            raise ValueError(f"{type(self).__name__}: the checkpoint cut the network as {bounds}, this run as "
                             f"{list(self.split.partition.bounds)}; resume with the same stages (split_points fixes the cut)")  # fmt: skip
        self.executor.load_state_dict(pipeline["stages"][self.stage])

    # ------------------------------------------------------------------ teardown
    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        self._deferred.clear()
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        split, self.split = self.split, None
        if split is not None and not self._failed:
            if self.executor is not None:
                self.executor.p2p.wait_all()
            # Every rank ends holding the whole trained model, as after any other strategy's fit.
            local = split.local_state()
            parts = [local]
            if self.pipeline_stages > 1:
                parts = [None] * self.pipeline_stages
                dist.all_gather_object(parts, local, group=self._pp_group)
            split.restore(_merge(parts), self.root_device)
        elif split is not None:
            # A failed fit: the other stages' weights never come here; they come back NaN, so Lightning's teardown
            # (module.cpu()) finds no meta tensor and the error that stopped the fit is the one raised.
            split.restore(split.local_state(), self.root_device)
        self.executor = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        super().register_strategies(strategy_registry)
        aliases = {"pipeline_gpipe": "gpipe", "pipeline_1f1b": "1f1b", "pipedream": "pipedream", "pipedream_2bw": "2bw",
                   "pipeline_spectrain": "spectrain", "pipeline_ddg": "ddg", "pipeline_features_replay": "features_replay"}  # fmt: skip
        for name, schedule in aliases.items():
            register_variants(strategy_registry, cls, name, f"pipeline, schedule={schedule!r}", find_unused=False,
                              schedule=schedule)  # fmt: skip
        register_variants(strategy_registry, cls, "pipeline_dni", "pipeline, schedule='pipedream', synthetic_gradients=True",
                          find_unused=False, schedule="pipedream", synthetic_gradients=True)  # fmt: skip


# Why a gradient scaler is refused where a micro-batch is a mini-batch (the method card has the timelines).
_UNSCALABLE = ("each stage updates right after its own backward of a micro-batch, before the earlier stages have run "
               "theirs, so no stage can know at its update whether another stage overflowed on that micro-batch, and "
               "skipping it everywhere would need a flush per micro-batch")  # fmt: skip


@dataclass
class _DeferredStep:
    """A 2bw update waiting for its agreed overflow flag: the all-reduce in flight and the stage's gradients."""

    work: Any
    flag: Tensor
    grads: list[tuple[Tensor, Tensor | None]]


def _merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One state dict from every stage's (each holds its own layers' keys)."""
    merged: dict[str, Any] = {}
    for part in parts:
        merged.update(part)
    return merged


def _no_closure() -> None:
    """The optimizer's closure: the gradients are already there (the schedule ran the backwards)."""
    return None
