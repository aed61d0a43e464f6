"""Distributed reinforcement learning on the learner's parameters: Ape-X (``docs/algorithms/apex.md``).

Math: ``config.py`` (settings, ε_i), ``replay.py`` (proportional prioritized replay), ``nstep.py`` (n-step
transitions), ``dqn.py`` (double-Q TD error, weighted Huber loss). Transport: ``channel.py`` (authenticated bounded
frames), ``actor.py`` (an actor process), ``actors.py`` (the learner's side: fork, serve pulls, collect, name crashes).
Wiring: ``module.py`` (the learner hooks, ``DQNModule``), ``apex_strategy.py``.
"""

from lightning_pdist.core.lazy import lazy_names

__getattr__, __dir__ = lazy_names(__name__, {  # imported on first use: importing a transport module stays Lightning-free
    "ApeXConfig": "config",
    "ApeXStrategy": "apex_strategy",
    "DQNModule": "module",
    "PrioritizedReplay": "replay",
    "actor_epsilon": "config",
})

__all__ = ["ApeXConfig", "ApeXStrategy", "DQNModule", "PrioritizedReplay", "actor_epsilon"]
