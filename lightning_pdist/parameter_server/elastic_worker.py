"""The worker side of ``ParameterServerStrategy(mode="easgd")``: local steps, and an elastic exchange every ``τ``.

In this mode the module's own optimizer steps on the worker (SGD: asynchronous EASGD; SGD with
``momentum=δ, nesterov=True``: EAMSGD), and the servers hold the center ``x̃`` instead of running an optimizer.
A *local step* is a training batch in which at least one optimizer stepped (with several optimizers the batch may
step another one yet, so the step is closed at the next batch, before validation, at a checkpoint or at the end of
``fit``). After every ``τ``-th local step the worker sends its ``x_i``, shard by shard, and subtracts the ``e`` each
server answers (:mod:`~lightning_pdist.parameter_server.elastic` has the rule and the paper). No worker waits for
another.

What a worker keeps of its own (``x_i``, its optimizer's state, its local step count) goes into its own file next
to a checkpoint (:mod:`lightning_pdist.core.rank_files`), while the checkpoint's ``state_dict`` and servers hold
the center, so resuming restores the center and every worker exactly.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer

from lightning_pdist.core.guard import SkipStep, global_step, optimizer_grads
from lightning_pdist.core.nonfinite import all_finite, nonfinite_error

__all__ = ["ElasticWorkerMixin"]


class ElasticWorkerMixin:
    """Mixed into :class:`~lightning_pdist.parameter_server.strategy.ParameterServerStrategy` (which owns
    ``client``, ``plan``, ``config``, ``comm_meter``, ``workers`` and the flat-parameter helpers)."""

    easgd_steps: int = 0  # local steps this worker took (batches in which an optimizer stepped)
    _local_step_open: bool = False

    @property
    def elastic(self) -> bool:
        return self.config.mode == "easgd"

    def _elastic_start(self) -> None:
        self.easgd_steps, self._local_step_open = 0, False

    def _elastic_optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any, **kwargs: Any) -> Any:
        """The module's optimizer steps here, on this worker's ``x_i`` (its own gradients, checked alone)."""
        guard, rank = self.nonfinite_guard, self.global_rank
        module = model if model is not None else self.lightning_module
        if guard.consulted(self.precision_plugin):
            inner = closure

            def closure() -> Any:
                result = inner()
                if (result is not None or not module.automatic_optimization) and not all_finite(optimizer_grads(optimizer)):
                    guard.act("gradients", [rank], module, before="its local step (the center has not seen them)",
                              skipped="its own local step", scope=f"worker {rank}")  # fmt: skip
                return result

        try:
            output = DDPStrategy.optimizer_step(self, optimizer, closure, model, **kwargs)
        except SkipStep:
            output = None  # this worker skips the step: no update, not counted towards τ
        else:
            self.step += 1
            if len(self.optimizers) > 1:
                self._local_step_open = True  # the batch may step another optimizer yet
            else:
                self._end_local_step()
        guard.step_done()
        self._log_comm_bytes()
        return output

    def _close_local_step(self) -> None:
        if self.elastic and self._local_step_open:
            self._local_step_open = False
            self._end_local_step()

    def _end_local_step(self) -> None:
        self.easgd_steps += 1
        metas: list[dict] = []
        if self.easgd_steps % self.config.period == 0:
            metas = self._elastic_exchange()
        self._log_ps_metrics(metas)

    def _elastic_exchange(self) -> list[dict]:
        """``x_i ← x_i − e`` with each server's ``e = α(x_i − x̃)``; the servers added it to ``x̃`` already."""
        flat = self._flat_params()
        if self.nonfinite != "propagate" and not all_finite([flat]):
            raise nonfinite_error(
                type(self).__name__, "parameters", [], global_step(self.lightning_module),
                "its elastic exchange (the center has not seen them)", self.nonfinite,
                "Every gradient was checked finite, so the local optimizer step made them.", skippable=False,
                scope=f"worker {self.global_rank}", who=f"worker {self.global_rank}")  # fmt: skip
        shards = [self.plan.gather(flat, server) for server in range(self.plan.num_servers)]
        sent_before = sum(c.bytes_sent for c in self.client.connections)
        diffs, metas = self.client.elastic(shards)
        for server, (shard, e) in enumerate(zip(shards, diffs)):
            self.plan.scatter_(flat, server, shard - e)
        self._set_flat_params(flat)
        self._versions = [int(m["version"]) for m in metas]
        self.comm_meter.add("ps_elastic", sum(c.bytes_sent for c in self.client.connections) - sent_before)
        return metas

    # ------------------------------------------------------------------ checkpoints: each worker's own
    def _elastic_rank_state(self) -> dict:
        own = self._eval_backup if self._eval_backup is not None else self._flat_params()  # validation: module = x̃
        return {"params": own.detach().cpu().clone(), "easgd_steps": self.easgd_steps,
                "optimizer_states": [move_data_to_device(o.state_dict(), "cpu") for o in self.optimizers]}  # fmt: skip

    def _load_elastic_rank_state(self, own: dict | None, reason: str) -> None:
        """After the initial pull (every worker holds ``x̃``): this worker's ``x_i``, optimizer state and step count."""
        missing = torch.tensor([0 if own is not None else 1 + self.global_rank], dtype=torch.int64)
        if self.workers is not None and self.world_size > 1:
            self.workers.all_reduce_(missing, "max")
        if own is None or missing.item():
            why = reason if own is None else f"worker {missing.item() - 1} has no part of this checkpoint"
            rank_zero_warn(f"{type(self).__name__}(mode='easgd'): {why}; every worker resumes from the center in "
                           "state_dict with rank 0's optimizer state.")  # fmt: skip
            self._pending_optimizer_states = None
            return
        self._set_flat_params(own["params"])
        self.easgd_steps = int(own["easgd_steps"])
        self._pending_optimizer_states = own["optimizer_states"]  # applied when Lightning restores the optimizers
