"""Ape-X's and Gorila's settings, checked at construction, and Ape-X's exploration schedule (no torch here).

Errors name the argument, the value and the rule: ``ApeXStrategy(num_actors=0): num_actors must be an int >= 1``.

Exploration (Horgan et al. 2018, §4): actor ``i`` of ``N`` acts ε-greedily with ``ε_i = ε^(1 + α·i/(N−1))``,
``ε = 0.4``, ``α = 7``: actor 0 explores with 0.4, actor ``N−1`` with ``0.4⁸ ≈ 0.00066``. With one actor the
exponent is 1 (``ε_0 = ε``; the formula's ``0/0`` is read as 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from lightning_pdist.core.config import ConfigErrors, is_int

__all__ = ["ApeXConfig", "GorilaConfig", "MAX_ACTORS", "MAX_CAPACITY", "MAX_SEND_EVERY", "MAX_SERVERS", "actor_epsilon"]

MAX_ACTORS = 256  # actor processes are forked on the learner's machine
MAX_CAPACITY = 1 << 24  # the replay (and its sum tree) lives in the learner's memory
MAX_SEND_EVERY = 4096  # environment steps in one message (bounds what the learner reads at once)


def actor_epsilon(i: int, num_actors: int, epsilon: float = 0.4, alpha: float = 7.0) -> float:
    """``ε_i = ε^(1 + α·i/(N−1))`` (``ε`` for ``N = 1``)."""
    if num_actors == 1:
        return float(epsilon)
    return float(epsilon) ** (1.0 + alpha * i / (num_actors - 1))


def _real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class _Common(ConfigErrors):
    """What Ape-X and Gorila share: actors, n-step returns, the target network, the seed."""

    num_actors: int = 2
    n_step: int = 3
    gamma: float = 0.99
    batch_size: int = 32
    capacity: int = 50_000
    learning_starts: int = 500
    refresh_every: int = 16
    send_every: int = 16
    target_every: int = 500
    epsilon: float = 0.4
    epsilon_alpha: float = 7.0
    seed: int = 0
    deterministic: bool = False
    actor_timeout: float = 120.0
    owner: str = "ApeXStrategy"

    def _int_at_least(self, arg: str, low: int, what: str, high: int | None = None) -> None:
        value = getattr(self, arg)
        if not is_int(value) or value < low or (high is not None and value > high):
            rule = f"an int >= {low}" if high is None else f"an int in [{low}, {high}]"
            self._fail(arg, f"{arg} must be {rule} ({what})", TypeError if not is_int(value) else ValueError)

    def _in_unit(self, arg: str, what: str, closed_low: bool = True) -> None:
        value = getattr(self, arg)
        if not _real(value) or not (0.0 <= value <= 1.0) or (not closed_low and value == 0.0):
            low = "[0, 1]" if closed_low else "(0, 1]"
            self._fail(arg, f"{arg} must be a number in {low} ({what})", TypeError if not _real(value) else ValueError)

    def __post_init__(self) -> None:
        self._int_at_least("num_actors", 1, "actor processes, all on this machine", MAX_ACTORS)
        self._int_at_least("n_step", 1, "steps summed into each return")
        self._in_unit("gamma", "the discount")
        self._int_at_least("batch_size", 1, "transitions per learner update")
        self._int_at_least("capacity", 1, "transitions the replay holds, in the learner's memory", MAX_CAPACITY)
        if self.capacity < self.batch_size:
            self._fail("capacity", f"capacity must be >= batch_size ({self.batch_size})")
        self._int_at_least("learning_starts", 1, "transitions in the replay before the first update")
        if self.learning_starts > self.capacity:
            self._fail("learning_starts", f"learning_starts must be <= capacity ({self.capacity}): the replay could "
                                          "never hold that many")  # fmt: skip
        self._int_at_least("refresh_every", 1, "environment steps between an actor's parameter pulls")
        self._int_at_least("send_every", 1, "environment steps an actor batches into one message", MAX_SEND_EVERY)
        self._int_at_least("target_every", 1, "learner updates between target-network syncs")
        self._in_unit("epsilon", "the base exploration rate of ε_i = ε^(1 + α·i/(N−1))")
        if not _real(self.epsilon_alpha) or self.epsilon_alpha < 0:
            self._fail("epsilon_alpha", "epsilon_alpha must be a finite number >= 0 (the α of ε_i = ε^(1 + α·i/(N−1)))",
                       TypeError if not _real(self.epsilon_alpha) else ValueError)  # fmt: skip
        if not is_int(self.seed) or self.seed < 0:
            self._fail("seed", "seed must be an int >= 0", TypeError if not is_int(self.seed) else ValueError)
        if not isinstance(self.deterministic, bool):
            self._fail("deterministic", "deterministic must be True (the learner takes the actors' messages in a "
                                        "fixed order, one per update) or False", TypeError)  # fmt: skip
        if not _real(self.actor_timeout) or not 1 <= self.actor_timeout <= 86_400:
            self._fail("actor_timeout", "actor_timeout must be a number of seconds in [1, 86400]",
                       TypeError if not _real(self.actor_timeout) else ValueError)  # fmt: skip

    def epsilons(self) -> list[float]:
        return [actor_epsilon(i, self.num_actors, self.epsilon, self.epsilon_alpha) for i in range(self.num_actors)]


@dataclass(frozen=True)
class ApeXConfig(_Common):
    """Ape-X: the central prioritized replay's α, β (annealed from ``beta`` to 1 over ``beta_steps`` updates)."""

    alpha: float = 0.6
    beta: float = 0.4
    beta_steps: int = 10_000
    priority_eps: float = 1e-6

    def __post_init__(self) -> None:
        super().__post_init__()
        if not _real(self.alpha) or not 0 <= self.alpha <= 1:
            self._fail("alpha", "alpha must be a number in [0, 1] (priority exponent: P(i) ∝ p_i^α; 0 is uniform, "
                                "1 fully proportional)", TypeError if not _real(self.alpha) else ValueError)  # fmt: skip
        self._in_unit("beta", "the importance-sampling exponent at the first update, annealed to 1")
        self._int_at_least("beta_steps", 1, "learner updates over which β reaches 1")
        if not _real(self.priority_eps) or self.priority_eps <= 0:
            self._fail("priority_eps", "priority_eps must be a finite number > 0 (added to |δ| so that no "
                                       "transition has probability 0)", TypeError if not _real(self.priority_eps) else ValueError)  # fmt: skip


