"""What every strategy tells the loggers: its resolved settings at setup, and comm bytes that are never sampled.

**Settings.** At setup each strategy hands every logger (W&B, CSV, TensorBoard: ``logger.log_hyperparams``, the
normal Lightning path) ``{"pdist": {...}}``: its registered name, class, world size, nodes, processes per node, and
every constructor argument with its *resolved* value (BMUF's ``block_momentum=None`` becomes ``1 - 1/N``, EASGD's
``alpha=None`` becomes ``0.9/N``). :func:`resolved_settings` finds each argument on the strategy, its ``config`` or
its rule's ``config`` (the averaging family) or its ``schedule``, in that order, so a property that resolves a default wins over the raw argument.

**Comm bytes.** Loggers receive a step's metrics only every ``log_every_n_steps`` steps. ``pdist/comm_bytes`` is
therefore the bytes sent *since the previous logged step* (the sum, never a sample), and ``pdist/comm_bytes_total``
the running total; at the end of ``fit`` the bytes since the last logged step and the total are written once more,
so the logged ``pdist/comm_bytes`` add up to the last point of the total's series, the run's total, whatever
``log_every_n_steps`` is.

**Only logged steps pay for logging.** ``LightningModule.log`` costs about as much as a small model's optimizer step
in Python, so the ``pdist/*`` keys are logged only on the steps whose metrics reach the loggers
(``should_update_logs``); between them the strategies only count. ``callback_metrics`` and the progress bar
therefore show the figures of the last logged step (every step with ``log_every_n_steps=1``).

**Diagnostics.** Algorithm diagnostics (vote statistics, replica divergence, staleness) follow the same rule: what
happens between logged steps is summed or averaged (:class:`IntervalMeans`) and logged once at the next logged
step; a key with nothing new in an interval is not logged then, and is kept from reaching the loggers again with
its old value (:func:`forget_step_metrics`); what is left after the last logged step goes to the loggers at the
end of ``fit`` with the final total.

**Progress bar.** Raw byte counts read badly (``76712.0``) and crowd out ``val/acc``: the bar shows one short,
unit-carrying entry, ``comm=11.6MB`` (the total), instead of the ``pdist/*`` keys, plus at most one strategy key a
strategy names in ``progress_bar_keys`` (e.g. the parameter server's wait, ``wait=0.12s``).
"""

from __future__ import annotations

import inspect
from types import MethodType
from typing import Any

import torch

from lightning_pdist.core.accounting import CommMeter

__all__ = ["CommLogState", "IntervalMeans", "forget_step_metrics", "human_bytes", "install_progress_bar_format",
           "log_comm_bytes", "log_final_total", "log_histogram", "log_run_settings", "log_step_metrics",
           "resolved_settings"]  # fmt: skip

_SIMPLE = (bool, int, float, str, type(None))


def resolved_settings(strategy: Any, name: str) -> dict[str, Any]:
    """The settings dict described in the module docstring (called once the processes exist)."""
    out: dict[str, Any] = {"strategy": name, "class": type(strategy).__name__,
                           "world_size": getattr(strategy, "world_size", 1), "num_nodes": getattr(strategy, "num_nodes", 1),
                           "processes_per_node": getattr(strategy, "num_processes", 1)}  # fmt: skip
    params = [p for p in inspect.signature(type(strategy).__init__).parameters.values()
              if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]  # fmt: skip
    rule = getattr(strategy, "rule", None)
    sources = [strategy, getattr(strategy, "config", None), getattr(rule, "config", None),
               getattr(strategy, "schedule", None)]
    for param in params:
        for source in sources:
            if source is None:
                continue
            try:
                value = getattr(source, param.name)
            except Exception:  # a property that cannot resolve yet
                continue
            if not callable(value):
                out[param.name] = _loggable(value)
                break
    return out


def _loggable(value: Any) -> Any:
    if isinstance(value, _SIMPLE):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, _SIMPLE) for v in value):
        return list(value)
    if isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, _SIMPLE) for k, v in value.items()):
        return dict(value)
    return repr(value)


def log_run_settings(trainer: Any, settings: dict[str, Any]) -> None:
    """``log_hyperparams({"pdist": settings})`` on every logger of ``trainer`` (loggers write on rank 0 only)."""
    for logger in getattr(trainer, "loggers", None) or []:
        logger.log_hyperparams({"pdist": settings})


