"""When periodic-averaging algorithms communicate: warm-up, then every ``period`` steps.

``step`` is the 1-based count of optimizer steps taken (the step that has just finished).

* Steps ``1 .. warmup_steps`` average *gradients* before the optimizer step: exactly
  synchronous data parallelism (Lightning's ``"ddp"``). Lin et al. (2020), *Don't Use Large
  Mini-Batches, Use Local SGD*, call this post-local SGD: local SGD only after the first phase.
* After warm-up each rank steps on its own gradient, and the algorithm synchronizes the
  replicas after step ``t`` whenever ``(t - warmup_steps) % period == 0``.

This is the rule of PyTorch's ``PeriodicModelAverager`` (``step >= warmup_steps and
(step - warmup_steps) % period == 0``), with the difference that we count steps from 1 and
so never synchronize on the last warm-up step, which was already synchronous.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OneShotSchedule", "PeriodicSchedule"]


@dataclass(frozen=True)
class PeriodicSchedule:
    """Warm-up length and period of a periodic-averaging algorithm.

    Args:
        period: local steps between synchronizations (``τ`` in the papers); ``1`` synchronizes
            after every step.
        warmup_steps: leading optimizer steps that average gradients every step.
        owner: name used in error messages (the strategy class).
    """

    period: int
    warmup_steps: int = 0
    owner: str = "PeriodicSchedule"

    def __post_init__(self) -> None:
        if isinstance(self.period, bool) or not isinstance(self.period, int):
            raise TypeError(f"{self.owner}(period={self.period!r}): period must be an int")
        if self.period < 1:
            raise ValueError(f"{self.owner}(period={self.period}): period must be >= 1")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int):
            raise TypeError(f"{self.owner}(warmup_steps={self.warmup_steps!r}): warmup_steps must be an int")
        if self.warmup_steps < 0:
            raise ValueError(f"{self.owner}(warmup_steps={self.warmup_steps}): warmup_steps must be >= 0")

    def averages_gradients(self, step: int) -> bool:
        """Whether optimizer step ``step`` (1-based) all-reduces gradients (warm-up)."""
        return step <= self.warmup_steps

    def syncs_after(self, step: int) -> bool:
        """Whether the replicas are synchronized right after optimizer step ``step`` (1-based)."""
        return step > self.warmup_steps and (step - self.warmup_steps) % self.period == 0


@dataclass(frozen=True)
class OneShotSchedule(PeriodicSchedule):
    """No warm-up and no synchronization while training: the ranks average once, at the end (SimuParallelSGD)."""

    period: int = 1

    def averages_gradients(self, step: int) -> bool:
        return False

    def syncs_after(self, step: int) -> bool:
        return False
