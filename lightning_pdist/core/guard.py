"""The strategies' side of the non-finite policy: when to check, how to skip, what to log.

The policy itself (its three values, their meaning, the messages) is :mod:`lightning_pdist.core.nonfinite`.
Each strategy holds one :class:`NonFiniteGuard` and decides *what* it checks and how its ranks agree; the guard
does the rest the same way everywhere:

* :meth:`NonFiniteGuard.wrap` runs the optimizer's closure (forward, backward), then the strategy's check; a
  non-finite answer raises :class:`FloatingPointError` (``"raise"``) or :class:`SkipStep` (``"skip_step"``) from
  inside the closure. Torch optimizers call the closure before they change anything, so leaving
  ``optimizer.step`` through an exception leaves the parameters and the optimizer state untouched; the strategy
  catches :class:`SkipStep` in its ``optimizer_step`` and goes on to the next batch.
* :meth:`NonFiniteGuard.snapshot` (at the start of a batch) and :meth:`NonFiniteGuard.act` restore the floating-point
  buffers (BatchNorm statistics) that the forward of a stopped or skipped step already updated, so that neither
  leaves a trace, not even in a checkpoint written from ``on_exception``.
* :meth:`NonFiniteGuard.log` logs ``pdist/skipped_steps`` after every step under ``"skip_step"``.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_pdist.core.nonfinite import (
    BufferSnapshot,
    SkippedSteps,
    check_nonfinite_policy,
    nonfinite_error,
    skip_warning,
)

__all__ = ["NonFiniteGuard", "SkipStep", "float_buffers", "global_step", "optimizer_grads"]


class SkipStep(Exception):
    """Raised inside the optimizer's closure when every rank skips this step (``nonfinite='skip_step'``)."""


def optimizer_grads(optimizer: Any) -> list[Tensor]:
    """The gradients of ``optimizer``'s parameters that exist."""
    return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


def float_buffers(module: Any) -> list[Tensor]:
    """``module``'s floating-point buffers (BatchNorm running statistics), in ``module.buffers()``'s order."""
    # The walk ``module.buffers()`` does, keyed by id: it keeps a set of the modules it visited, and hashing some
    # (a torchmetrics Metric hashes its state) made this per-batch call cost tens of microseconds.
    out: list[Tensor] = []
    seen: set[int] = set()
    stack = [module]
    while stack:
        mod = stack.pop()
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        for buffer in mod._buffers.values():
            if buffer is not None and id(buffer) not in seen and torch.is_floating_point(buffer):
                seen.add(id(buffer))
                out.append(buffer)
        stack.extend(child for child in reversed(mod._modules.values()) if child is not None)
    return out


def global_step(module: Any) -> int:
    """Lightning's ``trainer.global_step`` (the 0-based index of the step being taken); 0 outside a Trainer."""
    trainer = getattr(module, "_trainer", None) if module is not None else None
    return trainer.global_step if trainer is not None else 0


class NonFiniteGuard:
    """One strategy's policy, skip count and buffer snapshot.

    Args:
        policy: ``"raise"``, ``"skip_step"`` or ``"propagate"`` (validated here, naming ``owner``).
        owner: the strategy's class name, for messages.
    """

    def __init__(self, policy: str, owner: str) -> None:
        self.policy = check_nonfinite_policy(policy, owner)
        self.owner = owner
        self.skipped = SkippedSteps()
        self._snapshot = BufferSnapshot()
        self._buffers: tuple[Any, list[Tensor]] | None = None  # (module, its float buffers) as last found

    def consulted(self, precision_plugin: Any = None) -> bool:
        """Whether gradients are checked: not under ``"propagate"``, nor under a GradScaler (its overflow rule decides)."""
        return self.policy != "propagate" and getattr(precision_plugin, "scaler", None) is None

    def wrap(self, closure: Callable[[], Any], check: Callable[[], list[int] | None], module: Any,
             before: str = "the optimizer step", skipped: str = "that optimizer step") -> Callable[[], Any]:  # fmt: skip
        """``closure`` followed by ``check()`` (``None``: finite everywhere; else the ranks that were not).

        ``check`` must give the same answer on every rank. A closure that returns ``None`` under automatic
        optimization ran no backward (``training_step`` returned ``None``): nothing is checked then.
        """

        def guarded() -> Any:
            result = closure()
            if result is None and getattr(module, "automatic_optimization", False):
                return result
            ranks = check()
            if ranks is not None:
                self.act("gradients", ranks, module, before=before, skipped=skipped)
            return result

        return guarded

    def act(self, what: str, ranks: list[int], module: Any, before: str, skipped: str, scope: str = "every rank") -> None:
        """Every rank, at the same step: raise (``"raise"``), or restore the buffers, count, warn once and skip.

        ``scope`` says who acts: ``"every rank"`` (or ``"every worker"``: the ranks agreed, so rank 0 warns for all)
        or one rank that acts alone (it warns itself), such as an asynchronous parameter-server worker.

        Raises:
            FloatingPointError: under ``"raise"``, naming ``ranks`` and the global step.
            SkipStep: under ``"skip_step"``.
        """
        step = global_step(module)
        if module is not None:
            self._snapshot.restore_(self._float_buffers(module, refresh=False))
        if self.policy == "raise":
            raise nonfinite_error(self.owner, what, ranks, step, before, scope=scope)
        if self.skipped.record(step):
            message = skip_warning(self.owner, what, ranks, step, skipped, scope)
            rank_zero_warn(message) if scope.startswith("every") else warnings.warn(message, stacklevel=2)
        raise SkipStep

    def snapshot(self, module: Any, precision_plugin: Any = None, refresh: bool = True) -> None:
        """Keep the float buffers as they are before this batch's forward (kept over an accumulation window).

        ``refresh=False`` reuses the buffers found at the last refresh for this module instead of walking the
        module again (tens of microseconds a batch on a small model); buffers replaced or registered since then
        are found at the next refresh. :class:`~lightning_pdist.core.strategy.PdistStrategy` refreshes at each
        epoch's first batch (lazy modules fill their buffers in place, so they are found).
        """
        if self.consulted(precision_plugin) and module is not None:
            self._snapshot.take(self._float_buffers(module, refresh))

    def _float_buffers(self, module: Any, refresh: bool) -> list[Tensor]:
        if refresh or self._buffers is None or self._buffers[0] is not module:
            self._buffers = (module, float_buffers(module))
        return self._buffers[1]

    def step_done(self) -> None:
        """The step the snapshot guarded is over (taken or skipped)."""
        self._snapshot.drop()

    def log(self, module: Any) -> None:
        """Log ``pdist/skipped_steps`` (cumulative) under ``"skip_step"``, where Lightning allows logging."""
        if self.policy != "skip_step" or module is None or module._trainer is None or module._current_fx_name is None:
            return
        module.log("pdist/skipped_steps", float(self.skipped.count), on_step=True, on_epoch=False)
