"""D-PSGD and AD-PSGD as a Lightning strategy: each rank keeps its own model and averages it with its neighbours'.

Lifecycle of one run (every rank):

* ``Trainer(...)``: the graph is checked against ``devices × num_nodes`` (``_configure_launcher``, before any process
  starts): a torus on a prime number of ranks, a matrix of the wrong size, too few ranks are refused there.
* ``setup`` (fit): no DistributedDataParallel (no gradient is ever all-reduced); rank 0's weights are broadcast so
  every ``x_i(0)`` is equal (Lian et al. start from one point); the gossip gets a gloo group of its own (its
  point-to-point messages never pair with Lightning's collectives); ``implicit_momentum="compensate"`` lowers the
  optimizers' momentum; AD-PSGD's passive ranks start their server thread. A resumed run then loads its own model
  and optimizer state from its own file.
* each optimizer step, between the backward pass and the update (:meth:`wrap_step_closure`):
  *sync* (D-PSGD): the sends of ``x_i(t)`` are posted before the forward pass and waited for after the backward
  pass (overlap), then the parameters become ``Σ_j W_ij x_j(t)`` and the optimizer applies the gradient taken at
  ``x_i(t)``; float buffers (BatchNorm statistics), which the forward pass changes, are mixed after it.
  *async* (AD-PSGD): an active rank averages with one random passive neighbour, then steps; a passive rank steps
  under the lock its server thread averages under. Only the optimizer's own parameters (and the float buffers) are
  mixed at its step, so with several optimizers each parameter is mixed once per step of its optimizer.
* validation during fit, checkpoints and the end of fit see the **average of all ranks** (one all-reduce of the model,
  not counted in ``pdist/comm_bytes``); in async mode a barrier first lets every pending pair exchange finish, and a
  passive rank holds its lock from the swap-in to the swap-out. Each rank's own model and optimizer state go to its
  own file; a sync run resumes exactly.
"""

from __future__ import annotations

import random
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_pdist.core.collectives import all_reduce_mean_
from lightning_pdist.core.config import OwnedDDPArguments
from lightning_pdist.core.flat import flatten, unflatten_into_
from lightning_pdist.core.nonfinite import all_finite
from lightning_pdist.core.guard import optimizer_grads
from lightning_pdist.core.momentum import compensate_optimizers, implicit_momentum
from lightning_pdist.core.consensus import ReplicaEvaluation
from lightning_pdist.core.strategy import PdistStrategy, register_variants
from lightning_pdist.decentralized.config import DecentralizedConfig, GossipRecord, RankPlan
from lightning_pdist.decentralized.gossip import NeighbourExchange, PassiveServer, average_with, send_stop
from lightning_pdist.decentralized.topology import mix, pick_partner

__all__ = ["DecentralizedStrategy"]


