"""Tensor parallelism (Megatron-style) and DP×TP for an existing LightningModule, without ``configure_model``.

Lightning's :class:`~lightning.pytorch.strategies.ModelParallelStrategy` builds the 2-D device mesh
``("data_parallel", "tensor_parallel")``, gives each data-parallel group its own data and saves full or sharded
checkpoints, but leaves the sharding to a ``configure_model`` the user writes, and synchronises nothing across the
data-parallel dimension unless that hook also applies FSDP. :class:`TensorParallelStrategy` keeps the first half
and supplies the rest:

1. **The plan** (:mod:`lightning_pdist.tensor_parallel.plan`): derived from the module (``"auto"``,
   ``"hybrid"``) or given as ``{module name: "colwise" | "rowwise" | "replicate"}``, checked against the module
   and the degree, then applied with ``torch.distributed.tensor.parallel.parallelize_module`` over the
   tensor-parallel mesh dimension (``ColwiseParallel`` / ``RowwiseParallel``).
2. **Gradient synchronisation across the data-parallel dimension**, before every optimizer step: the local
   gradient (a shard for sharded weights) is all-reduced and averaged over the ``data_parallel_size`` ranks that
   hold the same shard. Replicated weights need nothing within a tensor-parallel group: every rank computes them
   from the same replicated activations. For the hybrid plan, with ``N = tensor_parallel_size``: the
   convolution layers (data-parallel) average over all ranks; the fully connected layers see the whole gathered
   batch, so their gradient is that of the *sum* of the ``N`` ranks' mean losses and is divided by ``N``.
3. **Byte accounting**: every collective DTensor issues (forward and backward) is counted from the tensor sent
   (:class:`~lightning_pdist.tensor_parallel.meter.DTensorCommMeter`), the data-parallel all-reduce by the comm
   layer, and ``pdist/comm_bytes`` is logged after each optimizer step like every other strategy.

Non-finite gradients (``nonfinite=``, :mod:`lightning_pdist.core.nonfinite`): after the backward and *before*
the data-parallel average, every rank checks its own (local, for sharded weights) gradients per tensor, and one
all-reduce of ``world_size`` flags over all ranks (counted as ``nonfinite_flag``) tells every rank whether, and on
which ranks, one was not finite; then ``"raise"`` stops every rank before the average and the optimizer step,
``"skip_step"`` skips both on every rank (nothing is zeroed; float buffers restored; ``pdist/skipped_steps``), and
``"propagate"`` checks nothing. A NaN that arises in a sharded layer's forward reaches the other ranks of its
tensor-parallel group through the activation all-reduce, so all of them are named.

Checkpoints are full by default (``save_distributed_checkpoint=False``): rank 0 writes one file that
``load_from_checkpoint`` reads in a plain process and that resumes exactly here.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.model_parallel import _is_full_checkpoint, _load_checkpoint
from lightning.fabric.strategies.model_parallel import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_optimizer_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import OptimStateKeyType
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_pdist.core.nonfinite import all_finite, culprit_ranks, one_hot_flag
from lightning_pdist.tensor_parallel.comm import TPComm
from lightning_pdist.tensor_parallel.layers import Sharding, is_strided, local_shard, unshard
from lightning_pdist.tensor_parallel.plan import COLWISE, HEADS, QKV, ROWWISE, TPPlan, check_plan, plan_for
from lightning_pdist.tensor_parallel.shard import apply_plan
from lightning_pdist.core.accounting import CommMeter
from lightning_pdist.core.collectives import all_reduce_mean_, all_reduce_sum_
from lightning_pdist.tensor_parallel.meter import DTensorCommMeter
from lightning_pdist.core.strategy import register_variants
from lightning_pdist.core.multinode import check_gloo_interface
from lightning_pdist.core.run_logging import CommLogState, install_progress_bar_format, log_comm_bytes
from lightning_pdist.core.run_logging import log_final_total, log_run_settings, resolved_settings
from lightning_pdist.core import lifetime
from lightning_pdist.tensor_parallel import clip as tensor_parallel_clip
from lightning_pdist.core.guard import NonFiniteGuard, SkipStep, optimizer_grads
from lightning_pdist.core.safe_io import SafeCheckpointIO

__all__ = ["TensorParallelStrategy"]

PLANS = ("auto", "hybrid")


class TensorParallelStrategy(ModelParallelStrategy):
    """Shard the model's linear layers over ``tensor_parallel_size`` ranks; replicate it ``data_parallel_size`` times.

    Registered as ``"tensor_parallel"`` (with ``_fork`` / ``_spawn`` variants). ``world_size =
    tensor_parallel_size × data_parallel_size``; ranks of one tensor-parallel group see the same batches.

    Args:
        tensor_parallel_size: ranks sharing one copy of the model (the degree ``t``). ``None``: the world size
            divided by ``data_parallel_size`` (all ranks when both are ``None``). Keep it within a node: every
            layer pair all-reduces activations.
        data_parallel_size: copies of the sharded model, each with its own data. ``None``: world / ``t``.
        plan: ``"auto"`` (Transformer blocks Megatron-style, Linear stacks in column/row pairs, see
            :func:`~lightning_pdist.tensor_parallel.plan.plan_for`), ``"hybrid"`` (convolutions
            data-parallel over all ranks, the fully connected stack sharded over the gathered batch), or a dict
            ``{module name: "colwise" | "rowwise" | "replicate"}``.
        sequence_parallel: shard the LayerNorm/RMSNorm/dropout/residual activations of every
            ``nn.TransformerEncoder`` and transformers' BERT/ALBERT encoder or LLaMA-style decoder stack with
            sharded layers along the sequence (Korthikanti et al., 2022): all-gather before and reduce-scatter
            after each sharded pair instead of the all-reduces, the norm and row-wise bias gradients summed over
            the group once per step; the sequence length must be divisible by ``tensor_parallel_size`` (checked at
            the first forward). Refused for models without such a stack (torch's ``nn.TransformerDecoder``) and
            for cross-attention.
        gather_on_teardown: ``True`` (default): when ``fit``/``validate``/``test``/``predict`` ends, every rank's
            module holds the full, plain trained parameters again (one all-gather per sharded parameter): a plain
            ``model.state_dict()`` that loads anywhere, and a module that runs on one rank alone. ``False``: the
            module keeps its DTensor shards (for models too large to gather on one rank; save with a checkpoint).
        save_distributed_checkpoint: ``False`` (default): one full checkpoint file, readable by
            ``load_from_checkpoint`` anywhere. ``True``: a folder with one shard per rank (torch.distributed.checkpoint).
        process_group_backend: ``None`` picks gloo on CPU, NCCL on GPUs.
        timeout: for collectives.
        start_method: ``"popen"`` (Lightning's default: the script runs again per rank), ``"fork"`` or ``"spawn"``.
        nonfinite: ``"raise"`` (default), ``"skip_step"`` or ``"propagate"``: what every rank does when a step's
            gradients hold NaN/Inf (see the module docstring).

    Example::

        trainer = Trainer(accelerator="cpu", devices=2, strategy="tensor_parallel")  # BERT-like encoder, t = 2
        trainer = Trainer(devices=4, strategy=TensorParallelStrategy(tensor_parallel_size=2))  # DP×TP 2×2
    """

    strategy_name = "tensor_parallel"

    def __init__(
        self,
        tensor_parallel_size: int | None = None,
        data_parallel_size: int | None = None,
        plan: str | dict[str, str] = "auto",
        sequence_parallel: bool = False,
        gather_on_teardown: bool = True,
        save_distributed_checkpoint: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        nonfinite: str = "raise",
    ) -> None:
        owner = type(self).__name__
        self.nonfinite_guard = NonFiniteGuard(nonfinite, owner)
        for arg, value in (("tensor_parallel_size", tensor_parallel_size), ("data_parallel_size", data_parallel_size)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise TypeError(f"{owner}({arg}={value!r}): {arg} must be an int >= 1 or None")
            if value is not None and value < 1:
                raise ValueError(f"{owner}({arg}={value}): {arg} must be >= 1 or None")
        if isinstance(plan, str):
            if plan not in PLANS:
                raise ValueError(f"{owner}(plan={plan!r}): plan must be one of {PLANS} or a dict "
                                 "{module name: 'colwise' | 'rowwise' | 'replicate'}")  # fmt: skip
        elif isinstance(plan, Mapping):
            try:
                TPPlan.from_dict(plan)
            except (TypeError, ValueError) as err:
                raise type(err)(f"{owner}(plan={dict(plan)!r}): {err}") from None
            if not any(p in (COLWISE, ROWWISE, HEADS, QKV) for p in plan.values()):
                raise ValueError(f"{owner}(plan={dict(plan)!r}): the plan shards nothing; name at least one "
                                 "module 'colwise', 'rowwise', 'heads' or 'qkv'")  # fmt: skip
        else:
            raise TypeError(f"{owner}(plan={plan!r}): plan must be 'auto', 'hybrid' or a dict of placements")
        for arg, value in (("sequence_parallel", sequence_parallel), ("gather_on_teardown", gather_on_teardown),
                           ("save_distributed_checkpoint", save_distributed_checkpoint)):
            if not isinstance(value, bool):
                raise TypeError(f"{owner}({arg}={value!r}): {arg} must be a bool")
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(f"{owner}(start_method={start_method!r}): start_method must be 'popen', 'spawn', "
                             "'fork' or 'forkserver'")  # fmt: skip
        super().__init__(data_parallel_size=data_parallel_size or "auto",
                         tensor_parallel_size=tensor_parallel_size or "auto",
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)  # fmt: skip
        self._sizes_given = (tensor_parallel_size, data_parallel_size)
        self._plan_arg = dict(plan) if isinstance(plan, Mapping) else plan
        self._start_method = start_method
        self.checkpoint_io = SafeCheckpointIO()  # a failed save never destroys the previous file
        self.comm_meter = CommMeter()
        self._comm_log = CommLogState()
        self.plan: TPPlan | None = None
        self.sequence_parallel, self.gather_on_teardown = sequence_parallel, gather_on_teardown
        self._sharding: Sharding | None = None
        self._tp_comm: TPComm | None = None
        self._failed = False
        self._counting_active = False
        self._dp_params: list[torch.nn.Parameter] = []  # hybrid: averaged over every rank
        self._mp_params: set[int] = set()  # hybrid: ids of the gathered-batch (model-parallel) parameters

    # ------------------------------------------------------------------ sizes, launcher, mesh
    def _resolve_sizes(self) -> None:
        world = self.num_processes * self.num_nodes
        tp, dp = self._sizes_given
        owner = type(self).__name__
        given = f"{owner}(tensor_parallel_size={tp}, data_parallel_size={dp})"
        where = f"the world size {world} (devices={self.num_processes} x num_nodes={self.num_nodes})"
        if tp is None and dp is None:
            tp, dp = world, 1
        elif tp is None:
            if world % dp:
                raise ValueError(f"{given}: data_parallel_size must divide {where}")
            tp = world // dp
        elif dp is None:
            if world % tp:
                raise ValueError(f"{given}: tensor_parallel_size must divide {where}")
            dp = world // tp
        if tp * dp != world:
            raise ValueError(f"{given}: tensor_parallel_size x data_parallel_size = {tp * dp} must equal {where}")
        if tp == 1:
            rank_zero_warn(f"{given}: tensor_parallel_size=1 shards nothing; this is data parallelism "
                           "(strategy='ddp' does the same with overlapped communication)")  # fmt: skip
        self._tensor_parallel_size, self._data_parallel_size = tp, dp

    @override
    def _configure_launcher(self) -> None:
        # Runs in Trainer.__init__, before any process starts: the sizes are checked here.
        self._resolve_sizes()
        assert self.cluster_environment is not None
        if self._start_method == "popen" or self.cluster_environment.creates_processes_externally:
            super()._configure_launcher()
        else:
            self._launcher = _FullWeightsLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        check_gloo_interface(type(self).__name__, self.num_nodes,
                             self._process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo"))
        super().setup_environment()

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        if self.plan is not None and self.plan.gather_batch_at is not None:
            return {"num_replicas": self.world_size, "rank": self.global_rank}  # hybrid: every rank its own data
        return super().distributed_sampler_kwargs

    # ------------------------------------------------------------------ setup: shard the module
    @override
    def setup(self, trainer: Any) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._parallelize(self.model)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        tensor_parallel_clip.install(self.precision_plugin)  # torch's clipping cannot mix DTensor and plain grads
        install_progress_bar_format(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
            log_run_settings(trainer, self.run_settings())

    def run_settings(self) -> dict[str, Any]:
        """The resolved settings every logger receives at setup: sizes after resolving ``None``, and the plan."""
        settings = resolved_settings(self, self.strategy_name)
        settings.update(tensor_parallel_size=self._tensor_parallel_size, data_parallel_size=self._data_parallel_size,
                        plan=self.plan.as_dict() if self.plan is not None else self._plan_arg)  # fmt: skip
        return settings

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if self.lightning_module is not None and self.lightning_module._trainer is not None:
            log_final_total(self.lightning_module._trainer, self.comm_meter, self._comm_log)

    def _owner(self) -> str:
        return f"{type(self).__name__}(plan={self._plan_arg!r}, sequence_parallel={self.sequence_parallel})"

    # ------------------------------------------------------------------ teardown: a plain module again
    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True  # the other ranks may be gone: no gather
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        model = self.model
        if self.gather_on_teardown and not self._failed and getattr(model, "_pdist_tp_plan", None) is not None:
            unshard(model, self._sharding)  # every rank: full plain Parameters, torch's own forwards
            del model._pdist_tp_plan
            self._sharding = None
        self._failed = False
        super().teardown()

    def _resolve_plan(self, module: torch.nn.Module) -> TPPlan:
        arg = self._plan_arg
        owner = f"{type(self).__name__}(plan={arg!r})"
        try:
            plan = TPPlan.from_dict(arg) if isinstance(arg, dict) else plan_for(module, hybrid=arg == "hybrid")
        except ValueError as err:
            raise ValueError(f"{owner}: {err}") from None
        check_plan(plan, module, self._tensor_parallel_size, owner=owner)
        return plan

    def _parallelize(self, module: torch.nn.Module) -> None:
        if getattr(module, "_pdist_tp_plan", None) is not None:
            self.plan = module._pdist_tp_plan  # validate/test after fit in the same Trainer: already sharded
            return
        if any(isinstance(p, DTensor) for p in module.parameters()):
            raise RuntimeError(f"{type(self).__name__}: the module already holds DTensor parameters (sharded in "
                               "configure_model?); use Lightning's ModelParallelStrategy for hand-written "
                               "parallelization, or remove it and let the plan shard the module")  # fmt: skip
        self.plan = self._resolve_plan(module)
        split = self.plan.named(HEADS) + self.plan.named(QKV)
        if split and self._save_distributed_checkpoint:
            raise ValueError(f"{type(self).__name__}(save_distributed_checkpoint=True): modules split by heads "
                             f"({', '.join(repr(n) for n in split)}) cannot be saved as a torch.distributed.checkpoint "
                             "folder (it does not place the rows of per-head shards); use save_distributed_checkpoint="
                             "False (one full file)")  # fmt: skip
        mesh = self.device_mesh["tensor_parallel"]
        self._tp_comm = TPComm(mesh.get_group(), self.comm_meter)
        self._sharding = apply_plan(module, self.plan, mesh, self._tp_comm, self.sequence_parallel, self._owner())
        gather = self.plan.gather_batch_at
        module._pdist_tp_plan = self.plan
        if gather is not None:
            inside = [p for n, p in module.named_parameters() if n.startswith(f"{gather}.")]
            self._mp_params = {id(p) for p in inside}
            self._dp_params = [p for p in module.parameters() if id(p) not in self._mp_params]

    # ------------------------------------------------------------------ training step: count, sync, log
    @contextmanager
    def _counting(self) -> Iterator[None]:
        if self._counting_active:
            yield
            return
        self._counting_active = True
        if self._tp_comm is not None:
            self._tp_comm.counting = True
        try:
            with DTensorCommMeter(self.comm_meter):
                yield
        finally:
            self._counting_active = False
            if self._tp_comm is not None:
                self._tp_comm.counting = False

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._counting():
            return super().training_step(*args, **kwargs)

    @override
    def backward(self, *args: Any, **kwargs: Any) -> Any:
        with self._counting():
            return super().backward(*args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        guard = self.nonfinite_guard
        if guard.consulted(self.precision_plugin):  # checked before the average, which would spread a NaN
            module = model if model is not None else self.lightning_module
            closure = guard.wrap(closure, lambda: self._nonfinite_ranks(optimizer), module,
                                 before="the data-parallel gradient average and the optimizer step",
                                 skipped="that gradient average and optimizer step")  # fmt: skip

        def closure_then_sync() -> Any:
            output = closure()
            self._sync_gradients(optimizer)
            return output

        # Not counted here: hooks that run between backward and the step (on_before_optimizer_step) are not the
        # algorithm's traffic; training_step and backward are counted where they run.
        try:
            output = super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)
        except SkipStep:
            output = None  # every rank skipped this step (nothing averaged, nothing stepped)
        guard.step_done()
        log_comm_bytes(self.lightning_module, self.comm_meter, self._comm_log)
        guard.log(self.lightning_module)
        return output

    @property
    def nonfinite(self) -> str:
        """The non-finite policy: ``"raise"``, ``"skip_step"`` or ``"propagate"``."""
        return self.nonfinite_guard.policy

    def _nonfinite_ranks(self, optimizer: Optimizer) -> list[int] | None:
        """The ranks whose own (local) gradients are not finite, agreed by one all-reduce of ``world_size`` flags."""
        bad = not all_finite([_local(g) for g in optimizer_grads(optimizer)])
        flags = one_hot_flag(bad, self.global_rank, self.world_size, device=self.root_device)
        all_reduce_sum_(flags, meter=self.comm_meter, kind="nonfinite_flag")
        return culprit_ranks(flags) or None

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self.nonfinite_guard.snapshot(self.lightning_module, self.precision_plugin)

    def _sync_gradients(self, optimizer: Optimizer) -> None:
        """Sum the partial gradients of sequence parallelism over the tensor-parallel group (one flat all-reduce),
        then average the local gradients of ``optimizer``'s parameters across the data-parallel dimension."""
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if self._sharding is not None and self._sharding.partial and self._tp_comm is not None:
            mine = {id(p) for p in params}
            with self._counting():
                self._tp_comm.sum_flat_([_local(p.grad) for p in self._sharding.partial if id(p) in mine])
        dp_group = self.device_mesh["data_parallel"].get_group()
        tp = self._tensor_parallel_size
        if self.plan is not None and self.plan.gather_batch_at is not None:
            every = [p for p in params if id(p) not in self._mp_params]
            sharded = [p for p in params if id(p) in self._mp_params]
            for p in sharded:
                _local(p.grad).div_(tp)  # d(sum of the t ranks' losses) -> d(their mean)
            _all_reduce_mean(every, None, self.world_size, self.comm_meter)
            _all_reduce_mean(sharded, dp_group, self._data_parallel_size, self.comm_meter)
            return
        _all_reduce_mean(params, dp_group, self._data_parallel_size, self.comm_meter)

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        checkpoint["pdist"] = {
            "strategy": type(self).__name__, "comm_meter": self.comm_meter.state_dict(),
            "skipped_steps": self.nonfinite_guard.skipped.state_dict(),
            "plan": self.plan.as_dict() if self.plan is not None else None,
            "tensor_parallel_size": self._tensor_parallel_size, "data_parallel_size": self._data_parallel_size,
        }  # fmt: skip
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        if not _is_full_checkpoint(path):
            checkpoint = super().load_checkpoint(path, weights_only=weights_only)
        else:
            # Lightning's loader indexes the first state entry to tell ids from names, which fails for optimizers
            # without state (plain SGD): load the module through it, the optimizers here.
            assert self.lightning_module is not None and self.model is not None
            checkpoint = _load_checkpoint(path, {"state_dict": self.model}, strict=self.lightning_module.strict_loading,
                                          weights_only=weights_only)  # fmt: skip
            strided = {n: p for n, p in self.model.named_parameters() if is_strided(p)}
            if strided:  # torch's loaders place rows of a _StridedShard as if it were Shard: put them right here
                full = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)["state_dict"]
                self._load_strided({n: (p, p, full[n]) for n, p in strided.items() if n in full})
            options = StateDictOptions(broadcast_from_rank0=True, full_state_dict=True)
            for optimizer, state in zip(self.optimizers, checkpoint.get("optimizer_states", [])):
                if not state["state"]:  # nothing per parameter: the hyperparameters are all there is
                    optimizer.load_state_dict(state)
                    continue
                by_name = FSDP.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_NAME, self.model)
                set_optimizer_state_dict(self.model, optimizer, optim_state_dict=by_name, options=options)
                self._load_strided({f"{n}.{key}": (p, optimizer.state[p][key], value) for n, p in strided.items()
                                    for key, value in by_name["state"].get(n, {}).items()
                                    if torch.is_tensor(value) and value.shape == p.shape})  # fmt: skip
        state = checkpoint.get("pdist") or {}
        if state.get("strategy") == type(self).__name__:
            self.comm_meter.load_state_dict(state.get("comm_meter", {}))
            self.nonfinite_guard.skipped.load_state_dict(state.get("skipped_steps", {}))
        return checkpoint

    def _load_strided(self, targets: dict[str, tuple[Any, Any, torch.Tensor]]) -> None:
        """Write each full tensor's rows for this rank into the local shard of a head-split DTensor (or its state)."""
        assert self._tp_comm is not None
        with torch.no_grad():
            for param, target, full in targets.values():
                local = local_shard(full, param.placements[0], self._tp_comm.rank, self._tp_comm.size)
                target.to_local().copy_(local)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        description = cls.__doc__.splitlines()[0] if cls.__doc__ else ""
        register_variants(strategy_registry, cls, cls.strategy_name, description, find_unused=False)


class _FullWeightsLauncher(lifetime.ForkSafeLaunch, _MultiProcessingLauncher):
    """Lightning's fork/spawn launcher, handing the main process full weights instead of DTensor shards.

    Lightning saves rank 0's ``state_dict()`` for the main process, which loads it with a ``map_location``
    callable that DTensors do not support; the full tensors are what the main process's unsharded module needs.
    """

    @override
    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Any:
        full = get_model_state_dict(trainer.lightning_module,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))  # fmt: skip
        state_dict = trainer.lightning_module.state_dict
        trainer.lightning_module.state_dict = lambda *a, **k: full  # read once by the parent's method below
        try:
            return super()._collect_rank_zero_results(trainer, results)
        finally:
            trainer.lightning_module.state_dict = state_dict


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _all_reduce_mean(params: list[torch.Tensor], group: Any, size: int, meter: CommMeter) -> None:
    """One flat all-reduce-mean of the local gradients of ``params`` over ``group`` (nothing when ``size`` is 1)."""
    if size == 1 or not params:
        return
    grads = [_local(p.grad) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    all_reduce_mean_(flat, group, meter=meter, kind="dp_all_reduce")
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
