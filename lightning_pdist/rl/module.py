"""The learner's LightningModule contract, and :class:`DQNModule`, a double DQN that fulfils it.

A module trained by ``ApeXStrategy`` / ``GorilaStrategy`` is the learner; these are its **learner hooks**
(:data:`LEARNER_HOOKS`; a module missing one is refused at setup, naming it):

``make_env()``
    a new gymnasium environment (called once in each actor process) with a ``Discrete`` action space.
``q_network``
    the online Q-network, an ``nn.Module`` attribute mapping a batch of observations to ``(B, num_actions)``
    values; the actors act with copies of it.
``target_network``
    an ``nn.Module`` attribute of the same architecture, not trained by the optimizer: the strategy copies
    ``q_network`` into it at the start and every ``target_every`` updates (it is in the module's ``state_dict``, so
    checkpoints hold it).
``td_errors(batch, q_net, target_net)``
    the TD error of each transition of ``batch`` (``obs``, ``action``, ``ret``, ``next_obs``, ``discount``):
    actors call it with their copies for the initial priorities, the learner's ``training_step`` with its own networks.

and ``training_step(batch, batch_idx)`` returns ``{"loss": ..., "td_errors": δ}``: the strategy gives it a sampled
batch (the fields above and ``weights``, the importance weights) and writes ``|δ|`` back as the new priorities.
``train_dataloader`` only paces the loop (:class:`Ticks`): the strategy replaces each tick by a replay sample.
"""

from __future__ import annotations

import copy
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, IterableDataset

from lightning_pdist.rl.dqn import double_q_td, weighted_huber

__all__ = ["DQNModule", "LEARNER_HOOKS", "Ticks", "check_env_id", "due_to_log", "missing_hooks"]

LEARNER_HOOKS = ("make_env", "q_network", "target_network", "td_errors")


def missing_hooks(module: Any) -> list[str]:
    """The learner hooks ``module`` lacks (an attribute that is not an ``nn.Module`` counts as missing)."""
    missing = [h for h in ("make_env", "td_errors") if not callable(getattr(module, h, None))]
    missing += [h for h in ("q_network", "target_network") if not isinstance(getattr(module, h, None), nn.Module)]
    return [h for h in LEARNER_HOOKS if h in missing]


def due_to_log(trainer: Any, updates: int) -> bool:
    """Whether the update after ``updates`` logs the strategies' ``rl/*`` metrics (``train/loss`` is logged at every
    update, so that callbacks monitoring it always see the current value): every
    ``Trainer(log_every_n_steps)`` updates, the cadence at which Lightning writes them to the logger anyway (between
    two writes a value is only overwritten). Four ``self.log`` calls per update took 6 ms of a 21 ms Ape-X update
    with 4 actors on this machine's 2 cores (the rl benchmark's profile)."""
    every = int(getattr(trainer, "log_every_n_steps", 1) or 0)
    return every > 0 and (updates + 1) % every == 0


def _gymnasium() -> Any:
    try:
        import gymnasium
    except ModuleNotFoundError as error:
        raise ImportError("the RL strategies' environments need gymnasium, which is not installed: "
                          "pip install 'lightning_pdist[rl]'") from error  # fmt: skip
    return gymnasium


def check_env_id(owner: str, env_id: object) -> None:
    """``ValueError`` naming the id if gymnasium does not know it (nothing is created or downloaded)."""
    gym = _gymnasium()
    if not isinstance(env_id, str):
        raise TypeError(f"{owner}(env_id={env_id!r}): env_id must be a gymnasium environment id such as 'CartPole-v1'")
    try:
        gym.spec(env_id)
    except gym.error.Error as error:
        raise ValueError(f"{owner}(env_id={env_id!r}): gymnasium does not know this environment id ({error}); "
                         "install the package that registers it (e.g. ale-py for ALE/...) or fix the id") from None


class Ticks(IterableDataset):
    """``steps`` placeholders per epoch: the RL strategies turn each into a sample of their replay."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def __iter__(self):
        return iter(torch.arange(self.steps))

    def __len__(self) -> int:
        return self.steps


def mlp(inputs: int, outputs: int, hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, outputs))


class DQNModule(L.LightningModule):
    """Double DQN with n-step returns on a gymnasium environment with a flat observation and discrete actions.

    Args:
        env_id: any gymnasium id (``CartPole-v1`` by default; ``ALE/...`` once ``ale-py`` is installed, with a network
            of your own for pixels: override ``q_network``).
        hidden: width of the two hidden layers of the MLP Q-network.
        lr: Adam's learning rate.
        steps_per_epoch: learner updates per epoch (the strategies sample the replay; there is no dataset).
    """

    def __init__(self, env_id: str = "CartPole-v1", hidden: int = 64, lr: float = 1e-3, steps_per_epoch: int = 1000) -> None:
        super().__init__()
        check_env_id(type(self).__name__, env_id)
        self.save_hyperparameters()
        env = self.make_env()
        space = env.observation_space
        if len(space.shape or ()) != 1 or not hasattr(env.action_space, "n"):
            raise ValueError(f"{type(self).__name__}(env_id={env_id!r}): the MLP needs a flat Box observation and a "
                             f"Discrete action space, not {space} / {env.action_space}; override q_network")  # fmt: skip
        self.q_network = mlp(space.shape[0], int(env.action_space.n), hidden)
        self.target_network = copy.deepcopy(self.q_network).requires_grad_(False)
        env.close()

    def make_env(self) -> Any:
        return _gymnasium().make(self.hparams.env_id)

    def td_errors(self, batch: dict[str, Tensor], q_net: nn.Module, target_net: nn.Module) -> Tensor:
        return double_q_td(q_net, target_net, batch)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        td = self.td_errors(batch, self.q_network, self.target_network)
        loss = weighted_huber(td, batch["weights"])
        self.log("train/loss", loss, prog_bar=True)  # every update: callbacks may monitor it (rl/* at due_to_log)
        return {"loss": loss, "td_errors": td.detach()}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.q_network.parameters(), lr=self.hparams.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Ticks(self.hparams.steps_per_epoch), batch_size=None)