class DecentralizedStrategy(GossipRecord, ReplicaEvaluation, OwnedDDPArguments, PdistStrategy):
    """Decentralized SGD: D-PSGD (``mode="sync"``, ``"dpsgd"``) or AD-PSGD (``mode="async"``, ``"adpsgd"``).

    D-PSGD (Lian et al. 2017, Algorithm 1): ``x_i(t+1) = Σ_j W_ij x_j(t) − γ ∇F_i(x_i(t))`` for SGD (any optimizer
    applies its update to the mixed model), ``W_ij = 1/(deg(i)+1)`` on ``N(i) ∪ {i}``. AD-PSGD (Lian et al. 2018):
    each active rank takes ``x_i, x_j ← (x_i + x_j)/2`` with one random passive neighbour, then applies the gradient it
    computed before; no barrier. Bytes per step: D-PSGD sends the model to each neighbour; AD-PSGD sends it once per
    pair average (active: request, passive: reply). The math is in :mod:`.topology`; the method card is
    ``docs/algorithms/dpsgd.md``.

    Args:
        topology: ``"ring"``, ``"torus"``, ``"exponential"`` (SGP's graph, static and undirected), ``"complete"``, or
            an ``n × n`` doubly stochastic mixing matrix (list, array or tensor; ``n`` = the number of ranks).
        mode: ``"sync"`` (D-PSGD) or ``"async"`` (AD-PSGD; active ranks are the even ones).
        implicit_momentum: ``"compensate"`` (async only) lowers every optimizer's momentum (SGD's ``momentum``, Adam's
            ``beta1``) by ``1 − 1/M`` for ``M`` ranks, floored at 0 (Mitliagkas et al. 2016).
        torus_shape: ``(rows, columns)`` of the torus (default: the most nearly square factorization of ``n``).
        seed: seeds each active rank's choice of partner (``seed``, rank).
        nonfinite: ``"raise"`` (default), ``"skip_step"`` or ``"propagate"``. Sync: the ranks agree through one
            all-reduce of ``world_size`` flags per step; async: each rank decides alone (no collective).
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy` (``timeout``, ``start_method``, ...).

    Example::

        Trainer(accelerator="cpu", devices=4, strategy=DecentralizedStrategy(topology="ring"))
        Trainer(accelerator="cpu", devices=4, strategy="adpsgd")
    """

    strategy_name = "dpsgd"
    owned_reason = "{owner} owns all communication (there is no gradient all-reduce)"
    consensus_name = "the average of the ranks"
    wraps_in_ddp = False  # no DistributedDataParallel: no find_unused_parameters variants

    def __init__(self, topology: Any = "ring", mode: str = "sync", implicit_momentum: str | None = None,
                 torus_shape: tuple[int, int] | None = None, seed: int = 0, nonfinite: str = "raise",
                 **kwargs: Any) -> None:  # fmt: skip
        self.config = DecentralizedConfig(topology=topology, mode=mode, implicit_momentum=implicit_momentum,
                                          torus_shape=torus_shape, seed=seed, owner=type(self).__name__)
        super().__init__(nonfinite=nonfinite, **kwargs)  # OwnedDDPArguments refuses and hides DDP's comm-hook arguments
        self.step = 0
        self.plan: RankPlan | None = None
        self._group: dist.ProcessGroup | None = None
        self._exchange: NeighbourExchange | None = None
        self._rng = random.Random()
        self._lock = threading.RLock()  # async, passive ranks: the server thread's averaging vs this rank's steps
        self._locked = False
        self._server: PassiveServer | None = None
        self.momentum_from: list[float] = []  # the momentum each optimizer had before compensation

    @property
    def mode(self) -> str:
        return self.config.mode

    @classmethod
    @override
    def registered_name(cls, strategy: "PdistStrategy | None" = None) -> str:
        return "adpsgd" if isinstance(strategy, DecentralizedStrategy) and strategy.mode == "async" else "dpsgd"

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_variants(strategy_registry, cls, "dpsgd", "D-PSGD: each step, mix the model with the neighbours' "
                          "(Lian et al. 2017)", find_unused=False)  # fmt: skip
        register_variants(strategy_registry, cls, "adpsgd", "AD-PSGD: asynchronous pairwise model averaging "
                          "(Lian et al. 2018)", find_unused=False, mode="async")  # fmt: skip

    # ------------------------------------------------------------------ construction-time checks
    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        devices = self.parallel_devices
        if devices:  # the Trainer knows devices × num_nodes now, before any process starts
            self.config.check_world(self.num_nodes * len(devices))

    # ------------------------------------------------------------------ setup
    @override
    def setup_algorithm(self) -> None:
        rank, world_size = self.rank_world
        self.plan = self.config.plan(rank, world_size)
        if world_size == 1:
            rank_zero_warn(f"{type(self).__name__}: world_size == 1, so there are no neighbours; each step is the "
                           "optimizer's plain step on this one model.")  # fmt: skip
        if self._group is None or dist.get_world_size(self._group) != world_size:
            self._group = dist.new_group(list(range(world_size)))  # the gossip's own group (every rank calls this)
        self._exchange = NeighbourExchange(self._group, self.plan.send_to, self.plan.recv_from, self.comm_meter)
        self._broadcast_from_rank_zero()
        self.step, self._finalized, self._evaluating_backup, self._server = 0, False, None, None
        self._rng = random.Random(self.config.seed * 1_000_003 + rank)
        self._compensate_momentum(world_size)

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        # After a resumed run loaded its own model: the passive ranks start answering only now.
        if trainer.state.fn == TrainerFn.FITTING and self.mode == "async" and self.plan is not None and not self.plan.active:
            if self.plan.partners:
                self._server = PassiveServer(self._group, self.plan.partners, self._tensors_of_index, self._lock)
                self._server.start()

    def _broadcast_from_rank_zero(self) -> None:
        # Every x_i(0) is rank 0's (setup traffic, not counted); a resumed run then loads its own model.
        tensors = self._all_tensors()
        flat = flatten(tensors).to(self.root_device)
        dist.broadcast(flat, src=0)
        unflatten_into_(flat, tensors)

    def _compensate_momentum(self, workers: int) -> None:
        self.momentum_from = []
        if self.config.implicit_momentum != "compensate":
            return
        self.momentum_from, warning = compensate_optimizers(self.optimizers, workers, type(self).__name__)
        if warning:
            rank_zero_warn(warning)

    # ------------------------------------------------------------------ the tensors that move
    def _all_tensors(self) -> list[Tensor]:
        module = self.lightning_module
        return list(module.parameters()) + [b for b in module.buffers() if torch.is_floating_point(b)]

    def _float_buffers(self) -> list[Tensor]:
        return [b for b in self.lightning_module.buffers() if torch.is_floating_point(b)]

    def _params_of(self, optimizer: Optimizer) -> list[Tensor]:
        return list(dict.fromkeys(p for group in optimizer.param_groups for p in group["params"]))

    def _tensors_of_index(self, index: int) -> list[Tensor]:
        return self._params_of(self.optimizers[index]) + self._float_buffers()

    # ------------------------------------------------------------------ each step
    @override
    def wrap_step_closure(self, optimizer: Optimizer, closure: Callable[[], Any]) -> Callable[[], Any]:
        if self.plan is None:  # not set up for fit
            return closure
        if self.mode == "sync":
            return lambda: self._sync_step(optimizer, closure)
        if self.plan.active:
            return lambda: self._active_step(optimizer, closure)
        return lambda: self._passive_step(closure)

    def _sync_step(self, optimizer: Optimizer, closure: Callable[[], Any]) -> Any:
        plan, exchange = self.plan, self._exchange
        params = self._params_of(optimizer)
        own = flatten(params)  # x_i(t): the backward pass does not change it, so the sends overlap it
        pending = exchange.start(own)
        try:
            output = closure()
        finally:
            received = pending.wait()  # also when the closure raised: every rank posted its messages
        unflatten_into_(mix(own, received, plan.weights, plan.self_weight), params)
        buffers = self._float_buffers()
        if buffers:  # the forward pass updated them: mixed after it
            own_b = flatten(buffers)
            unflatten_into_(mix(own_b, exchange.start(own_b, "gossip_buffers").wait(), plan.weights, plan.self_weight),
                            buffers)  # fmt: skip
        return output

    def _active_step(self, optimizer: Optimizer, closure: Callable[[], Any]) -> Any:
        output = closure()  # the gradient at the model this rank read
        if not self.plan.partners:  # one rank: nobody to average with
            return output
        tensors = self._params_of(optimizer) + self._float_buffers()
        partner = pick_partner(self._rng, self.plan.partners)
        index = next(k for k, opt in enumerate(self.optimizers) if opt is optimizer)
        unflatten_into_(average_with(partner, flatten(tensors), index, self._group, self.comm_meter), tensors)
        return output

    def _passive_step(self, closure: Callable[[], Any]) -> Any:
        output = closure()
        self._lock.acquire()  # released once the optimizer has stepped (optimizer_step)
        self._locked = True
        return output

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        try:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        finally:
            if self._locked:
                self._locked = False
                self._lock.release()

    @override
    def after_optimizer_step(self, optimizer: Optimizer) -> None:
        self.step += 1
        self._check_server()
        if self._server is not None:
            sent = self._server.take_sent()
            if sent:
                self.comm_meter.add("gossip_pair", sent)

    def _check_server(self) -> None:
        if self._server is not None and self._server.error is not None:
            raise RuntimeError(f"{type(self).__name__}: the passive rank's gossip thread failed: "
                               f"{type(self._server.error).__name__}: {self._server.error}") from self._server.error  # fmt: skip

    @override
    def nonfinite_ranks(self, optimizer: Optimizer) -> list[int] | None:
        """Sync: this rank's own gradients, agreed through one all-reduce of ``world_size`` flags (``nonfinite_flag``).
        Async: this rank's alone, no collective (a barrier per step would undo the asynchrony)."""
        if self.mode == "async":
            return None if all_finite(optimizer_grads(optimizer)) else [self.rank_world[0]]
        return self.agreed_nonfinite_ranks(optimizer)

    # ------------------------------------------------------------------ the average of all ranks
    def local_vector(self) -> Tensor:
        return flatten(self._all_tensors())

    def load_vector(self, vector: Tensor) -> None:
        unflatten_into_(vector, self._all_tensors())

    def consensus(self) -> Tensor:
        """``mean_i x_i`` (one all-reduce, not counted). Async: after a barrier (no pair exchange is then in flight)."""
        if self.mode == "async":
            dist.barrier()
        with self._lock:
            local = self.local_vector()
        return all_reduce_mean_(local)

    def _stop_gossip(self) -> None:
        """Async, end of fit: active ranks tell their partners they are done; passive ranks wait for every STOP."""
        if self.mode != "async" or self.plan is None:
            return
        if self.plan.active:
            send_stop(self.plan.partners, self._group, self.comm_meter)
        elif self._server is not None:
            self._server.join(timeout=self._timeout.total_seconds() if self._timeout else None)
            self._check_server()
            if self._server.is_alive():
                missing = sorted(set(self.plan.partners) - self._server.stopped)
                raise RuntimeError(f"{type(self).__name__}: active ranks {missing} never said they were done")
            self.comm_meter.add("gossip_pair", self._server.take_sent())
            self._server = None

    @override
    def finish_replicas(self) -> None:
        self._stop_gossip()
        self.load_vector(self.consensus())

    @override
    def replicas_ready(self) -> bool:
        return self.plan is not None

    @override
    def hold_replica(self) -> None:
        self._lock.acquire()  # a passive rank answers no pair average while it holds the average or a checkpoint reads

    @override
    def release_replica(self) -> None:
        self._lock.release()

    # ------------------------------------------------------------------ checkpoints
    @override
    def pdist_state_dict(self) -> dict:
        return super().pdist_state_dict() | {"mode": self.mode}  # with GossipRecord's step and topology

    @override
    def replica_state(self) -> dict:
        return {**super().replica_state(), "rng": self._rng.getstate()}

    @override
    def load_replica(self, state: dict) -> None:
        super().load_replica(state)
        if "rng" in state:
            self._rng.setstate(state["rng"])

    @override
    def run_settings(self) -> dict[str, Any]:
        settings = super().run_settings()
        settings["topology"] = self.config.name
        if self.config.implicit_momentum == "compensate":
            settings["momentum_lowered_by"] = implicit_momentum(self.world_size)  # 1 − 1/M, floored at 0 per group
        return settings
