"""The validated settings of :class:`~lightning_pdist.pipeline.strategy.PipelineStrategy`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lightning_pdist.core.config import ConfigErrors, is_int
from lightning_pdist.core.nonfinite import check_nonfinite_policy
from lightning_pdist.pipeline.partition import BALANCES
from lightning_pdist.pipeline.schedule import SPECS, ScheduleSpec, schedule_spec

__all__ = ["CONDITIONINGS", "PipelineConfig"]

CONDITIONINGS = (None, "labels")  # synthetic_conditioning: DNI, cDNI


@dataclass(frozen=True, kw_only=True)
class PipelineConfig(ConfigErrors):
    """The validated settings of a :class:`PipelineStrategy` (see its docstring); ``spec`` is the schedule's meaning."""

    num_stages: int | None = None
    schedule: str = "1f1b"
    num_microbatches: int | None = None
    balance: str | None = None
    split_points: tuple[str, ...] | None = None
    network: str | None = None
    vertical_sync: bool = False
    weight_stashing: bool = True
    max_message_bytes: int = 1 << 31
    nonfinite: str = "raise"
    synthetic_gradients: bool = False
    synthetic_module: Callable[..., Any] | None = None
    synthetic_optimizer: Callable[..., Any] | None = None
    synthetic_normalize: bool = True
    synthetic_conditioning: str | None = None
    synthetic_num_classes: int | None = None
    post_ahead: bool = False
    owner: str = "PipelineStrategy"
    spec: ScheduleSpec = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for arg in ("num_stages", "num_microbatches"):
            value = getattr(self, arg)
            if value is not None and not is_int(value):
                self._fail(arg, f"{arg} must be an int or None", TypeError)
            if value is not None and value < 1:
                self._fail(arg, f"{arg} must be >= 1")
        object.__setattr__(self, "spec", schedule_spec(self.schedule, self.owner))
        self._check_synthetic()
        if self.num_stages and self.num_microbatches:
            self._check_microbatches(self.num_stages, self.num_microbatches)
        if self.balance is not None and self.balance not in BALANCES:
            self._fail("balance", f"balance must be None or one of {', '.join(map(repr, BALANCES))}")
        if self.split_points is not None:
            if self.balance is not None:
                self._fail("balance", "give balance or split_points, not both")
            if not all(isinstance(p, str) for p in self.split_points):
                self._fail("split_points", "split_points must be a list of layer names", TypeError)
            if self.num_stages is not None and len(self.split_points) != self.num_stages - 1:
                self._fail("split_points", f"{self.num_stages} stages need {self.num_stages - 1} split points")
        if self.vertical_sync and self.spec.vertical_sync_refusal():
            self._fail("vertical_sync", self.spec.vertical_sync_refusal())
        if not self.weight_stashing and not self.spec.optional_stashing:
            why = ("either never updates mid-flight (flushed) or needs its two versions (2bw)" if self.spec.stashes else
                   "with synthetic_gradients=True keeps no weight stash to turn off (each backward follows its forward)"
                   if self.spec.synthetic else
                   f"keeps no weight stash to turn off (its backward runs on the {self.spec.backward_on} weights)")  # fmt: skip
            self._fail("weight_stashing", f"turning stashing off is PipeDream's ablation; schedule {self.schedule!r} {why}")
        if not is_int(self.max_message_bytes) or self.max_message_bytes < 1:
            self._fail("max_message_bytes", "max_message_bytes must be a positive int")
        if not isinstance(self.post_ahead, bool):
            self._fail("post_ahead", "post_ahead must be True or False", TypeError)
        check_nonfinite_policy(self.nonfinite, self.owner)
        if self.nonfinite == "skip_step" and not self.spec.flushed:
            self._fail("nonfinite", f"skip_step needs every rank to agree before an update, which schedule="
                                    f"{self.schedule!r} never waits for (its stages update at different moments); use "
                                    "schedule='gpipe' or '1f1b', or nonfinite='raise'")  # fmt: skip

    def _check_synthetic(self) -> None:
        """``synthetic_gradients=True`` turns the schedule's timing into ``dni`` (the spec every layer asks)."""
        if not isinstance(self.synthetic_gradients, bool):
            self._fail("synthetic_gradients", "synthetic_gradients must be True or False", TypeError)
        for arg in ("synthetic_module", "synthetic_optimizer"):
            value = getattr(self, arg)
            if value is not None and not callable(value):
                self._fail(arg, f"{arg} must be a factory (a callable) or None", TypeError)
            if value is not None and not (self.synthetic_gradients or self.spec.synthetic):
                self._fail(arg, f"{arg} configures the synthetic-gradient modules, which only synthetic_gradients=True has")
        if not isinstance(self.synthetic_normalize, bool):
            self._fail("synthetic_normalize", "synthetic_normalize must be True or False", TypeError)
        if not self.synthetic_normalize and not (self.synthetic_gradients or self.spec.synthetic):
            self._fail("synthetic_normalize", "synthetic_normalize configures the synthetic-gradient modules, which only "
                                              "synthetic_gradients=True has")  # fmt: skip
        if self.synthetic_conditioning not in CONDITIONINGS:
            self._fail("synthetic_conditioning", "synthetic_conditioning must be None (DNI) or 'labels' (cDNI: the "
                                                 "synthetic modules also see the one-hot labels)")  # fmt: skip
        if self.synthetic_conditioning is not None and not (self.synthetic_gradients or self.spec.synthetic):
            self._fail("synthetic_conditioning", "synthetic_conditioning configures the synthetic-gradient modules, which "
                                                 "only synthetic_gradients=True has")  # fmt: skip
        if self.synthetic_num_classes is not None:
            if not is_int(self.synthetic_num_classes):
                self._fail("synthetic_num_classes", "synthetic_num_classes must be an int or None", TypeError)
            if self.synthetic_num_classes < 2:
                self._fail("synthetic_num_classes", "synthetic_num_classes must be >= 2 (the labels' one-hot width)")
            if self.synthetic_conditioning != "labels":
                self._fail("synthetic_num_classes", "synthetic_num_classes is the one-hot width of "
                                                    "synthetic_conditioning='labels', which is not set")  # fmt: skip
        if self.synthetic_gradients:
            if self.spec.synthetic_refusal():
                self._fail("synthetic_gradients", f"schedule={self.schedule!r}: {self.spec.synthetic_refusal()}")
            object.__setattr__(self, "spec", next(s for s in SPECS.values() if s.synthetic))

    def _check_microbatches(self, num_stages: int, num_microbatches: int) -> None:
        """``m >= K`` where the schedule needs it (at construction when both are given, else once the world is known)."""
        if self.spec.needs_microbatches_ge_stages and num_microbatches < num_stages:
            raise ValueError(f"{self.owner}(num_microbatches={num_microbatches}): schedule={self.schedule!r} needs "
                             f"num_microbatches >= num_stages ({num_stages}): its warm-up keeps that many in flight "
                             "(use 'gpipe' for fewer)")  # fmt: skip

    def stages_for(self, world_size: int) -> int:
        return self.num_stages if self.num_stages is not None else world_size

    def microbatches_for(self, world_size: int) -> int:
        return self.num_microbatches if self.num_microbatches is not None else 2 * self.stages_for(world_size)

    def check_world_size(self, world_size: int) -> None:
        K = self.stages_for(world_size)
        if world_size % K:
            raise ValueError(
                f"{self.owner}(num_stages={K}): world_size {world_size} is not a multiple of num_stages "
                f"(world_size = num_stages x replicas; with {world_size} processes use a divisor of {world_size})"
            )
        self._check_microbatches(K, self.microbatches_for(world_size))
        if self.spec.synthetic and world_size != K:
            raise ValueError(f"{self.owner}(synthetic_gradients=True): {world_size} processes for {K} stages make "
                             f"{world_size // K} replicas per stage; the replicas' synthetic-gradient modules are not "
                             "averaged, so synthetic gradients need num_stages == world_size (one replica)")  # fmt: skip
        if self.split_points is not None and len(self.split_points) != K - 1:
            raise ValueError(f"{self.owner}(split_points={list(self.split_points)!r}): {K} stages need {K - 1} split points")
