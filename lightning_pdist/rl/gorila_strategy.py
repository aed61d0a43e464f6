"""Gorila DQN as a Lightning strategy: the Trainer's ranks are the learners, each with its own actors and local replay
memory, pushing gradients asynchronously to sharded parameter servers.

Gorila (Nair, Srinivasan, Blackwell, Alcicek, Fearon, De Maria, Panneershelvam, Suleyman, Beattie, Petersen, Legg,
Mnih, Kavukcuoglu, Silver, ICML 2015 Deep Learning Workshop, "Massively Parallel Methods for Deep Reinforcement
Learning"), bundled form: learner ``r`` (rank ``r`` of ``L``) forks ``num_actors`` actors that act ε-greedily with
copies of the Q-network they pull from the parameter servers every ``refresh_every`` steps and fill the learner's
local replay memory (uniform: :class:`~lightning_pdist.rl.replay.PrioritizedReplay` with ``α = 0``, every importance
weight 1). Each update the learner samples a minibatch, computes the double-DQN gradient ``∇ mean huber(δ)`` with its
own target network, and pushes it to the ``S`` parameter servers, which apply it asynchronously (Downpour: one
optimizer step on ``g / L`` per push, whichever learner it comes from) and answer with their new parameters
(``PUSHPULL``). Every ``C = target_every`` updates the learner copies those parameters, the servers', into its target
network. Method card: ``docs/algorithms/apex.md`` (Gorila section).

The servers are the parameter-server family's processes, started by learner 0 with the documented program
(:mod:`~lightning_pdist.rl.servers`) and configured over the wire, so this family imports only ``core/``. With one
learner, one actor and ``deterministic=True`` each push is applied before the actor's next pull and the run equals a
single-process double DQN with uniform replay (``tests/rl/test_gorila.py``). Checkpoints hold the servers' state
(parameters, optimizer moments, versions: fetched by learner 0) and each learner's replay, target network, counters and
its actors' exploration generators (per-rank files); the environments' states and, with ``L > 1`` or
``deterministic=False``, the order in which pushes reach the servers are not reproducible.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor
from torch.nn.utils import parameters_to_vector, vector_to_parameters
from torch.optim import Optimizer
from typing_extensions import override

from lightning_pdist.core import rank_files
from lightning_pdist.core.config import OwnedDDPArguments
from lightning_pdist.core.ps_client import ParameterServerClient
from lightning_pdist.core.strategy import PdistStrategy
from lightning_pdist.rl.actor import params_of
from lightning_pdist.rl.actors import ActorPool
from lightning_pdist.rl.apex_strategy import LearnerLoop, check_learner, observation_numel
from lightning_pdist.rl.config import GorilaConfig
from lightning_pdist.rl.replay import PrioritizedReplay
from lightning_pdist.rl.servers import ServerGroup, bounds

__all__ = ["GorilaStrategy"]


class GorilaStrategy(LearnerLoop, OwnedDDPArguments, PdistStrategy):
    """Gorila: ``L`` learner ranks, each with ``num_actors`` CPU actors and a local replay, Downpour to ``S`` servers.

    Args:
        num_actors: actor processes per learner.
        num_learners: learner ranks; ``None``: the Trainer's ``devices × num_nodes`` (a number must equal it).
        num_servers: parameter-server processes (contiguous shards of the Q-network and its optimizer state).
        epsilon: actor ``i`` of a learner explores with ``ε_i = epsilon^(1 + epsilon_alpha·i/(N−1))``.
        epsilon_alpha: the exponent's spread across the actors (0, the default: every actor ``ε``).
        n_step: steps of the n-step returns.
        gamma: their discount ``γ``.
        batch_size: transitions per update (the replay is uniform and per learner).
        capacity: each learner's replay size (oldest evicted first).
        learning_starts: transitions a learner's replay must hold before its first update.
        refresh_every: environment steps between an actor's parameter pulls.
        send_every: environment steps per message an actor sends.
        target_every: a learner's updates between its target-network syncs from the servers (``C``).
        seed: learner ``r``'s actor ``i`` seeds with ``seed + r·num_actors + i``, its replay with ``seed + r·num_actors``.
        deterministic: one chunk per update from the learner's actors in turn (with ``L = 1``: reproducible).
        actor_timeout: seconds an actor may stay silent before the run stops naming it.
        server_timeout: seconds a server may take to start or answer.

    Example::

        trainer = Trainer(accelerator="cpu", devices=2, max_steps=20_000, strategy=GorilaStrategy(num_actors=2))
        trainer.fit(DQNModule("CartPole-v1"))
    """

    strategy_name = "gorila"
    wraps_in_ddp = False
    config_class = GorilaConfig
    owned_reason = "the learners' gradients go to Gorila's parameter servers"

    def __init__(self, num_actors: int = 1, num_learners: int | None = None, num_servers: int = 2, epsilon: float = 0.1,
                 epsilon_alpha: float = 0.0, n_step: int = 3, gamma: float = 0.99, batch_size: int = 32,
                 capacity: int = 50_000, learning_starts: int = 500, refresh_every: int = 16, send_every: int = 16,
                 target_every: int = 500, seed: int = 0, deterministic: bool = False, actor_timeout: float = 120.0,
                 server_timeout: float = 120.0, **kwargs: Any) -> None:  # fmt: skip
        self.config = GorilaConfig(num_actors=num_actors, num_learners=1 if num_learners is None else num_learners,
                                   num_servers=num_servers, epsilon=epsilon, epsilon_alpha=epsilon_alpha, n_step=n_step,
                                   gamma=gamma, batch_size=batch_size, capacity=capacity, learning_starts=learning_starts,
                                   refresh_every=refresh_every, send_every=send_every, target_every=target_every, seed=seed,
                                   deterministic=deterministic, actor_timeout=actor_timeout, server_timeout=server_timeout,
                                   owner=type(self).__name__)  # fmt: skip
        self.num_learners = num_learners
        kwargs.setdefault("process_group_backend", "gloo")
        super().__init__(**kwargs)
        self.servers: ServerGroup | None = None
        self.client: ParameterServerClient | None = None
        self._init_learner(num_actors)
        self._versions: list[int] = []

    # ------------------------------------------------------------------ checks
    @override
    def _configure_launcher(self) -> None:
        world = self.num_nodes * self.num_processes
        if self.num_nodes > 1:
            raise ValueError(f"{type(self).__name__}: Trainer(num_nodes={self.num_nodes}): the learners must share the "
                             "first learner's machine (its parameter servers listen on 127.0.0.1); use num_nodes=1")  # fmt: skip
        if self.num_learners is not None and self.num_learners != world:
            raise ValueError(f"{type(self).__name__}(num_learners={self.num_learners}): num_learners must equal the "
                             f"Trainer's devices × num_nodes ({self.num_processes} × {self.num_nodes} = {world}): each "
                             "learner is one rank (or leave num_learners unset)")  # fmt: skip
        super()._configure_launcher()

    @override
    def connect(self, model: Any) -> None:
        check_learner(type(self).__name__, model)
        super().connect(model)

    # ------------------------------------------------------------------ setup
    def _q_params(self) -> list[Tensor]:
        return list(self.lightning_module.q_network.parameters())

    def _check_optimizer(self) -> Optimizer:
        owner, q = type(self).__name__, self._q_params()
        if self.root_device.type != "cpu":
            raise ValueError(f"{owner}: the learners run on CPU (their actors are forked from them); "
                             f"use Trainer(accelerator='cpu'), not {self.root_device}")  # fmt: skip
        if len(self.optimizers) != 1:
            raise ValueError(f"{owner}: configure_optimizers returned {len(self.optimizers)} optimizers; the servers "
                             "run one, over q_network's parameters")  # fmt: skip
        optimizer = self.optimizers[0]
        given = [p for g in optimizer.param_groups for p in g["params"]]
        if {id(p) for p in given} != {id(p) for p in q} or len(given) != len(q):
            raise ValueError(f"{owner}: the optimizer must hold exactly q_network's parameters (the servers keep the "
                             "online network; the target network is each learner's own)")  # fmt: skip
        return optimizer

    @override
    def setup_algorithm(self) -> None:
        cfg, module = self.config, self.lightning_module
        rank, world = self.rank_world
        optimizer = self._check_optimizer()
        state, self._loaded_pdist_state = self._loaded_pdist_state, None
        own, _ = rank_files.agree_on_rank_state(*self._loaded_rank_state, rank, world) if state is not None else (None, "")
        self._loaded_rank_state = (None, "")
        flat = parameters_to_vector(self._q_params()).detach()
        if rank == 0:
            self.servers = ServerGroup(cfg.num_servers, type(self).__name__, cfg.server_timeout)
            shared = [self.servers.addresses, self.servers.secret]
        else:
            shared = [None, None]
        addresses, secret = self.broadcast(shared, src=0)
        self.client = ParameterServerClient(addresses, rank, timeout=cfg.server_timeout, secret=secret)
        if rank == 0:
            group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
            self.servers.init(self.client, flat, [(group_of[id(p)], p.numel()) for p in self._q_params()], optimizer, world)
            if state is not None:
                ServerGroup.set_state(self.client, state["servers"])
        self.barrier("gorila_servers_ready")
        self.client.hello()
        self._load(self.client.pull(record=True))
        mine = cfg.worker_config(rank)
        self.replay = PrioritizedReplay(cfg.capacity, 0.0, seed=mine.seed)
        if state is not None:
            super().load_pdist_state_dict(state)
            self._load_rank(own)
        else:
            module.target_network.load_state_dict(module.q_network.state_dict())
        servers = {"addresses": addresses, "secret": secret, "worker": rank, "timeout": cfg.server_timeout}
        self.pool = ActorPool(mine, module, lambda: params_of(module), list(self.actor_states), observation_numel(module),
                              servers=servers)  # fmt: skip

    def _load(self, pulled: tuple[list[Tensor], list[dict]]) -> None:
        shards, metas = pulled
        vector_to_parameters(torch.cat([s.float() for s in shards]), self._q_params())
        self._versions = [int(m["version"]) for m in metas]

    # ------------------------------------------------------------------ one update
    def _sample(self) -> dict[str, Tensor]:
        self._fill_replay()
        sample, _, weights = self.replay.sample(self.config.batch_size, 1.0)
        return {**sample, "weights": weights}

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        out = super().training_step(self._sample(), batch_idx)
        self._log_learner()
        return out

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Forward and backward here; the step is the servers': push ``∇``, take their new parameters back."""
        model = model if model is not None else self.lightning_module
        out = self.precision_plugin._wrap_closure(model, optimizer, closure)
        grads = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self._q_params()])
        if not bool(torch.isfinite(grads).all()):
            raise FloatingPointError(f"{type(self).__name__}: learner {self.global_rank}'s gradient at update "
                                     f"{self.updates + 1} is not finite; nothing was pushed")  # fmt: skip
        parts = bounds(grads.numel(), self.client.num_servers)
        shards, metas = self.client.push([grads[a:b].contiguous() for a, b in parts], self._versions, None, pull=True)
        self._load((shards, metas))
        self.updates += 1
        if self.updates % self.config.target_every == 0:  # the servers' parameters, just pulled
            model.target_network.load_state_dict(model.q_network.state_dict())
        optimizer._opt_called = True  # the servers stepped: keeps LR schedulers from warning about call order
        return out

    # ------------------------------------------------------------------ checkpoints
    @override
    def pdist_state_dict(self) -> dict:
        state = super().pdist_state_dict()
        if self.client is not None and self.global_rank == 0:
            state["servers"] = ServerGroup.get_state(self.client)
        return state

    @override
    def pdist_rank_state(self) -> dict | None:
        if self.replay is None:
            return None
        target = {k: v.clone() for k, v in self.lightning_module.target_network.state_dict().items()}
        return {**self._learner_state(), "target": target}

    def _load_rank(self, own: dict | None) -> None:
        if own is None:
            raise ValueError(f"{type(self).__name__}: the checkpoint has no per-learner file for learner "
                             f"{self.global_rank} (replay, target network, actors); resume with the same number of "
                             "learners from a checkpoint saved during fit")  # fmt: skip
        self._load_learner_state(own, " per learner")
        self.lightning_module.target_network.load_state_dict(own["target"])

    # ------------------------------------------------------------------ the end
    def _close(self, orderly: bool) -> None:
        self._close_pool()
        client, self.client = self.client, None
        if client is not None and not orderly:
            client.close()
        if self.servers is not None:
            self.servers.close(client if orderly else None, wait=5.0 if orderly else 0.5)
            self.servers = None
        if client is not None and orderly:
            client.close()

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        self._close_pool()
        self.barrier("gorila_end")  # every learner pushed its last update: the servers may stop
        self._close(orderly=True)

    @override
    def teardown(self) -> None:
        self._close(orderly=False)
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        from lightning_pdist.core.strategy import register_variants

        register_variants(strategy_registry, cls, cls.strategy_name, "Gorila: learner ranks with their own actors and "
                          "replay, Downpour to sharded parameter servers", find_unused=False)  # fmt: skip
