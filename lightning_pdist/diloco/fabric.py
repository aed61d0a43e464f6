"""DiLoCo and Streaming DiLoCo as Lightning Fabric strategies: your own loop, ``optimizer.step()`` runs the rounds.

The same rounds as the Trainer strategies (:class:`~lightning_pdist.diloco.rounds.Rounds`), driven by Fabric calls:

* ``fabric.setup(model, optimizer)``: DDP broadcasts rank 0's weights; the gradient hook never communicates,
  ``broadcast_buffers`` is off and so is DDP's backward machinery (``require_backward_grad_sync = False``: the
  gradients land in ``.grad`` as without DDP); ``θ_global`` and the outer optimizer(s) are built from the
  synchronized weights.
* ``optimizer.step()`` (inner step ``t``, 1-based; every call counts, with several optimizers each one): the step on
  this rank's own gradients, then the exchanges and outer steps the schedule names.
* the output is the **global model**: evaluate it inside ``with fabric.strategy.global_weights(): ...`` and call
  ``fabric.strategy.load_global_model()`` (alias ``load_consensus()``) once training is over, so that every rank
  holds it (an exchange in flight completed first; mid-round the unfinished round's local steps are discarded).
* ``fabric.save(path, {"model": model, "optimizer": optimizer, ...})``: ``"model"`` holds the global model, each
  rank's own replica and optimizer state go to its own file, ``"pdist"`` holds the step, ``θ_global``, the outer
  optimizers' state and the drained result of an exchange in flight; ``fabric.load(path, same dict)`` after
  ``fabric.setup`` resumes exactly. Non-finite values are not checked here (no ``nonfinite=``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

from torch import Tensor
from typing_extensions import override

from lightning_pdist.core.fabric import PdistFabricStrategy
from lightning_pdist.core.hooks import AllReduceState, periodic_allreduce_hook
from lightning_pdist.diloco.fragments import ScheduleFields, StreamingSchedule
from lightning_pdist.diloco.outer import OuterConfig
from lightning_pdist.diloco.rounds import Rounds
from lightning_pdist.diloco.streaming_strategy import check_fragments

__all__ = ["DiLoCoFabricStrategy", "StreamingDiLoCoFabricStrategy"]


class DiLoCoFabricStrategy(ScheduleFields, PdistFabricStrategy):
    """DiLoCo under Fabric: ``H`` inner steps, then the outer step on ``θ_global − mean_r θ_r`` (see
    :class:`~lightning_pdist.diloco.strategy.DiLoCoStrategy` for the rule and the arguments).

    Example::

        fabric = Fabric(accelerator="cpu", devices=2, strategy=DiLoCoFabricStrategy(sync_every=50))
    """

    strategy_name = "diloco"
    one_rank_behaviour = "the outer optimizer still acts on the one replica's pseudo-gradient"

    def __init__(self, sync_every: int = 100, outer_optimizer: Any = "nesterov", outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, outer_kwargs: dict | None = None, **kwargs: Any) -> None:  # fmt: skip
        schedule = StreamingSchedule(sync_every=sync_every, owner=type(self).__name__)
        self._init_rounds(schedule, outer_optimizer, outer_lr, outer_momentum, outer_kwargs, None, kwargs)

    def _init_rounds(self, schedule: StreamingSchedule, outer_optimizer: Any, outer_lr: float, outer_momentum: float,
                     outer_kwargs: dict | None, fragments: list[list[str]] | None, kwargs: dict) -> None:  # fmt: skip
        owner = type(self).__name__
        kwargs_in = {} if outer_kwargs is None else outer_kwargs
        self.config = OuterConfig(outer_optimizer, outer_lr, outer_momentum, kwargs_in, owner=owner)
        self.schedule = schedule
        super().__init__(**kwargs)
        self.rounds = Rounds(schedule, self.config, fragments, owner)
        self.step = 0
        self._hook_state = AllReduceState(meter=self.comm_meter, allreduce=False)
        self._backup: Tensor | None = None

    # ------------------------------------------------------------------ lifecycle
    @override
    def comm_hook(self) -> tuple[object, Callable]:
        return self._hook_state, periodic_allreduce_hook

    @override
    def setup_algorithm(self) -> None:
        self.step = 0
        self.ddp_module.broadcast_buffers = False
        self.ddp_module.require_backward_grad_sync = False  # as inside no_sync() for good: DDP's backward work skipped
        self.rounds.start(self.module, self.comm_meter)

    @override
    def after_optimizer_step(self) -> None:
        self.step += 1
        self.rounds.after_step(self.step)

    # ------------------------------------------------------------------ the global model
    @contextmanager
    def global_weights(self) -> Iterator[None]:
        """Inside the block the module holds the global model; on exit this rank's replica again."""
        if self._backup is not None:
            yield
            return
        self._backup = self.rounds.local_vector()
        self.rounds.load_vector(self.rounds.global_vector())
        try:
            yield
        finally:
            self.rounds.load_vector(self._backup)
            self._backup = None

    def load_global_model(self) -> None:
        """Every rank loads the global model (exchanges in flight completed): call once training is over."""
        self.rounds.finish()
        self.rounds.load_vector(self.rounds.global_vector())

    load_consensus = load_global_model

    # ------------------------------------------------------------------ checkpoints
    @override
    def checkpoint_weights(self) -> Any:
        return super().checkpoint_weights() if self.module is None else self.global_weights()

    @override
    def pdist_state_dict(self) -> dict:
        state = super().pdist_state_dict()
        if self.module is not None:
            state.update(self.rounds.checkpoint(self.step))
        return state

    @override
    def load_pdist_state_dict(self, state: dict) -> None:
        super().load_pdist_state_dict(state)
        self.step = self.rounds.restore(state)

    @override
    def rank_state(self, objects: dict[str, Any]) -> dict | None:
        if self.module is None:
            return None
        return self.replica_objects_state(objects)

    @override
    def load_rank_state(self, state: dict | None, objects: dict[str, Any], reason: str) -> None:
        if state is None:
            return  # every rank resumes from the global model the main file holds
        self.load_replica_objects_state(state, objects)


class StreamingDiLoCoFabricStrategy(DiLoCoFabricStrategy):
    """Streaming DiLoCo under Fabric (see :class:`~lightning_pdist.diloco.streaming_strategy.StreamingDiLoCoStrategy`)."""

    strategy_name = "streaming_diloco"

    def __init__(self, sync_every: int = 100, num_fragments: int | None = 2, fragments: list[list[str]] | None = None,
                 overlap_steps: int = 0, fragment_alpha: float = 0.0, quantize: str | None = None,
                 balance: str = "layers", outer_optimizer: Any = "nesterov", outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, outer_kwargs: dict | None = None, **kwargs: Any) -> None:  # fmt: skip
        owner = type(self).__name__
        if fragments is not None and num_fragments == 2:
            num_fragments = None
        count = check_fragments(owner, fragments, num_fragments, balance)
        schedule = StreamingSchedule(sync_every=sync_every, num_fragments=count, overlap_steps=overlap_steps,
                                     fragment_alpha=fragment_alpha, quantize=quantize, balance=balance,
                                     owner=owner)  # fmt: skip
        names = None if fragments is None else [list(f) for f in fragments]
        self._init_rounds(schedule, outer_optimizer, outer_lr, outer_momentum, outer_kwargs, names, kwargs)
        self.fragments = names
