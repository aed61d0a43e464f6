"""D-PSGD as a Lightning Fabric strategy: your own loop, ``optimizer.step()`` mixes the model with the neighbours'.

The rule of :class:`~lightning_pdist.decentralized.strategy.DecentralizedStrategy` with ``mode="sync"`` (Lian et al.
2017, Algorithm 1; math in :mod:`.topology`), driven by Fabric calls:

* ``fabric.setup(model, optimizer)``: DDP broadcasts rank 0's weights (every ``x_i(0)`` is equal); its gradient hook
  never communicates and ``broadcast_buffers`` is off; the gossip gets a gloo group of its own.
* ``fabric.backward(loss)``: this rank's gradient ``∇F_i(x_i(t))`` at its own model; nothing is sent.
* ``optimizer.step()``: this rank exchanges its model (the optimizer's parameters and the module's float buffers)
  with its neighbours, takes ``Σ_j W_ij x_j(t)`` and only then lets the optimizer apply the gradient: for SGD
  ``x_i(t+1) = Σ_j W_ij x_j(t) − γ ∇F_i(x_i(t))``. Bytes: the model once per out-neighbour (``gossip_model``).
  Unlike the Trainer strategy the exchange does not overlap the backward pass (Fabric shows the strategy no forward
  pass to start it at). A closure (``optimizer.step(closure)``) is refused: it would take the gradient after mixing.
* **The output** is the average of the ranks: evaluate it inside ``with fabric.strategy.consensus_weights(): ...``
  and call ``fabric.strategy.load_consensus()`` at the end (each one all-reduce).
* ``fabric.save(path, {"model": model, "optimizer": optimizer, ...})``: ``"model"`` holds the average, each rank's own
  model and optimizer state go to its own file, ``"pdist"`` the step and the mixing matrix; ``fabric.load(path, same
  dict)`` after ``fabric.setup`` resumes every rank exactly. Non-finite values are not checked (no ``nonfinite=``).

AD-PSGD (``mode="async"``) has no Fabric form: its passive ranks answer from a thread that must own the model between
the user's steps, and its end needs every rank to stop at a point the strategy sees (the Trainer's end of fit).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_pdist.core.collectives import all_reduce_mean_
from lightning_pdist.core.fabric import PdistFabricStrategy
from lightning_pdist.core.flat import flatten, unflatten_into_
from lightning_pdist.core.hooks import AllReduceState, periodic_allreduce_hook
from lightning_pdist.decentralized.config import DecentralizedConfig, GossipRecord, RankPlan
from lightning_pdist.decentralized.gossip import NeighbourExchange
from lightning_pdist.decentralized.topology import mix

__all__ = ["DecentralizedFabricStrategy"]


class DecentralizedFabricStrategy(GossipRecord, PdistFabricStrategy):
    """D-PSGD under Fabric: each ``optimizer.step()`` mixes the model with the neighbours' on a graph, then steps.

    Args:
        topology: ``"ring"``, ``"torus"``, ``"exponential"``, ``"complete"``, or an ``n × n`` doubly stochastic mixing
            matrix (``n`` = the number of ranks), as for the Trainer's ``DecentralizedStrategy``.
        torus_shape: ``(rows, columns)`` of the torus (default: the most nearly square factorization of ``n``).
        **kwargs: passed to Fabric's :class:`~lightning.fabric.strategies.DDPStrategy` (``start_method``, ...).

    Example::

        fabric = Fabric(accelerator="cpu", devices=4, strategy="dpsgd")
        fabric = Fabric(accelerator="cpu", devices=4, strategy=DecentralizedFabricStrategy(topology="exponential"))
    """

    strategy_name = "dpsgd"
    one_rank_behaviour = "there are no neighbours: each step is the optimizer's plain step on this one model"

    def __init__(self, topology: Any = "ring", torus_shape: tuple[int, int] | None = None, **kwargs: Any) -> None:
        self.config = DecentralizedConfig(topology=topology, torus_shape=torus_shape, owner=type(self).__name__)
        super().__init__(**kwargs)
        self.step = 0  # optimizer.step() calls (all optimizers)
        self.plan: RankPlan | None = None
        self._group: dist.ProcessGroup | None = None
        self._exchange: NeighbourExchange | None = None
        self._hook_state = AllReduceState(meter=self.comm_meter, allreduce=False)
        self._backup: Tensor | None = None

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self.parallel_devices:  # devices × num_nodes is known before any process starts
            self.config.check_world(self.num_nodes * len(self.parallel_devices))

    # ------------------------------------------------------------------ lifecycle
    @override
    def comm_hook(self) -> tuple[object, Callable]:
        return self._hook_state, periodic_allreduce_hook  # allreduce=False: each rank keeps its own gradient

    @override
    def check_setup(self, module: Module) -> None:
        self.config.check_world(self.rank_world[1])

    @override
    def setup_algorithm(self) -> None:
        rank, world_size = self.rank_world
        self.plan = self.config.plan(rank, world_size)
        self.ddp_module.broadcast_buffers = False  # each rank's buffers are its own; they are mixed with the model
        self._group = dist.new_group(list(range(world_size)))  # the gossip's own group (every rank calls this)
        self._exchange = NeighbourExchange(self._group, self.plan.send_to, self.plan.recv_from, self.comm_meter)
        self.step = 0

    def _float_buffers(self) -> list[Tensor]:
        return [b for b in self.module.buffers() if torch.is_floating_point(b)]

    def _all_tensors(self) -> list[Tensor]:
        return list(self.module.parameters()) + self._float_buffers()

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if self.plan is not None:
            if kwargs.get("closure") is not None:
                raise ValueError(f"{type(self).__name__}: optimizer.step(closure) would compute the gradient after the "
                                 "model is mixed; D-PSGD takes it at the rank's own model. Call fabric.backward(loss) "
                                 "and then optimizer.step() without a closure")  # fmt: skip
            self._mix(optimizer)
        return super().optimizer_step(optimizer, **kwargs)

    def _mix(self, optimizer: Optimizer) -> None:
        """``x_i ← Σ_j W_ij x_j`` for this optimizer's parameters and the float buffers (one exchange)."""
        params = list(dict.fromkeys(p for group in optimizer.param_groups for p in group["params"]))
        tensors = params + self._float_buffers()
        own = flatten(tensors)
        received = self._exchange.start(own).wait()
        unflatten_into_(mix(own, received, self.plan.weights, self.plan.self_weight), tensors)

    @override
    def after_optimizer_step(self) -> None:
        self.step += 1

    # ------------------------------------------------------------------ the average of the ranks
    def consensus(self) -> Tensor:
        """``mean_i x_i`` (one all-reduce of the model and float buffers, not counted)."""
        return all_reduce_mean_(flatten(self._all_tensors()).to(self.root_device))

    @contextmanager
    def consensus_weights(self) -> Iterator[None]:
        """Inside the block the module holds the average of the ranks; on exit, this rank's own model again
        (collective on entry; steps taken inside the block are lost on exit)."""
        if self._backup is not None or self.module is None:
            yield
            return
        consensus = self.consensus()
        self._backup = flatten(self._all_tensors())
        unflatten_into_(consensus, self._all_tensors())
        try:
            yield
        finally:
            unflatten_into_(self._backup, self._all_tensors())
            self._backup = None

    def load_consensus(self) -> None:
        """Every rank loads the average of the ranks: call once training is over (collective)."""
        unflatten_into_(self.consensus(), self._all_tensors())

    # ------------------------------------------------------------------ checkpoints
    @override
    def checkpoint_weights(self) -> Any:
        return self.consensus_weights()

    @override
    def rank_state(self, objects: dict[str, Any]) -> dict | None:
        # Written at once (before the average is swapped in for the main file), so no copies are needed.
        return None if self.module is None else self.replica_objects_state(objects)

    @override
    def load_rank_state(self, state: dict | None, objects: dict[str, Any], reason: str) -> None:
        self.load_replica_or_warn(state, objects, reason, resumes_from="the average of the ranks")
