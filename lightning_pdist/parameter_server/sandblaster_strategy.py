"""Sandblaster L-BFGS (Dean et al. 2012) as a Lightning strategy: ``Trainer(strategy="sandblaster")``.

The module's ``configure_optimizers`` returns ``torch.optim.LBFGS(..., max_iter=1, line_search_fn=None)``; under
this strategy that optimizer never steps on a worker. Its vectors (parameters, gradient, direction, the history of
``s, y`` pairs) live sharded on the parameter servers, worker 0 coordinates the two-loop recursion as commands on
the shards (only scalars travel: :mod:`~lightning_pdist.parameter_server.sandblaster`), and every worker computes
gradients of the *same* batch in portions that server 0 hands out to whichever worker asks (so a fast worker takes
more; ``backup_portions`` re-issues the last unanswered portions to idle workers and the first answer is kept).

Per training batch, on every worker::

    until server 0 says none is left: claim portion p; run training_step on batch[p] + backward; SB_GRAD to every server
    worker 0 only: LBFGSCoordinator.step (close the gradient, the two-loop recursion, x += t·d, finish)
    pull x (answered once the coordinator finished the step)

Every worker loads the whole dataset (``distributed_sampler_kwargs``: one replica), so any worker can compute any
portion; it must draw the same batches as the others. Under ``use_distributed_sampler=True`` the ranks' seeds must
agree (refused at setup otherwise); every claim carries the digest of the worker's batch, and server 0 refuses a
step whose workers hold different batches (naming the step and both workers). The server side is :mod:`~lightning_pdist.parameter_server.sandblaster_server`; the servers, their
placement, authentication and the workers' group are :class:`ParameterServerStrategy`'s. The method card is
``docs/algorithms/parameter_server.md`` (Sandblaster L-BFGS).
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.loops.optimization.automatic import ClosureResult
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_pdist.core.config import is_int
from lightning_pdist.core.strategy import PdistStrategy
from lightning_pdist.core.ps_client import ParameterServerClient
from lightning_pdist.parameter_server.sandblaster import LBFGSCoordinator, batch_digest, combine, portion_bounds
from lightning_pdist.parameter_server.sandblaster_server import MAX_HISTORY, MAX_PORTIONS
from lightning_pdist.parameter_server.strategy import ParameterServerStrategy
from lightning_pdist.core.ps_wire import Kind

__all__ = ["SandblasterStrategy"]

PORTIONS_PER_WORKER = 4  # portions=None: this many per worker (Dean et al.: many more portions than replicas)


class SandblasterStrategy(ParameterServerStrategy):
    """Sandblaster L-BFGS (Dean et al. 2012): batch L-BFGS with its vectors sharded on parameter servers.

    Args:
        portions: portions each batch is cut into (contiguous slices along dim 0; at most the batch size is used).
            ``None``: 4 per worker.
        backup_portions: per step, how many still-unanswered portions (the last ones first) are handed again to
            workers that have nothing left to do; the first answer for a portion is kept. In ``[0, portions)``.
        num_servers, sharding, partition_bytes, server_host, server_port, server_addresses, server_secret_file,
            allowed_networks, server_timeout: as for :class:`ParameterServerStrategy`.
        **kwargs: :class:`~lightning.pytorch.strategies.DDPStrategy` arguments (``start_method``, ``timeout``).
    """

    strategy_name = "sandblaster"
    progress_bar_keys = {"pdist/ps/wait_s": ("wait", "s")}

    def __init__(
        self,
        portions: int | None = None,
        backup_portions: int = 0,
        num_servers: int | None = None,
        sharding: str = "memory",
        partition_bytes: int | None = None,
        server_host: str | None = None,
        server_port: int | None = None,
        server_addresses: list[str] | None = None,
        server_secret_file: str | None = None,
        allowed_networks: str | None = None,
        server_timeout: float = 300.0,
        **kwargs: Any,
    ) -> None:
        owner = type(self).__name__
        if portions is not None:
            if not is_int(portions):
                raise TypeError(f"{owner}(portions={portions!r}): portions must be an int or None (4 per worker)")
            if not 1 <= portions <= MAX_PORTIONS:
                raise ValueError(f"{owner}(portions={portions!r}): portions must be in [1, {MAX_PORTIONS}] (portions of "
                                 "each batch that the workers compute; None: 4 per worker)")  # fmt: skip
        if not is_int(backup_portions):
            raise TypeError(f"{owner}(backup_portions={backup_portions!r}): backup_portions must be an int")
        if backup_portions < 0 or (portions is not None and backup_portions >= portions):
            bound = f"portions={portions}" if portions is not None else "portions"
            raise ValueError(f"{owner}(backup_portions={backup_portions!r}): backup_portions must be in [0, {bound}) "
                             "(re-issued copies of a step's last unanswered portions)")  # fmt: skip
        if isinstance(server_timeout, (int, float)) and not isinstance(server_timeout, bool) and 0 < server_timeout < 1:
            raise ValueError(f"{owner}(server_timeout={server_timeout!r}): server_timeout must be at least 1 second (every "
                             "request, the authentication included, must complete within it)")  # fmt: skip
        super().__init__(num_servers=num_servers, sharding=sharding, mode="sync", partition_bytes=partition_bytes,
                         server_host=server_host, server_port=server_port, server_addresses=server_addresses,
                         server_secret_file=server_secret_file, allowed_networks=allowed_networks,
                         server_timeout=server_timeout, **kwargs)  # fmt: skip
        self.portions, self.backup_portions = portions, backup_portions
        self.coordinator: LBFGSCoordinator | None = None
        self.portion_counts = {"computed": 0, "accepted": 0, "backups": 0}  # this worker's, over the fit
        self._portion: tuple[int, int] | None = None
        self._batch_size = 0
        self._batch_digest: str | None = None
        self._history_size = 0

    def portions_for(self, world_size: int) -> int:
        return self.portions if self.portions is not None else PORTIONS_PER_WORKER * world_size

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """One replica: every worker loads the whole batch, so that any worker can compute any portion of it."""
        return {"num_replicas": 1, "rank": 0}

    @override
    def set_world_ranks(self) -> None:
        super().set_world_ranks()
        portions = self.portions_for(self.world_size)
        if self.backup_portions >= portions:
            raise ValueError(f"{type(self).__name__}(backup_portions={self.backup_portions}): with {portions} portions "
                             f"per step ({self.world_size} workers x {PORTIONS_PER_WORKER}), backup_portions must be "
                             f"in [0, {portions})")  # fmt: skip

    # ------------------------------------------------------------------ setup
    def _check_setup(self, owner: str) -> None:
        """The module must hand the strategy one torch.optim.LBFGS it can run as Sandblaster (each refusal named)."""
        module, trainer = self.lightning_module, self.lightning_module.trainer
        if len(self.optimizers) != 1 or type(self.optimizers[0]) is not torch.optim.LBFGS:
            got = ", ".join(f"{type(o).__module__}.{type(o).__qualname__}" for o in self.optimizers) or "no optimizer"
            raise ValueError(f"{owner}: configure_optimizers returned {got}; Sandblaster runs batch L-BFGS and needs "
                             "exactly one torch.optim.LBFGS(params, lr=..., history_size=..., max_iter=1, "
                             "line_search_fn=None) (the servers hold its vectors)")  # fmt: skip
        group = self.optimizers[0].param_groups[0]
        self._check_group(owner, group)
        if not 1 <= group["history_size"] <= MAX_HISTORY:
            raise ValueError(f"{owner}: LBFGS(history_size={group['history_size']}): history_size must be in "
                             f"[1, {MAX_HISTORY}] (each pair is two parameter-sized vectors on every server)")  # fmt: skip
        self._history_size = group["history_size"]
        mine = {id(p) for p in group["params"]}
        others = [n for n, p in module.named_parameters() if id(p) not in mine]
        if others:
            raise ValueError(f"{owner}: LBFGS holds {len(mine)} parameters but the module has more ({', '.join(others[:4])}"
                             f"{', ...' if len(others) > 4 else ''}); Sandblaster's vectors span every parameter of the "
                             "module: give LBFGS self.parameters()")  # fmt: skip
        if not module.automatic_optimization:
            raise ValueError(f"{owner}: automatic_optimization is False; Sandblaster runs training_step itself on each "
                             "portion of the batch, which needs automatic optimization")  # fmt: skip
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(f"{owner}: Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}): the portions "
                             "already sum the batch's gradient; raise the batch size instead")  # fmt: skip
        if trainer.gradient_clip_val:
            raise ValueError(f"{owner}: Trainer(gradient_clip_val={trainer.gradient_clip_val}): L-BFGS's curvature pairs "
                             "need the true gradient; leave gradient_clip_val unset")  # fmt: skip
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValueError(f"{owner}: precision with a gradient scaler ({type(self.precision_plugin).__name__}): the "
                             "portions' gradients go unscaled into L-BFGS; use precision='32-true' or 'bf16-mixed'")  # fmt: skip

    def _check_sampler_seed(self, owner: str) -> None:
        """Under ``use_distributed_sampler=True`` Lightning shuffles every rank's one-replica sampler with that rank's
        ``PL_GLOBAL_SEED``: refused unless every rank has the same one (all ranks see the list and refuse alike)."""
        trainer = self.lightning_module.trainer
        if not trainer._accelerator_connector.use_distributed_sampler or self.workers is None:
            return
        seeds = self.workers.all_gather_object(os.environ.get("PL_GLOBAL_SEED", "0"))
        if len(set(seeds)) > 1:
            differ = ", ".join(f"rank {r}: {s}" for r, s in enumerate(seeds) if s != seeds[0])
            raise ValueError(f"{owner}: Trainer(use_distributed_sampler=True) shuffles each rank's sampler with its "
                             f"PL_GLOBAL_SEED, which differs across ranks (rank 0: {seeds[0]}, {differ}); Sandblaster "
                             "needs the same batch on every rank: seed every rank alike (seed_everything(s), one s), "
                             "or pass use_distributed_sampler=False with a loader that yields the same batches on "
                             "every rank")  # fmt: skip

    @staticmethod
    def _check_group(owner: str, group: dict) -> None:
        if group.get("line_search_fn") is not None:
            raise ValueError(f"{owner}: LBFGS(line_search_fn={group['line_search_fn']!r}): not supported; a line search "
                             "evaluates the batch at trial points inside one step, which Sandblaster's portions do not "
                             "do here: use line_search_fn=None")  # fmt: skip
        if group.get("max_iter") != 1:
            raise ValueError(f"{owner}: LBFGS(max_iter={group.get('max_iter')!r}): not supported; each training batch is "
                             "one L-BFGS iteration here (one round of portions): use max_iter=1")  # fmt: skip

    @override
    def setup_algorithm(self) -> None:
        owner = type(self).__name__
        self._check_setup(owner)
        self._check_sampler_seed(owner)
        params = self._params()
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"{owner}: the model's parameters have dtypes {sorted(map(str, dtypes))}; the servers need one")
        world_size, rank = self.world_size, self.global_rank
        self.plan = self._plan(len(self.server_addresses) or self.config.servers_for(world_size))
        self.layout = None
        self.client = ParameterServerClient(self.server_addresses, rank, timeout=self.config.server_timeout,
                                            secret=self._secret)  # fmt: skip
        loaded = self._loaded_pdist_state
        if rank == 0:
            self.client.map(Kind.INIT, *self._init_requests())
            if loaded is not None:
                self._restore_servers(loaded)
            self.coordinator = LBFGSCoordinator(params[0].dtype)
            if loaded is not None and loaded.get("sandblaster") is not None:
                self.coordinator.load_state_dict(loaded["sandblaster"])
        self.optimizer_steps = [0]
        if loaded is not None:
            super(ParameterServerStrategy, self).load_pdist_state_dict(loaded)
            self.step = int(loaded.get("step", 0))
            self.optimizer_steps = [self.step]
        self.barrier()
        self.client.hello()
        shards, metas = self.client.pull(record=True)
        self._load_shards(shards, metas)
        self._server_seen = [(0, 0) for _ in metas]
        self._server_now = list(self._server_seen)
        self._accumulated, self._finalized, self.push_compressor = {}, False, None
        self._elastic_start()
        self.portion_counts = {"computed": 0, "accepted": 0, "backups": 0}

    @override
    def _init_requests(self) -> tuple[list[dict], list[Tensor]]:
        flat = self._flat_params()
        portions = self.portions_for(self.world_size)
        metas = [{"mode": "sandblaster", "num_workers": self.world_size, "dtype": str(flat.dtype),
                  "segments": [[-1, -1, self.plan.numel_per_server[s]]], "history_size": self._history_size,
                  "max_portions": portions, "backup_portions": self.backup_portions, "dispatcher": s == 0}
                 for s in range(self.plan.num_servers)]  # fmt: skip
        return metas, [self.plan.gather(flat, s) for s in range(self.plan.num_servers)]

    # ------------------------------------------------------------------ a step
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        sizes = set()
        apply_to_collection(batch, Tensor, lambda t: sizes.add(t.shape[0] if t.dim() else None))
        if len(sizes) != 1 or None in sizes:
            raise ValueError(f"{type(self).__name__}: the batch's tensors have first dimensions {sorted(map(str, sizes))}; "
                             "portions slice every tensor of the batch along dim 0, so they must all share it")  # fmt: skip
        self._batch_size = sizes.pop()
        tensors: list[Tensor] = []
        apply_to_collection(batch, Tensor, tensors.append)
        self._batch_digest = batch_digest(tensors)
        super().on_train_batch_start(batch, batch_idx)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._portion is not None and args:
            start, stop = self._portion
            args = (apply_to_collection(args[0], Tensor, lambda t: t[start:stop]), *args[1:])
        return super().training_step(*args, **kwargs)

    def _flat_grad(self) -> Tensor:
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self._params()])

    def _run_ops(self, step: int) -> Callable[[list], list[float]]:
        def run(ops: list) -> list[float]:
            meta = {"worker": 0, "step": step, "ops": ops}
            replies = self.client.map(Kind.SB_OPS, [meta] * self.client.num_servers)
            return combine(ops, [m["values"] for m, _ in replies])

        return run

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        owner = type(self).__name__
        if self.client is None:
            raise RuntimeError(f"{owner}.optimizer_step: the servers are not set up (call within Trainer.fit)")
        group = optimizer.param_groups[0]
        self._check_group(owner, group)
        if group["history_size"] != self._history_size:
            raise ValueError(f"{owner}: LBFGS history_size changed to {group['history_size']} during fit; the servers "
                             f"hold {self._history_size} pairs")  # fmt: skip
        batch = self._batch_size
        portions = min(self.portions_for(self.world_size), batch)
        bounds = portion_bounds(batch, portions)
        step, rank, servers = self.step + 1, self.global_rank, self.client.num_servers
        sent_before = sum(c.bytes_sent for c in self.client.connections)
        loss = None
        while True:
            ask = {"worker": rank, "step": step, "portions": portions, "batch": self._batch_digest}
            claim, _ = self.client.connections[0].request(Kind.SB_CLAIM, ask)
            p = claim["portion"]
            if p is None:
                break
            self._portion = bounds[p]
            try:
                loss = closure()
            finally:
                self._portion = None
            if loss is None:
                raise RuntimeError(f"{owner}: training_step returned None on portion {p} of step {step}; every portion "
                                   "needs a loss (skipping a batch is not possible: the other workers share it)")  # fmt: skip
            grad = self._flat_grad()
            if not (math.isfinite(float(loss)) and bool(torch.isfinite(grad).all())):
                raise RuntimeError(f"{owner}: worker {rank}: the loss or gradient of portion {p} of step {step} is not "
                                   "finite; L-BFGS cannot take it (nothing was sent)")  # fmt: skip
            start, stop = bounds[p]
            meta = {"worker": rank, "step": step, "portion": p, "portions": portions, "samples": stop - start,
                    "loss": float(loss)}  # fmt: skip
            replies = self.client.map(Kind.SB_GRAD, [meta] * servers, [self.plan.gather(grad, s) for s in range(servers)])
            self.portion_counts["computed"] += 1
            self.portion_counts["accepted"] += bool(replies[0][0]["accepted"])
            self.portion_counts["backups"] += bool(claim["backup"])
        if rank == 0:
            self.coordinator.step(self._run_ops(step), lr=float(group["lr"]), history_size=self._history_size,
                                  tolerance_grad=float(group["tolerance_grad"]),
                                  tolerance_change=float(group["tolerance_change"]), portions=portions, batch=batch)  # fmt: skip
        shards, metas = self.client.pull(wait_version=step)
        self._load_shards(shards, metas)
        self.step = step
        self.optimizer_steps[0] += 1
        if loss is None and getattr(closure, "_result", 1) is None:
            # This worker computed no portion of this batch (the others took them all): Lightning gets "no loss".
            closure._result = ClosureResult(None)
        self.comm_meter.add("ps_push", sum(c.bytes_sent for c in self.client.connections) - sent_before)
        self._average_buffers(meeting=False)
        self._log_ps_metrics(metas)
        if metas and metas[0].get("loss") is not None:
            self._diagnostics.note("pdist/sandblaster/batch_loss", float(metas[0]["loss"]))
        self._diagnostics.note("pdist/sandblaster/portions", float(self.portion_counts["computed"]))
        optimizer._opt_called = True
        self._log_comm_bytes()
        return loss

    # ------------------------------------------------------------------ checkpoints
    @override
    def pdist_state_dict(self) -> dict:
        state = super().pdist_state_dict()
        if self.coordinator is not None:
            state["sandblaster"] = self.coordinator.state_dict()
        return state

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        PdistStrategy.register_strategies.__func__(cls, strategy_registry)
