"""AsySVRG's snapshot on a LightningModule: ``w̃``, the full gradient ``μ`` (one pass shared by the processes) and
the per-batch gradient at ``w̃`` (the rule is in :mod:`~lightning_pdist.shared_memory.svrg`).

Gradients at ``w̃`` come from the module's own ``training_step`` with ``torch.autograd.grad`` (no ``.grad`` is
touched); whatever it logs there goes to a throwaway result collection, so the logged training loss is the one at
``w``. Float buffers (BatchNorm statistics) do see the extra forward passes.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import torch
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection
from torch import Tensor

__all__ = ["Snapshot"]


def _loss(output: Any) -> Tensor:
    return output["loss"] if isinstance(output, dict) else output


class Snapshot:
    """``w̃`` and ``μ`` for the parameters ``params`` (one optimizer's, in its order), and the epoch they belong to."""

    def __init__(self, params: list[Tensor]):
        self.params = params
        self.epoch = -1
        self.weights: list[Tensor] = []
        self.mu: list[Tensor] = []

    def _grads(self, trainer: Any, batch: Any, batch_idx: int) -> list[Tensor]:
        """Dense gradients of ``training_step(batch, batch_idx)`` at the module's current weights (logging muted)."""
        module = trainer.lightning_module
        loop = trainer.fit_loop.epoch_loop
        saved, fx = loop._results, module._current_fx_name
        loop._results = _ResultCollection(training=True)
        loop._results.batch = batch
        module._current_fx_name = "training_step"
        try:
            with torch.enable_grad(), trainer.precision_plugin.train_step_context():
                loss = _loss(module.training_step(batch, batch_idx))
            grads = torch.autograd.grad(loss, self.params, allow_unused=True)
        finally:
            loop._results, module._current_fx_name = saved, fx
        return [torch.zeros_like(p) if g is None else (g.to_dense() if g.is_sparse else g) for p, g in zip(self.params, grads)]

    def take(self, trainer: Any, epoch: int, batches: Any, num_batches: int, to_device: Callable[[Any], Any],
             all_reduce_: Callable[[Tensor], Tensor]) -> None:
        """At the start of ``epoch`` with every process here and none stepping: ``w̃`` ← the shared weights, and
        ``μ`` = the mean gradient at ``w̃`` over every process's batches of the epoch (this process's ``batches``,
        summed, then one all-reduce of the sums and the batch counts)."""
        self.weights = [p.detach().clone() for p in self.params]
        sums = [torch.zeros_like(p) for p in self.params]
        count = 0
        for batch_idx, batch in enumerate(itertools.islice(batches, num_batches)):
            for s, g in zip(sums, self._grads(trainer, to_device(batch), batch_idx)):
                s.add_(g)
            count += 1
        flat = torch.cat([s.reshape(-1).double() for s in sums] + [torch.tensor([float(count)], dtype=torch.float64)])
        all_reduce_(flat)
        total, flat = flat[-1], flat[:-1] / flat[-1].clamp(min=1)
        self.mu = [m.view_as(p).to(p.dtype) for m, p in zip(flat.split([p.numel() for p in self.params]), self.params)]
        self.epoch = epoch
        assert total > 0, "AsySVRG: no training batch in the epoch"

    def grads_at_snapshot(self, trainer: Any, batch: Any, batch_idx: int) -> list[Tensor]:
        """``∇f_b(w̃)`` for this batch: the module's weights are pointed at ``w̃`` for the pass, then back."""
        live = [p.data for p in self.params]
        try:
            for p, w in zip(self.params, self.weights):
                p.data = w
            return self._grads(trainer, batch, batch_idx)
        finally:
            for p, data in zip(self.params, live):
                p.data = data

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "weights": [w.cpu() for w in self.weights], "mu": [m.cpu() for m in self.mu]}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.weights = [w.to(p.device) for w, p in zip(state["weights"], self.params)]
        self.mu = [m.to(p.device) for m, p in zip(state["mu"], self.params)]
