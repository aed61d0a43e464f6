"""Run one strategy's column of the matrix in two real processes, every module in turn.

The two ranks are started once per strategy (forked, with ``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``
set, as torchrun would: Lightning then launches nothing) and run every cell one after another,
as a user's script with several Trainers would. A cell on every rank:

    fit (2 epochs × 4 batches, checkpoint after each epoch)  →  validate  →  test  →  predict
    →  a fresh Trainer validates the last checkpoint
    →  a fresh Trainer resumes from the epoch-0 checkpoint (mid-period) and finishes the run

and writes what it saw (status, the stage an error came from, logged metrics, predictions) to
``{root}/{strategy}__{module}.rank{r}.json`` and its final weights to ``*.pt`` next to it, which the
test compares across ranks and runs. Each cell's file is written as soon as the cell ends, so a
hang names the cell it happened in. After a cell that failed (a refusal included) the ranks exit, and
the test starts a fresh pair for the remaining cells: one rank failing alone can break the process
group, and the next cell must not inherit that.
"""

from __future__ import annotations

import json
import math
import os
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from tests.conformance import strategies
from tests.conformance.modules import MODULES, STEPS_PER_EPOCH, WORLD

TRAINER = dict(
    accelerator="cpu", devices=WORLD, max_epochs=2, limit_train_batches=STEPS_PER_EPOCH, limit_val_batches=2,
    limit_test_batches=2, limit_predict_batches=2, logger=False, enable_progress_bar=False,
    enable_model_summary=False, num_sanity_val_steps=0,
)  # fmt: skip


def cell_name(strategy: str, module: str) -> str:
    return f"{strategy}__{module}"


def _trainer(strategy: str, module: str, **kwargs: Any) -> Trainer:
    spec = MODULES[module]
    settings = {k: v() if callable(v) else v for k, v in spec.trainer.items()}
    return Trainer(**TRAINER, **settings, strategy=strategies.make(strategy, spec.unused), **kwargs)


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full tensors (tensor-parallel shards are gathered: a collective, so every rank calls this at the same point)."""
    full = lambda v: v.full_tensor() if isinstance(v, DTensor) else v  # noqa: E731
    return {k: full(v).detach().cpu().clone() for k, v in module.state_dict().items()}


def _numbers(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (torch.Tensor, float, int))}


class Outputs(Callback):
    """The scalar tensors ``training_step``/``validation_step``/``test_step`` return (BoringModel logs nothing)."""

    def __init__(self) -> None:
        self.values: dict[str, list[float]] = {"train": [], "validate": [], "test": []}

    def _add(self, stage: str, outputs: Any) -> None:
        items = outputs.values() if isinstance(outputs, dict) else [outputs]
        self.values[stage] += [float(v) for v in items if isinstance(v, torch.Tensor) and v.numel() == 1]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._add("train", outputs)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._add("validate", outputs)

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._add("test", outputs)


class BatchStarted(Callback):
    """Whether the first fit began a training batch: a refusal at setup comes before that, a crash in a step after."""

    def __init__(self) -> None:
        self.started = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.started = True


def run_cell(strategy: str, module: str, root: Path, rank: int) -> dict:
    spec, cell = MODULES[module], root / cell_name(strategy, module)
    result: dict[str, Any] = {"status": "ok", "stage": "fit", "global_step": 0}
    trainer, started = None, BatchStarted()
    try:
        seed_everything(0, verbose=False)
        model = spec.make()
        checkpoints = ModelCheckpoint(dirpath=cell, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
        outputs = Outputs()
        trainer = _trainer(strategy, module, callbacks=[checkpoints, outputs, started])
        trainer.fit(model)
        result["fit_metrics"] = _numbers(trainer.callback_metrics)
        result["outputs"] = outputs.values
        torch.save(_weights(model), f"{cell}.fit.rank{rank}.pt")
        result["stage"] = "validate"
        result["validate"] = [_numbers(d) for d in trainer.validate(model, verbose=False)]
        result["stage"] = "test"
        result["test"] = [_numbers(d) for d in trainer.test(model, verbose=False)]
        result["stage"] = "predict"
        predictions = trainer.predict(model)
        result["predict"] = [float(torch.as_tensor(p).float().abs().sum()) for p in predictions]
        result["stage"] = "validate_checkpoint"
        seed_everything(0, verbose=False)
        result["validate_checkpoint"] = [_numbers(d) for d in _trainer(strategy, module).validate(
            spec.make(), ckpt_path=str(cell / "epoch=1.ckpt"), verbose=False)]  # fmt: skip
        result["stage"] = "resume"
        seed_everything(0, verbose=False)
        resumed = spec.make()
        trainer = _trainer(strategy, module, enable_checkpointing=False)
        trainer.fit(resumed, ckpt_path=str(cell / "epoch=0.ckpt"))
        torch.save(_weights(resumed), f"{cell}.resumed.rank{rank}.pt")
        result["stage"] = "done"
    except Exception as error:  # noqa: BLE001 - every failure is reported, the next cell still runs
        result.update(status="error", message=f"{type(error).__name__}: {error}", traceback=traceback.format_exc())
        result["global_step"] = trainer.global_step if trainer is not None else 0
        result["batch_started"] = started.started
    return result


def worker(rank: int, world_size: int, strategy: str, modules: list[str], root: str) -> None:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", MASTER_ADDR="127.0.0.1")  # MASTER_PORT: held by the test
    os.environ.pop("WORLD_SIZE", None)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    for module in modules:
        result = run_cell(strategy, module, Path(root), rank)
        Path(root, f"{cell_name(strategy, module)}.rank{rank}.json").write_text(json.dumps(result, default=str))
        if result["status"] != "ok":
            return  # the process group may be broken (a rank failed alone): the next cells get fresh processes


def finite(values: list[float] | dict[str, float]) -> bool:
    items = values.values() if isinstance(values, dict) else values
    return all(math.isfinite(v) for v in items)