MAX_SERVERS = 64  # parameter-server processes started on the first learner's machine


@dataclass(frozen=True)
class GorilaConfig(_Common):
    """Gorila: ``num_learners`` learner ranks, each with ``num_actors`` actors and their local (uniform) replay, and
    ``num_servers`` parameter-server processes holding contiguous shards of the Q-network and its optimizer."""

    num_learners: int = 1
    num_servers: int = 2
    server_timeout: float = 120.0
    owner: str = "GorilaStrategy"

    def __post_init__(self) -> None:
        super().__post_init__()
        self._int_at_least("num_learners", 1, "learner ranks: the Trainer's devices × num_nodes")
        self._int_at_least("num_servers", 1, "parameter-server processes, each holding one shard", MAX_SERVERS)
        if not _real(self.server_timeout) or not 1 <= self.server_timeout <= 86_400:
            self._fail("server_timeout", "server_timeout must be a number of seconds in [1, 86400] (how long a server "
                                         "may take to start or to answer)", TypeError if not _real(self.server_timeout)
                       else ValueError)  # fmt: skip

    def worker_config(self, rank: int) -> "GorilaConfig":
        """Learner ``rank``'s view: its actors seed with ``seed + rank·num_actors + i`` (every actor its own stream),
        its replay with ``seed + rank·num_actors``."""
        return replace(self, seed=self.seed + rank * self.num_actors)