class CommLogState:
    """Which bytes the loggers have seen: the total at the end of the last logged batch."""

    def __init__(self) -> None:
        self.logged_total = 0  # the total when the last logged batch ended
        self.batch: int | None = None  # the loop's batch counter when we were last called
        self.batch_logged = False  # whether that batch is one the loggers receive
        self.total_at_call = 0


def log_comm_bytes(module: Any, meter: CommMeter, state: CommLogState | None = None) -> bool:
    """Close the meter's step; on a logged step, log ``pdist/comm_bytes`` (bytes since the last logged step) and
    the total.

    Returns whether this step's metrics reach the loggers (the strategy then logs its other ``pdist/*`` keys too);
    the same on every rank. Without ``state`` the step's own bytes are logged on every step (kept for callers that
    want every step's figure).
    """
    step_bytes = meter.end_step()
    # `log` is legal only inside a hook the Trainer is running (optimizer_step/training_step).
    if module is None or module._trainer is None or module._current_fx_name is None:
        return False
    value = step_bytes
    if state is not None:
        trainer = module._trainer
        loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        batch = getattr(loop, "_batches_that_stepped", None)
        if batch != state.batch:  # a new batch (several optimizers step within one batch)
            if state.batch_logged:
                state.logged_total = state.total_at_call
            state.batch = batch
        connector = getattr(trainer, "_logger_connector", None)
        state.batch_logged = bool(getattr(connector, "should_update_logs", True))
        state.total_at_call = meter.total_bytes
        if not state.batch_logged:
            return False  # the loggers would not see it: LightningModule.log is the costly part of a small step
        value = meter.total_bytes - state.logged_total
    module.log("pdist/comm_bytes", float(value), on_step=True, on_epoch=False, prog_bar=True)
    module.log("pdist/comm_bytes_total", float(meter.total_bytes), on_step=True, on_epoch=False, prog_bar=True)
    return True


class IntervalMeans:
    """Diagnostics noted between logged steps, logged once at the next logged step as their (weighted) mean.

    ``note(key, value, weight)`` adds ``value`` with ``weight``; :meth:`take` returns ``{key: Σ w·v / Σ w}`` of the
    keys noted since the last call and starts over. A sum is a mean with its count as the weight's inverse: note
    ``(total, 1)`` instead. Keys with nothing noted are absent from :meth:`take`.
    """

    def __init__(self) -> None:
        self._sums: dict[str, float] = {}
        self._weights: dict[str, float] = {}

    def note(self, key: str, value: float, weight: float = 1.0) -> None:
        self._sums[key] = self._sums.get(key, 0.0) + float(value) * weight
        self._weights[key] = self._weights.get(key, 0.0) + weight

    def __bool__(self) -> bool:
        return bool(self._sums)

    def take(self) -> dict[str, float]:
        out = {k: self._sums[k] / self._weights[k] for k in self._sums if self._weights[k]}
        self._sums, self._weights = {}, {}
        return out


def log_step_metrics(module: Any, metrics: dict[str, float], logged: set[str] | None = None,
                     prog_bar: dict[str, Any] | set[str] = frozenset()) -> None:  # fmt: skip
    """``module.log`` each of ``metrics`` for this step only (no epoch mean; on the bar if named in ``prog_bar``);
    note the names in ``logged`` so that :func:`forget_step_metrics` can keep them from being sent again."""
    for name, value in metrics.items():
        module.log(name, float(value), on_step=True, on_epoch=False, prog_bar=name in prog_bar)
    if logged is not None:
        logged.update(metrics)


def log_histogram(trainer: Any, key: str, counts: list[int] | list[float]) -> None:
    """Counts of the integer bins ``0 … len(counts) − 1`` to every logger of ``trainer``, on global rank 0.

    As a histogram where the logger has one (W&B: ``wandb.Histogram``; TensorBoard: ``add_histogram_raw``), as the
    scalars ``key/{bin}`` (bins with a count) elsewhere (CSV and the rest). Called at most once per logged step.
    """
    if not getattr(trainer, "is_global_zero", True):
        return
    from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

    step = getattr(trainer, "global_step", 0)
    for logger in getattr(trainer, "loggers", None) or []:
        if isinstance(logger, WandbLogger):
            import wandb

            edges = [b - 0.5 for b in range(len(counts) + 1)]  # bin b is [b - 0.5, b + 0.5)
            logger.log_metrics({key: wandb.Histogram(np_histogram=(list(counts), edges))}, step=step)
        elif isinstance(logger, TensorBoardLogger):
            used = [b for b, c in enumerate(counts) if c]
            if used:
                total = float(sum(counts))
                logger.experiment.add_histogram_raw(
                    key, min=float(used[0]), max=float(used[-1]), num=total,
                    sum=float(sum(b * c for b, c in enumerate(counts))),
                    sum_squares=float(sum(b * b * c for b, c in enumerate(counts))),
                    bucket_limits=[b + 0.5 for b in range(len(counts))], bucket_counts=[float(c) for c in counts],
                    global_step=step,
                )  # fmt: skip
        else:
            logger.log_metrics({f"{key}/{b}": float(c) for b, c in enumerate(counts) if c}, step=step)


