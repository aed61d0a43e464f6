"""The base every collective-based lightning_pdist strategy builds on.

:class:`PdistStrategy` is Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy` plus three
things every algorithm here needs:

1. **Comm hooks on every device type.** Lightning 2.6 registers ``ddp_comm_hook`` only when the
   root device is CUDA and silently ignores it elsewhere; we register it on CPU/gloo too. With no
   hook given, the counted :func:`~lightning_pdist.core.hooks.allreduce_hook` is registered: the
   same arithmetic as DDP's own reduction, plus byte accounting.
2. **Byte accounting.** A :class:`~lightning_pdist.core.accounting.CommMeter` counts the bytes this
   rank sends through our comm layer; on every step the loggers receive, the strategy logs
   ``pdist/comm_bytes`` (the bytes since the previous such step) and ``pdist/comm_bytes_total``
   (cumulative) with ``LightningModule.log``, so they reach the progress bar and every logger, with
   the algorithm's diagnostics (:meth:`PdistStrategy.diagnostics`;
   :mod:`~lightning_pdist.core.run_logging`). Figures are this rank's own (loggers write rank
   0's). Traffic for evaluation and checkpoints is not training traffic and is not counted.
3. **Algorithm state in checkpoints.** Lightning has no strategy ``state_dict`` hook, so
   :meth:`save_checkpoint` adds ``checkpoint["pdist"]`` and :meth:`load_checkpoint` reads it back;
   subclasses fill it through :meth:`pdist_state_dict` / :meth:`load_pdist_state_dict`. State that
   differs per rank (a replica, a residual) goes through :meth:`pdist_rank_state` /
   :meth:`load_pdist_rank_state` into one file per rank next to the checkpoint
   (:mod:`lightning_pdist.core.rank_files`): no rank ever holds another rank's state, so the
   memory a save needs and the main file's size do not grow with the world size, and
   ``load_from_checkpoint`` still reads the main file alone.
4. **One non-finite policy** (``nonfinite=``, :mod:`lightning_pdist.core.nonfinite`): after the closure
   (forward, backward) and before the optimizer steps, the step's gradients are checked per tensor; ``"raise"``
   stops every rank naming the culprits and the global step, ``"skip_step"`` skips the step on every rank and
   counts it in ``pdist/skipped_steps`` (both put back the float buffers the step's forward updated),
   ``"propagate"`` checks nothing. Under DDP the averaged gradients are the same on every rank, so every rank takes
   the same branch without a collective; the comm hook notes which ranks' buckets were non-finite before the
   average, and those notes are gathered only when the average was. Subclasses whose ranks step on gradients of
   their own override :meth:`~PdistStrategy.nonfinite_ranks`. Under an fp16 ``GradScaler`` the scaler's overflow
   rule decides.
5. **Every registered name has its variants**: ``<name>``, ``<name>_fork``, ``<name>_spawn`` and,
   for strategies that wrap the model in DDP, each with ``_find_unused_parameters_true``; DDP's
   unused-parameter error is rewritten to name that variant, never plain ``ddp``'s (which would
   silently drop the algorithm).
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any, Callable

from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.exceptions import _augment_message
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_pdist.core.nonfinite import all_finite, culprit_ranks, grads_finite, one_hot_flag
from lightning_pdist.core.accounting import CommMeter
from lightning_pdist.core.collectives import all_reduce_sum_, rank_world
from lightning_pdist.core.compression import CompressionState, Compressor, refuse_compression
from lightning_pdist.core.hooks import AllReduceState, allreduce_hook, settle_comm_callbacks
from lightning_pdist.core import lifetime, rank_files
from lightning_pdist.core.multinode import check_gloo_interface
from lightning_pdist.core.guard import NonFiniteGuard, SkipStep, optimizer_grads
from lightning_pdist.core.run_logging import CommLogState, IntervalMeans, forget_step_metrics
from lightning_pdist.core.run_logging import install_progress_bar_format, log_comm_bytes, log_final_total
from lightning_pdist.core.run_logging import log_run_settings, log_step_metrics, resolved_settings
from lightning_pdist.core.safe_io import SafeCheckpointIO
from lightning_pdist.core.config import register_variants  # Lightning-free, so arguments classes can use it

__all__ = ["PdistStrategy", "check_keywords", "register_variants"]


class PdistStrategy(DDPStrategy):
    """DDP with comm hooks on every device, byte accounting and checkpointed algorithm state.

    Registered as ``"pdist_ddp"``: gradient all-reduce every step, exactly Lightning's ``"ddp"``,
    with ``pdist/comm_bytes`` logged. The other keyword arguments go to
    :class:`~lightning.pytorch.strategies.DDPStrategy` (and from there to
    ``DistributedDataParallel``), so LightningCLI exposes them too.

    Args:
        nonfinite: ``"raise"`` (default), ``"skip_step"`` or ``"propagate"``: what every rank does when a step's
            gradients hold NaN/Inf (:mod:`lightning_pdist.core.nonfinite`; module docstring, point 4).
        compression: a compressor from :mod:`lightning_pdist.compression` (``TopK(0.01)``, ``DGC()``, ...) that
            every step's gradients go through, per parameter tensor, instead of the all-reduce (None: DDP's
            all-reduce). Its error-feedback residuals are checkpointed per rank. Registered as ``topk``, ``dgc``,
            ``qsgd``, ``terngrad``, ``powersgd`` (``docs/algorithms/compression.md``).

    Example::

        trainer = Trainer(accelerator="cpu", devices=2, strategy="pdist_ddp")
        trainer = Trainer(accelerator="cpu", devices=2, strategy=PdistStrategy(compression=TopK(0.01)))
    """

    strategy_name = "pdist_ddp"
    #: Whether the model is wrapped in DistributedDataParallel (and so has a ``find_unused_parameters`` switch).
    wraps_in_ddp = True

    #: What ``compression=`` compresses here (``core.compression.USES``).
    compression_use = "gradients"

    def __init__(self, nonfinite: str = "raise", compression: Compressor | None = None, **kwargs: Any) -> None:
        check_keywords(type(self), kwargs, wraps_in_ddp=self.wraps_in_ddp)
        self.nonfinite_guard = NonFiniteGuard(nonfinite, type(self).__name__)
        if compression is not None and "compression" not in inspect.signature(type(self).__init__).parameters:
            raise TypeError(f"{type(self).__name__}(compression={compression!r}): unknown argument; "
                            f"{type(self).__name__} owns its communication and takes no compression")  # fmt: skip
        self.compression = refuse_compression(type(self).__name__, compression, self.compression_use)
        self.compression_state: CompressionState | None = None
        hook = kwargs.get("ddp_comm_hook")
        if hook is not None and self.compression is not None:
            raise ValueError(f"{type(self).__name__}(compression={compression!r}): compression owns the comm hook; "
                             "ddp_comm_hook must be left unset")  # fmt: skip
        if hook is not None and not callable(hook):
            raise TypeError(f"{type(self).__name__}(ddp_comm_hook={hook!r}): ddp_comm_hook must be a callable "
                            "(state, bucket) -> Future, e.g. torch.distributed.algorithms.ddp_comm_hooks.default_hooks"
                            ".fp16_compress_hook")  # fmt: skip
        kwargs.setdefault("checkpoint_io", SafeCheckpointIO())  # a failed save never destroys the previous file
        super().__init__(**kwargs)
        if self._ddp_comm_hook is not None:
            rank_zero_warn(
                f"{type(self).__name__}(ddp_comm_hook={getattr(self._ddp_comm_hook, '__qualname__', self._ddp_comm_hook)}):"
                " bytes sent by a hook from outside lightning_pdist are not counted in pdist/comm_bytes."
            )
        self.comm_meter = CommMeter()
        self._comm_log = CommLogState()
        self._diagnostics = IntervalMeans()  # what the algorithm noted since the last logged step
        self._logged_diagnostics: set[str] = set()  # diagnostics logged at the last logged step
        self._hook_state: AllReduceState | None = None  # our gradient hook's (it notes non-finite buckets)
        self._loaded_pdist_state: dict | None = None
        self._loaded_rank_state: tuple[dict | None, str] = (None, "")

    # ------------------------------------------------------------------ lifetime
    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        self._launcher = lifetime.own_launcher(self._launcher)  # popen: tells the ranks it starts its pid
        self._launcher_pid = lifetime.launcher_pid()  # fork/spawn children carry the launching process's value

    @override
    def setup_environment(self) -> None:
        # A rank that Lightning's launcher started dies with it (SIGKILL, even if stopped): no rank outlives the job.
        lifetime.die_with_launcher(getattr(self, "_launcher_pid", None))
        check_gloo_interface(type(self).__name__, self.num_nodes,
                             self._process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo"))
        super().setup_environment()

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        self._heartbeat = lifetime.start_heartbeat(self)  # names a stopped or dead rank if a collective fails

    @override
    def teardown(self) -> None:
        heartbeat, self._heartbeat = getattr(self, "_heartbeat", None), None
        if heartbeat is not None:
            heartbeat.stop()
        settle_comm_callbacks()  # no hook callback left on gloo's threads when the DDP wrap and its group are freed
        super().teardown()

    # ------------------------------------------------------------------ comm hooks
    def _default_comm_hook(self) -> tuple[object, Callable] | None:
        """(state, hook) registered when the user gives no ``ddp_comm_hook``."""
        if self.compression is not None:
            keys = {id(p): i for i, p in enumerate(self.model.parameters())}  # stable across bucket rebuilds
            self.compression_state = self.compression.new_state()
            self._hook_state, hook = self.compression.ddp_hook(self.compression_state, self.comm_meter, keys,
                                                               self.nonfinite != "propagate")  # fmt: skip
            return self._hook_state, hook
        self._hook_state = AllReduceState(meter=self.comm_meter, track_nonfinite=self.nonfinite != "propagate")
        return self._hook_state, allreduce_hook

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
        guard = self.nonfinite_guard
        if guard.consulted(self.precision_plugin):
            module = model if model is not None else self.lightning_module
            closure = guard.wrap(closure, lambda: self.nonfinite_ranks(optimizer), module)
        closure = self.wrap_step_closure(optimizer, closure)
        try:
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
        except SkipStep:
            output = None  # every rank skipped this step: no optimizer step, no per-step work, nothing counted
        else:
            self.after_optimizer_step(optimizer)
        guard.step_done()
        self._log_comm_bytes()
        return output

    def wrap_step_closure(self, optimizer: Optimizer, closure: Callable[[], Any]) -> Callable[[], Any]:
        """The closure the optimizer step runs (forward, backward, the non-finite check); a subclass may wrap it to act
        between the gradients and the update (decentralized SGD mixes the models there). The base returns it as is."""
        return closure

    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        """Run the algorithm's per-step work (averaging, elastic steps); nothing for plain DDP."""

    def _log_comm_bytes(self) -> None:
        module = self.lightning_module
        if log_comm_bytes(module, self.comm_meter, self._comm_log):  # only steps the loggers see pay for logging
            self.nonfinite_guard.log(module)
            log_step_metrics(module, self.diagnostics(), self._logged_diagnostics, self.progress_bar_keys)

    def diagnostics(self) -> dict[str, float]:
        """The algorithm's diagnostics since the last logged step (``pdist/...`` keys), logged now.

        Called on every rank at the same points (logged steps, the end of ``fit``), so a subclass may use a tiny
        collective here. The base returns the means of what the algorithm noted in ``self._diagnostics``.
        """
        return self._diagnostics.take()

    # ------------------------------------------------------------------ non-finite policy
    @property
    def nonfinite(self) -> str:
        """The non-finite policy: ``"raise"``, ``"skip_step"`` or ``"propagate"``."""
        return self.nonfinite_guard.policy

    def nonfinite_ranks(self, optimizer: Optimizer) -> list[int] | None:
        """``None`` when this step's gradients of ``optimizer`` are finite on every rank; else the ranks that were not.

        The same answer on every rank. Here the gradients are DDP's average (the same everywhere), so no
        collective runs while they are finite; the ranks come from the comm hook's notes, gathered on the failure
        path only (an empty list where a ``ddp_comm_hook`` from outside lightning_pdist noted nothing).
        """
        if grads_finite(optimizer_grads(optimizer)):  # one fused pass: this runs every step
            return None
        state = self._hook_state
        noted = state is not None and state.track_nonfinite
        bad = state.take_nonfinite() if noted else False
        rank, world_size = self.rank_world
        flags = one_hot_flag(bad, rank, world_size, device=self.root_device)
        if world_size > 1:
            all_reduce_sum_(flags)
        return culprit_ranks(flags) if noted else []

    def agreed_nonfinite_ranks(self, optimizer: Optimizer) -> list[int] | None:
        """:meth:`nonfinite_ranks` where each rank steps on its own gradients: agreed through one all-reduce of
        ``world_size`` flags (counted as ``nonfinite_flag``), so every rank learns which ranks' were not finite."""
        bad = not all_finite(optimizer_grads(optimizer))
        rank, world_size = self.rank_world
        flags = all_reduce_sum_(one_hot_flag(bad, rank, world_size, device=self.root_device), meter=self.comm_meter,
                                kind="nonfinite_flag")
        return culprit_ranks(flags) or None

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        # The float buffers are looked for again at each epoch's first batch (a walk of the module; a small model's
        # step feels it), and reused in between.
        self.nonfinite_guard.snapshot(self.lightning_module, self.precision_plugin, refresh=batch_idx == 0)
        if self._logged_diagnostics:
            forget_step_metrics(self.lightning_module, self._logged_diagnostics)

    def announce(self, trainer: Any) -> None:
        """At setup: the readable progress bar, and (when fitting) the resolved settings to every logger."""
        install_progress_bar_format(trainer, self.progress_bar_keys)
        if trainer.state.fn == TrainerFn.FITTING:
            log_run_settings(trainer, self.run_settings())

    def run_settings(self) -> dict[str, Any]:
        """The resolved settings every logger receives at setup (:mod:`~lightning_pdist.core.run_logging`)."""
        return resolved_settings(self, self.registered_name(self))

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if self.lightning_module is not None and self.lightning_module._trainer is not None:
            log_final_total(self.lightning_module._trainer, self.comm_meter, self._comm_log, self.diagnostics())

    # ------------------------------------------------------------------ checkpoints
    def pdist_state_dict(self) -> dict:
        """Algorithm state stored under ``checkpoint["pdist"]`` (called on every rank)."""
        return {"strategy": type(self).__name__, "comm_meter": self.comm_meter.state_dict(),
                "skipped_steps": self.nonfinite_guard.skipped.state_dict()}  # fmt: skip

    def load_pdist_state_dict(self, state: dict) -> None:
        """Restore what :meth:`pdist_state_dict` stored (called on every rank after ``setup``)."""
        self.comm_meter.load_state_dict(state.get("comm_meter", {}))
        self.nonfinite_guard.skipped.load_state_dict(state.get("skipped_steps", {}))

    def _refuse_foreign_state(self, checkpoint_path: Any) -> None:
        """Resuming ``fit`` from another algorithm's checkpoint would drop or misread its state: refuse it by name.

        Weights-only uses (validate/test/predict) and checkpoints of plain DDP (``pdist_ddp``: no algorithm state)
        are fine; so is a checkpoint without ``"pdist"`` (Lightning's own strategies).
        """
        saved = (self._loaded_pdist_state or {}).get("strategy")
        owner = type(self).__name__
        trainer = self.lightning_module._trainer if self.lightning_module is not None else None
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        if not fitting or saved in (None, owner, PdistStrategy.__name__):
            return
        raise ValueError(
            f"{owner}: {checkpoint_path} was saved by {saved}; its algorithm state "
            f"({', '.join(sorted(k for k in self._loaded_pdist_state if k not in ('strategy', 'comm_meter', 'skipped_steps'))) or 'none'}) "
            f"does not carry over to {owner}. Resume it with {saved}, or start a new run from its weights: "
            "model = YourModule.load_from_checkpoint(path); trainer.fit(model) (without ckpt_path)"
        )

    def pdist_rank_state(self) -> dict | None:
        """This rank's own state, written to its own file next to the checkpoint (None: nothing per rank).

        Must be None on every rank or on none (the decision is collective). Here: the compressor's state.
        """
        return None if self.compression_state is None else {"compression": self.compression_state.state_dict()}

    def load_pdist_rank_state(self, state: dict | None, reason: str = "") -> None:
        """Restore :meth:`pdist_rank_state`'s output (after :meth:`load_pdist_state_dict`).

        ``state`` is None when the checkpoint has no file for this rank; ``reason`` then says why.
        """
        if self.compression_state is not None and state is not None and "compression" in state:
            self.compression_state.load_state_dict(state["compression"], device=self.root_device)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Per-rank optimizer states a subclass's :meth:`load_pdist_rank_state` left in ``_pending_optimizer_states``
        (replicas whose optimizers differ) win over the main file's rank-0 states."""
        pending = getattr(self, "_pending_optimizer_states", None)
        if pending is None:
            super().load_optimizer_state_dict(checkpoint)
            return
        for optimizer, opt_state in zip(self.optimizers, pending):
            optimizer.load_state_dict(opt_state)
        self._pending_optimizer_states = None

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        # Runs on every rank (Trainer.save_checkpoint), so pdist_state_dict may use collectives.
        checkpoint["pdist"] = self.pdist_state_dict()
        rank_files.save_rank_files(self.pdist_rank_state(), filepath, checkpoint["pdist"], *self.rank_world,
                                   barrier=lambda: self.barrier("pdist_rank_files"))  # fmt: skip
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        rank, world_size = self.rank_world
        rank_files.remove(filepath, rank, world_size)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._loaded_pdist_state = checkpoint.get("pdist")
        self._refuse_foreign_state(checkpoint_path)
        self._loaded_rank_state = rank_files.load_own(checkpoint_path, self._loaded_pdist_state, *self.rank_world)
        return checkpoint

    #: At most one strategy metric shown on the progress bar besides ``comm``: ``{key: (short name, unit)}``.
    progress_bar_keys: dict[str, tuple[str, str]] = {}

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        self.announce(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            self._loaded_pdist_state = None  # validate/test/predict: the weights are all they need
            return
        self.setup_algorithm()
        self.load_resumed_state()

    @override
    def configure_ddp(self) -> None:
        """Wrap the model in DistributedDataParallel; nothing to wrap where the strategy never does
        (``wraps_in_ddp = False``: gradients go to servers, through shared memory or the gossip, or stages exchange
        activations)."""
        if self.wraps_in_ddp:
            super().configure_ddp()

    def setup_algorithm(self) -> None:
        """Create run-time algorithm state once the model is wrapped and optimizers exist."""

    def load_resumed_state(self) -> None:
        """After :meth:`setup_algorithm`, when ``fit`` resumes: the checkpoint's state, then this rank's own (or None on
        every rank when any lacks its file: :meth:`agree_on_rank_state`)."""
        if self._loaded_pdist_state is not None:
            self.load_pdist_state_dict(self._loaded_pdist_state)
            self.load_pdist_rank_state(*self.agree_on_rank_state(*self._loaded_rank_state))
        self._loaded_pdist_state, self._loaded_rank_state = None, (None, "")

    def agree_on_rank_state(self, own: dict | None, reason: str) -> tuple[dict | None, str]:
        """This rank's loaded state, or None on every rank when any rank lacks its file (one collective)."""
        return rank_files.agree_on_rank_state(own, reason, *self.rank_world)

    @property
    def rank_world(self) -> tuple[int, int]:
        """(global rank, world size) of the default process group."""
        return rank_world()

    @classmethod
    def registered_name(cls, strategy: "PdistStrategy | None" = None) -> str:
        """The registry name users pick for this configuration (error messages point at it)."""
        return cls.strategy_name

    @override
    def on_exception(self, exception: BaseException) -> None:
        lifetime.name_lost_ranks(self, exception, getattr(self, "_heartbeat", None))
        # DDPStrategy.on_exception would advise strategy='ddp_find_unused_parameters_true': plain DDP, no algorithm.
        name = self.registered_name(self)
        _augment_message(
            exception,
            pattern=".*Expected to have finished reduction in the prior iteration.*",
            new_message=(
                "It looks like your LightningModule has parameters that were not used in producing the loss (some "
                "steps leave a branch unused, or manual optimization toggles optimizers). If this is intentional, "
                f"enable the detection of unused parameters: strategy='{name}_find_unused_parameters_true' or "
                f"strategy={type(self).__name__}(..., find_unused_parameters=True). "
                f"(strategy='ddp_find_unused_parameters_true' would replace {type(self).__name__} by plain DDP.)"
            ),
        )

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        description = cls.__doc__.splitlines()[0] if cls.__doc__ else ""
        register_variants(strategy_registry, cls, cls.strategy_name, description, find_unused=cls.wraps_in_ddp)


def check_keywords(cls: type, kwargs: dict[str, Any], wraps_in_ddp: bool = True, base: type = DDPStrategy,
                   base_label: str = "DDPStrategy's") -> None:
    """``TypeError`` at construction for a keyword neither the strategy, ``base`` (a DDPStrategy) nor DDP takes.

    Unknown keywords used to reach ``DistributedDataParallel`` only after the processes had started (or, for a
    strategy that never builds it, were silently ignored). DDP's own options are refused where there is no DDP.
    Lightning's strategies and Fabric's (``base``, named ``base_label`` in the error) take the same path.
    """
    own = [n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "kwargs")]
    strategy = [n for n in inspect.signature(base.__init__).parameters if n not in ("self", "kwargs")]
    ddp_params = inspect.signature(DistributedDataParallel.__init__).parameters
    ddp = [n for n in ddp_params if n not in ("self", "module")]
    owner = cls.__name__
    for name, value in kwargs.items():
        if name in strategy or (name in ddp and wraps_in_ddp):
            continue
        if name in ddp and _is_default(value, ddp_params[name].default):
            continue  # LightningCLI passes every DDP argument at its default: nothing is lost
        if name in ddp:
            raise TypeError(f"{owner}({name}={value!r}): {owner} never wraps the model in DistributedDataParallel, "
                            f"so DDP's {name} would be ignored; leave it unset")  # fmt: skip
        close = difflib.get_close_matches(name, own + strategy + (ddp if wraps_in_ddp else []), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise TypeError(f"{owner}({name}={value!r}): unknown argument{hint} {owner} takes {', '.join(own) or 'no'} "
                        "arguments of its own" + (f", {base_label} and DistributedDataParallel's" if wraps_in_ddp
                                                  else f" and {base_label}"))  # fmt: skip


def _is_default(value: Any, default: Any) -> bool:
    return value is default or (isinstance(value, (bool, int, float, str)) and type(value) is type(default) and value == default)
