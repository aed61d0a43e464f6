"""What the user's module logs on the last pipeline stage, logged on every stage.

Only the last stage sees the network's output, so only there do the user's ``training_step`` and
``validation_step`` compute the loss and the metrics. Lightning, though, expects every rank to log
the same keys: loggers write global rank 0 (the first stage), and ``ModelCheckpoint(monitor=...)``,
``EarlyStopping`` and ``sync_dist=True`` work on every rank.

So on the last stage :class:`LogRecorder` replaces ``module.log`` during the user's calls and keeps
each call; :func:`aggregate` folds the calls of one step's micro-batches into one value per key (the
batch-size-weighted mean, or the ``reduce_fx`` the user asked for: ``sum``, ``max``, ``min``); the
records travel to the other stages of the pipeline (one ``all_gather_object`` per step, which also
carries every stage's step statistics), and
:func:`replay` logs them on every stage through the real ``LightningModule.log``.

torchmetrics ``Metric`` objects travel by attribute name: every stage logs its own copy, and since
only the last stage's copy was updated, the cross-rank sync at ``compute()`` (all ranks take part)
adds zeros from the other stages, which leaves the result exact.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor
from torchmetrics import Metric

__all__ = ["LogRecorder", "aggregate", "replay"]

_LOG_SIGNATURE = inspect.signature(LightningModule.log)
_DROPPED = ("self", "name", "value", "batch_size", "sync_dist_group", "metric_attribute")


class LogRecorder:
    """Context manager: ``module.log`` calls are recorded (not logged) while it is active."""

    def __init__(self, module: LightningModule, batch_size: int | None = None) -> None:
        self.module = module
        self.batch_size = batch_size
        self.records: list[tuple[str, Any, int | None, dict]] = []

    def __enter__(self) -> "LogRecorder":
        def log(*args: Any, **kwargs: Any) -> None:
            bound = _LOG_SIGNATURE.bind(self.module, *args, **kwargs)
            options = {k: v for k, v in bound.arguments.items() if k not in _DROPPED}
            size = bound.arguments.get("batch_size", self.batch_size)
            self.records.append((bound.arguments["name"], bound.arguments["value"], size, options))

        self.module.log = log  # instance attribute shadows the method; log_dict goes through it too
        return self

    def __exit__(self, *exc: Any) -> None:
        del self.module.log


def _metric_name(module: LightningModule, metric: Metric) -> str:
    for name, sub in module.named_modules():
        if sub is metric:
            return name
    raise ValueError(f"{type(module).__name__} logged a {type(metric).__name__} that is not one of its attributes; "
                     "under a pipeline, log Metric objects that are attributes of the module")  # fmt: skip


def aggregate(module: LightningModule, records: list[tuple[str, Any, int | None, dict]]) -> list[tuple[str, Any, int | None, dict]]:
    """One record per key: tensors and numbers folded by ``reduce_fx``; metrics by attribute name."""
    folded: dict[str, list] = {}
    for name, value, size, options in records:
        folded.setdefault(name, []).append((value, size, options))
    out = []
    for name, calls in folded.items():
        value, size, options = calls[-1]
        if isinstance(value, Metric):
            out.append((name, ("metric", _metric_name(module, value)), size, options))
            continue
        values = [float(v.detach().float().mean()) if isinstance(v, Tensor) else float(v) for v, _, _ in calls]
        sizes = [s if s is not None else 1 for _, s, _ in calls]
        reduce = str(options.get("reduce_fx", "mean")).lower()
        if reduce == "sum":
            agg = sum(values)
        elif reduce == "max":
            agg = max(values)
        elif reduce == "min":
            agg = min(values)
        else:
            agg = sum(v * s for v, s in zip(values, sizes)) / sum(sizes)
        total = sum(s for _, s, _ in calls if s is not None) if all(s is not None for _, s, _ in calls) else None
        out.append((name, agg, total, options))
    return out


def replay(module: LightningModule, records: list[tuple[str, Any, int | None, dict]]) -> None:
    """Log ``records`` through the real ``module.log`` (every stage calls it with the same records)."""
    for name, value, size, options in records:
        if isinstance(value, tuple) and value and value[0] == "metric":
            metric = module.get_submodule(value[1])
            # Stages other than the last never update their copy; mark it used so compute() does not warn.
            metric._update_count = max(metric._update_count, 1)
            module.log(name, metric, batch_size=size, **options)
        else:
            module.log(name, torch.tensor(value, dtype=torch.float32), batch_size=size, **options)