def forget_step_metrics(module: Any, names: set[str]) -> None:
    """Keep step metrics logged on an earlier step from reaching the loggers again (call at the next batch's start).

    Lightning sends every step metric logged so far in the epoch at each logged step, with its last value; a
    diagnostic with nothing new in an interval (no synchronization, no push) must not reappear with an old value.
    ``callback_metrics`` keeps the last value.
    """
    trainer = getattr(module, "_trainer", None) if module is not None else None
    results = getattr(trainer, "_results", None)
    if results is not None:
        for key, metric in results.items():
            if key.split(".", 1)[-1] in names:
                metric.has_reset = True  # Lightning's own mark for "not logged since the last reset": skipped
    names.clear()


def log_final_total(trainer: Any, meter: CommMeter, state: CommLogState | None = None,
                    extra: dict[str, float] | None = None) -> None:  # fmt: skip
    """At the end of ``fit``: the bytes since the last logged step (if any) and the run's total, to every logger.

    With ``state``, the logged ``pdist/comm_bytes`` then add up to the logged total exactly. ``extra``: the
    diagnostics noted since the last logged step, sent with them.
    """
    metrics = {"pdist/comm_bytes_total": float(meter.total_bytes), **(extra or {})}
    if state is not None:
        if state.batch_logged:
            state.logged_total = state.total_at_call
        tail = meter.total_bytes - state.logged_total
        if tail:
            metrics["pdist/comm_bytes"] = float(tail)
        state.logged_total = meter.total_bytes
    for logger in getattr(trainer, "loggers", None) or []:
        logger.log_metrics(metrics, step=trainer.global_step)
    # trainer.callback_metrics["pdist/comm_bytes_total"] is the run's total after fit, on every rank, even when no
    # step was a logged one (a short run under log_every_n_steps)
    callback_metrics = getattr(trainer, "callback_metrics", None)
    if isinstance(callback_metrics, dict):
        callback_metrics["pdist/comm_bytes_total"] = torch.tensor(float(meter.total_bytes))


def human_bytes(n: float) -> str:
    """``11.6MB``: decimal units (kB, MB, GB), three significant digits."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{int(n)}B"


def install_progress_bar_format(trainer: Any, keys: dict[str, tuple[str, str]] | None = None) -> None:
    """Make the trainer's progress bar show ``comm=<total>`` instead of the ``pdist/*`` entries.

    ``keys`` maps at most one strategy key to ``(short name, unit)``, e.g. ``{"pdist/ps/wait_s": ("wait", "s")}``.
    The bar's own ``get_metrics`` (Lightning's documented place to format the bar) is wrapped on this instance only.
    """
    bar = getattr(trainer, "progress_bar_callback", None)
    if bar is None or getattr(bar, "_pdist_formatted", False):
        return
    keys = dict(keys or {})
    if len(keys) > 1:
        raise ValueError(f"install_progress_bar_format(keys={keys!r}): at most one strategy key on the bar")
    original = bar.get_metrics

    def get_metrics(self: Any, trainer: Any, pl_module: Any) -> dict[str, Any]:
        metrics = dict(original(trainer, pl_module))
        total = metrics.get("pdist/comm_bytes_total")
        for key in [k for k in metrics if k.startswith("pdist/")]:
            value = metrics.pop(key)
            if key in keys:
                short, unit = keys[key]
                metrics[short] = f"{float(value):.3g}{unit}"
        if total is not None:
            metrics["comm"] = human_bytes(float(total))
        return metrics

    bar.get_metrics = MethodType(get_metrics, bar)
    bar._pdist_formatted = True
