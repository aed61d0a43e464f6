"""Distributed reinforcement learning: Ape-X and Gorila (``docs/algorithms/apex.md``).

Math: ``config.py`` (settings, ε_i), ``replay.py`` (proportional prioritized replay), ``nstep.py`` (n-step
transitions), ``dqn.py`` (double-Q TD error, weighted Huber loss). Transport: ``channel.py`` (authenticated bounded
frames), ``actor.py`` (an actor process), ``actors.py`` (the learner's side: fork, serve pulls, collect, name crashes),
``servers.py`` (Gorila's parameter-server processes, started with their documented program and configured over the
wire). Wiring: ``module.py`` (the learner hooks, ``DQNModule``), ``apex_strategy.py``, ``gorila_strategy.py``.
"""

from lightning_pdist.core.lazy import lazy_names

__getattr__, __dir__ = lazy_names(__name__, {  # imported on first use: importing a transport module stays Lightning-free
    "ApeXConfig": "config",
    "ApeXStrategy": "apex_strategy",
    "DQNModule": "module",
    "GorilaConfig": "config",
    "GorilaStrategy": "gorila_strategy",
    "PrioritizedReplay": "replay",
    "actor_epsilon": "config",
})

__all__ = ["ApeXConfig", "ApeXStrategy", "DQNModule", "GorilaConfig", "GorilaStrategy", "PrioritizedReplay", "actor_epsilon"]
