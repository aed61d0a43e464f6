"""Ape-X DQN as a Lightning strategy: N actor processes feed one prioritized replay; the Trainer's process learns.

Ape-X (Horgan, Quan, Budden, Barth-Maron, Hessel, van Hasselt, Silver, ICLR 2018, "Distributed Prioritized
Experience Replay"): actors with their own exploration rates ``ε_i = ε^(1+α·i/(N−1))`` act with copies of the
network, compute the initial priorities ``|δ|`` of their n-step transitions themselves and send them to a central
replay; one learner samples ``∝ p^α``, corrects with importance weights ``(N·P)^−β`` (β annealed to 1), writes the new
``|δ|`` back, serves its parameters to the actors and syncs its target network every ``C`` updates; the replay
evicts the oldest transitions. Here the LightningModule is the learner (:mod:`~lightning_pdist.rl.module` lists
its hooks), the Trainer runs on one CPU device, and the actors are forked from it at setup
(:mod:`~lightning_pdist.rl.actors`). Method card: ``docs/algorithms/apex.md``.

One learner update per Lightning step: collect what the actors sent (answering their parameter pulls with the current
weights), sample, run the module's ``training_step`` on the sample, write ``|δ|`` back, step the optimizer, count the
update (the parameters' version) and sync the target network when due. ``deterministic=True`` takes exactly one
chunk per update from the actors in turn (0, 1, …, N−1, 0, …): the run is then a function of the seed.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Callable

import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_pdist.rl.actor import params_of
from lightning_pdist.rl.actors import ActorPool
from lightning_pdist.rl.config import ApeXConfig
from lightning_pdist.rl.module import LEARNER_HOOKS, due_to_log, missing_hooks
from lightning_pdist.rl.replay import FIELDS, PrioritizedReplay, annealed_beta

__all__ = ["ApeXStrategy", "LearnerLoop", "check_learner", "store_chunks"]


def observation_numel(module: Any) -> int:
    """Values in one observation of the module's environment (bounds the actors' messages)."""
    env = module.make_env()
    try:
        return max(1, math.prod(env.observation_space.shape or (1,)))
    finally:
        env.close()


def check_learner(owner: str, module: Any) -> None:
    """``TypeError`` naming the learner hooks ``module`` lacks."""
    missing = missing_hooks(module)
    if missing:
        raise TypeError(f"{owner}: the LightningModule {type(module).__name__} has no {', '.join(missing)}; the "
                        f"learner hooks are {', '.join(LEARNER_HOOKS)} (subclass lightning_pdist.rl.DQNModule, or "
                        "see its module docstring for what each must be)")  # fmt: skip


def store_chunks(replay: PrioritizedReplay, chunks: list[tuple[dict[str, Any], dict[str, Tensor]]],
                 actor_states: list[dict[str, Any] | None], returns: deque[float]) -> None:
    """Add the chunks one ``ActorPool.collect`` returned to ``replay`` with a single ``add`` (the same slots, storage
    and sum tree as one ``add`` per chunk in arrival order, for one call's overhead instead of one per chunk), and
    keep each sender's state (generator, step and restart counts) and finished episode returns."""
    for meta, tensors in chunks:
        actor_states[int(meta["actor"])] = {"rng": tensors["rng"], "env_steps": meta["env_steps"],
                                            "restarts": meta["restarts"]}  # fmt: skip
        returns.extend(meta["episodes"])
    if chunks:
        replay.add({name: torch.cat([t[name] for _, t in chunks]) for name in FIELDS},
                   torch.cat([t["td"] for _, t in chunks]))  # fmt: skip


class LearnerLoop:
    """What a learner does around its updates, Ape-X's one and each of Gorila's: fill the replay from its actors, log
    the ``rl/*`` metrics, keep and restore its counters and its actors' states, close its actor pool. The host sets
    ``config`` (``num_actors``, ``deterministic``, ``learning_starts``, ``batch_size``), ``replay`` and ``pool``."""

    config: Any
    lightning_module: Any

    def _init_learner(self, num_actors: int) -> None:
        self.pool: ActorPool | None = None
        self.replay: PrioritizedReplay | None = None
        self.updates = 0
        self.turn = 0
        self.actor_states: list[dict[str, Any] | None] = [None] * num_actors
        self.returns: deque[float] = deque(maxlen=100)

    def _fill_replay(self) -> None:
        """Store what the actors sent (with ``deterministic``: one chunk per call from each actor in turn) until the
        replay holds ``max(learning_starts, batch_size)`` transitions."""
        cfg = self.config
        while True:
            actor = None
            if cfg.deterministic:
                actor, self.turn = self.turn, (self.turn + 1) % cfg.num_actors
            store_chunks(self.replay, self.pool.collect(actor), self.actor_states, self.returns)
            if len(self.replay) >= max(cfg.learning_starts, cfg.batch_size):
                return

    def _log_learner(self) -> None:
        module = self.lightning_module
        if not due_to_log(module.trainer, self.updates):
            return
        module.log("rl/env_steps", float(sum(int(s["env_steps"]) for s in self.actor_states if s)), prog_bar=True)
        module.log("rl/replay_size", float(len(self.replay)))
        if self.returns:
            module.log("rl/episode_return", sum(self.returns) / len(self.returns), prog_bar=True)

    def _learner_state(self) -> dict[str, Any]:
        return {"replay": self.replay.state_dict(), "updates": self.updates, "turn": self.turn,
                "actors": list(self.actor_states), "returns": list(self.returns)}

    def _load_learner_state(self, state: dict[str, Any], per: str = "") -> None:
        """Restore :meth:`_learner_state`'s output; ``per`` completes "the checkpoint holds N actors"."""
        if len(state["actors"]) != self.config.num_actors:
            raise ValueError(f"{type(self).__name__}(num_actors={self.config.num_actors}): the checkpoint holds "
                             f"{len(state['actors'])} actors{per}; resume with the same num_actors")
        self.replay.load_state_dict(state["replay"])
        self.updates, self.turn = int(state["updates"]), int(state["turn"])
        self.actor_states = list(state["actors"])
        self.returns = deque(state["returns"], maxlen=100)

    def _close_pool(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None


class ApeXStrategy(LearnerLoop, SingleDeviceStrategy):
    """Ape-X: ``num_actors`` CPU actor processes, a central prioritized replay, the Trainer's process as the learner.

    Args:
        num_actors: actor processes (``N``).
        alpha: priority exponent (0: uniform).
        beta: importance-sampling exponent at the first update, annealed linearly to 1 over ``beta_steps`` updates.
        beta_steps: updates over which ``beta`` reaches 1.
        epsilon: actor ``i`` explores with ``ε_i = epsilon^(1 + epsilon_alpha·i/(N−1))``.
        epsilon_alpha: the exponent's spread across the actors (see ``epsilon``).
        n_step: steps of the n-step returns.
        gamma: their discount ``γ``.
        batch_size: transitions per update.
        capacity: the replay's size (oldest evicted first).
        learning_starts: transitions the replay must hold before the first update.
        refresh_every: environment steps between an actor's parameter pulls.
        send_every: environment steps per message an actor sends.
        target_every: updates between target-network syncs (``C``).
        seed: actor ``i`` seeds its exploration and its first reset with ``seed + i``; the replay samples with ``seed``.
        deterministic: one chunk per update from the actors in turn (reproducible; slower).
        actor_timeout: seconds an actor may stay silent before the run stops naming it.
        timeout: accepted for parity with the other strategies (no collective runs here).

    Example::

        trainer = Trainer(accelerator="cpu", devices=1, max_steps=20_000, strategy=ApeXStrategy(num_actors=4))
        trainer.fit(DQNModule("CartPole-v1"))
    """

    strategy_name = "apex"
    config_class = ApeXConfig

    def __init__(self, num_actors: int = 2, alpha: float = 0.6, beta: float = 0.4, beta_steps: int = 10_000,
                 epsilon: float = 0.4, epsilon_alpha: float = 7.0, n_step: int = 3, gamma: float = 0.99,
                 batch_size: int = 32, capacity: int = 50_000, learning_starts: int = 500, refresh_every: int = 16,
                 send_every: int = 16, target_every: int = 500, seed: int = 0, deterministic: bool = False,
                 actor_timeout: float = 120.0, timeout: Any = None, accelerator: Any = None, checkpoint_io: Any = None,
                 precision_plugin: Any = None) -> None:  # fmt: skip
        self.config = ApeXConfig(num_actors=num_actors, alpha=alpha, beta=beta, beta_steps=beta_steps, epsilon=epsilon,
                                 epsilon_alpha=epsilon_alpha, n_step=n_step, gamma=gamma, batch_size=batch_size,
                                 capacity=capacity, learning_starts=learning_starts, refresh_every=refresh_every,
                                 send_every=send_every, target_every=target_every, seed=seed, deterministic=deterministic,
                                 actor_timeout=actor_timeout, owner=type(self).__name__)  # fmt: skip
        super().__init__(device="cpu", accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        self._init_learner(num_actors)
        self._resume: dict[str, Any] | None = None

    @classmethod
    def register_strategies(cls, registry: Any) -> None:
        registry.register(cls.strategy_name, cls, description="Ape-X: CPU actors, central prioritized replay, one learner",
                          override=True)  # fmt: skip

    @override
    def connect(self, model: Any) -> None:
        check_learner(type(self).__name__, model)
        super().connect(model)

    @override
    def setup(self, trainer: Any) -> None:
        devices = len(getattr(trainer._accelerator_connector, "_parallel_devices", None) or [None])
        if devices > 1:  # Lightning hands a single-device strategy the first of several devices without a word
            raise ValueError(f"{type(self).__name__}: Trainer(devices={devices}): the learner is one process and the "
                             f"strategy starts its own actor processes (num_actors={self.config.num_actors}); use "
                             "devices=1 and raise num_actors for more acting")  # fmt: skip
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        module, cfg = self.lightning_module, self.config
        self.replay = PrioritizedReplay(cfg.capacity, cfg.alpha, cfg.priority_eps, cfg.seed)
        if self._resume is not None:
            self.load_rl_state(self._resume)
        else:
            module.target_network.load_state_dict(module.q_network.state_dict())
        self.pool = ActorPool(cfg, module, lambda: params_of(module), list(self.actor_states), observation_numel(module))

    def _sample(self) -> tuple[dict[str, Tensor], Tensor, Tensor]:
        cfg = self.config
        self._fill_replay()
        return self.replay.sample(cfg.batch_size, annealed_beta(cfg.beta, self.updates, cfg.beta_steps))

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        sample, slots, weights = self._sample()
        out = super().training_step({**sample, "weights": weights}, batch_idx)
        td = out.get("td_errors") if isinstance(out, dict) else None
        if not isinstance(td, Tensor) or td.shape != slots.shape:
            got = sorted(out) if isinstance(out, dict) else type(out).__name__
            raise TypeError(f"{type(self).__name__}: {type(self.lightning_module).__name__}.training_step must return "
                            f"{{'loss': ..., 'td_errors': δ}} with one TD error per sampled transition "
                            f"({slots.numel()}); it returned {got}")  # fmt: skip
        self.replay.update(slots, td)
        self._log_learner()
        return out

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.updates += 1
        if self.updates % self.config.target_every == 0:
            module = self.lightning_module
            module.target_network.load_state_dict(module.q_network.state_dict())
        return out

    def rl_state(self) -> dict[str, Any]:
        return {"strategy": type(self).__name__, **self._learner_state()}

    def load_rl_state(self, state: dict[str, Any]) -> None:
        if state.get("strategy") != type(self).__name__:
            raise ValueError(f"{type(self).__name__}: the checkpoint was written by {state.get('strategy')}; resume it "
                             "with that strategy")  # fmt: skip
        self._load_learner_state(state)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if self.replay is not None:
            checkpoint["rl"] = self.rl_state()
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._resume = checkpoint.get("rl")
        return checkpoint

    @override
    def teardown(self) -> None:
        self._close_pool()
        super().teardown()
