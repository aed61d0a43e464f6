"""One process of the rl suite: ``python -m lightning_pdist.bench.rl_worker --spec JSON --out-dir DIR``.

Started by :class:`~lightning_pdist.bench.launch.Launcher`, once per learner. The process trains
:class:`~lightning_pdist.rl.DQNModule` on CartPole-v1 through a real ``Trainer`` with the method of ``spec["method"]``
(:data:`METHODS`), every method from the same seed, network and learner settings:

* ``dqn``: one process, Lightning's default strategy. :class:`SingleDQN` (the same module) acts in its own
  environment inside its data loader: per update, ``steps_per_update`` ε-greedy steps (ε linear from
  ``dqn_epsilon_start`` to ``dqn_epsilon_end`` over ``dqn_epsilon_steps`` steps) into the same n-step builder and
  prioritized replay the Ape-X learner keeps (inserted every ``SEND_EVERY`` steps with their |δ| at the acting
  weights, as an actor's message is), then one sample; the priorities are written back and the target
  network synced every ``target_every`` updates, as :class:`~lightning_pdist.rl.ApeXStrategy` does.
* ``apex``: ``ApeXStrategy(num_actors=N)``, one learner and ``N`` forked actor processes.
* ``gorila``: ``GorilaStrategy(num_actors=N)`` on ``learners`` launched ranks (renumbered as local ranks of one node:
  ``Trainer(devices=learners)``), each with ``N`` actors; learner 0 starts the parameter-server processes.

:class:`Watch` keeps the clock, from the start of training (actors and servers already started) to the end. Every
``eval_every_s`` seconds of it learner 0 plays ``screen_episodes`` greedy episodes with its current ``q_network``
(start states from the fixed seeds ``10_000 + j``); when their mean reaches ``threshold`` it plays the rest of the
``solve_episodes`` (same seeds, so always the same 100 start states) and, if their mean reaches it too, the run is
solved at the time that evaluation began (:func:`~lightning_pdist.bench.rl.time_to_solve`). Evaluation time stays
in the clock: every method pays the same schedule. The run stops when solved or after ``budget_s``; learner 0 then
writes ``DIR/stop``, which the other learners read after each update.

Writes ``DIR/rank<r>.json``: ``{"rank", "method", "train_s", "updates", "env_steps", "episodes", "train_return",
"evals": [[t_s, updates, env_steps, screen_mean, full_mean_or_null], ...], "solved_at_s", "setup_s"}``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from lightning_pdist.bench.launch import WorkerSpec, as_one_node, bench_trainer, worker_main

#: method -> what it runs.
METHODS: dict[str, str] = {
    "dqn": "single-process double DQN: the same module acting in its own data loader (Lightning's default strategy)",
    "apex": "ApeXStrategy(num_actors=N): N forked actors, central prioritized replay, one learner",
    "gorila": "GorilaStrategy(num_actors=N) on L learner ranks, Downpour to 2 parameter-server processes",
}
EVAL_SEED = 10_000
SEND_EVERY = 16  # environment steps per actor message (Ape-X, Gorila) and per replay insertion (dqn)


@dataclass(frozen=True)
class Spec(WorkerSpec):
    """One launch: ``method`` with ``num_actors`` actors per learner on ``learners`` processes, for ``budget_s``."""

    WHO: ClassVar[str] = "rl_worker"
    method: str
    num_actors: int
    learners: int
    budget_s: float
    eval_every_s: float
    screen_episodes: int
    solve_episodes: int
    threshold: float
    seed: int
    hidden: int
    lr: float
    batch_size: int
    n_step: int
    gamma: float
    target_every: int
    learning_starts: int
    capacity: int
    steps_per_update: int
    dqn_epsilon_start: float
    dqn_epsilon_end: float
    dqn_epsilon_steps: int

    def __post_init__(self) -> None:
        self.one_of("method", tuple(METHODS))
        self.ints("num_actors", "learners", "screen_episodes", "hidden", "batch_size", "n_step", "target_every",
                  "learning_starts", "capacity", "steps_per_update", "dqn_epsilon_steps")  # fmt: skip
        self.ints("seed", low=0)
        if self.solve_episodes < self.screen_episodes:
            raise self.bad("solve_episodes", "solve_episodes must be >= screen_episodes")
        if self.method != "gorila" and self.learners != 1:
            raise self.bad("learners", "learners must be 1 except for method 'gorila'")
        if self.method == "dqn" and self.num_actors != 1:
            raise self.bad("num_actors", "num_actors must be 1 for method 'dqn' (it acts in its own process)")
        for key in ("budget_s", "eval_every_s", "lr"):
            if not getattr(self, key) > 0:
                raise self.bad(key, f"{key} must be > 0")
        for key in ("gamma", "dqn_epsilon_start", "dqn_epsilon_end"):
            if not 0 <= getattr(self, key) <= 1:
                raise self.bad(key, f"{key} must be in [0, 1]")


check_spec = Spec.check


def play(q: Any, env: Any, seed: int) -> float:
    """The return of one greedy episode of ``q`` from ``env.reset(seed=seed)``."""
    import torch

    obs, _ = env.reset(seed=seed)
    total, done = 0.0, False
    with torch.no_grad():
        while not done:
            action = int(q(torch.as_tensor(obs, dtype=torch.float32).unsqueeze(0)).argmax(dim=1))
            obs, reward, terminated, truncated, _ = env.step(action)
            total += float(reward)
            done = terminated or truncated
    return total


def single_dqn_class() -> type:
    """:class:`SingleDQN`, built on first use (it subclasses a LightningModule)."""
    import torch
    from torch.utils.data import DataLoader, IterableDataset

    from lightning_pdist.rl import DQNModule
    from lightning_pdist.rl.nstep import NStep, stack
    from lightning_pdist.rl.replay import PrioritizedReplay, annealed_beta

    class Acting(IterableDataset):
        """The module's own actor and replay: per item, ``steps_per_update`` ε-greedy steps, then one sample."""

        def __init__(self, module: Any, spec: dict[str, Any]) -> None:
            self.module, self.spec = module, spec
            self.replay = PrioritizedReplay(spec["capacity"], 0.6, 1e-6, spec["seed"])
            self.generator = torch.Generator().manual_seed(spec["seed"])
            self.env = module.make_env()
            obs, _ = self.env.reset(seed=spec["seed"])
            self.obs = torch.as_tensor(obs, dtype=torch.float32)
            self.nstep = NStep(spec["n_step"], spec["gamma"])
            self.env_steps, self.episode_return, self.returns, self.pending = 0, 0.0, [], []

        def epsilon(self) -> float:
            s = self.spec
            frac = min(1.0, self.env_steps / s["dqn_epsilon_steps"])
            return s["dqn_epsilon_start"] + frac * (s["dqn_epsilon_end"] - s["dqn_epsilon_start"])

        @torch.no_grad()
        def step(self) -> None:
            q = self.module.q_network
            if float(torch.rand((), generator=self.generator)) < self.epsilon():
                action = int(torch.randint(self.env.action_space.n, (), generator=self.generator))
            else:
                action = int(q(self.obs.unsqueeze(0)).argmax(dim=1))
            nxt, reward, terminated, truncated, _ = self.env.step(action)
            nxt = torch.as_tensor(nxt, dtype=torch.float32)
            out = self.nstep.push(self.obs, action, float(reward), nxt, bool(terminated), bool(truncated))
            self.env_steps += 1
            self.episode_return += float(reward)
            if terminated or truncated:
                self.returns.append(self.episode_return)
                self.episode_return = 0.0
                obs, _ = self.env.reset()
                self.obs = torch.as_tensor(obs, dtype=torch.float32)
            else:
                self.obs = nxt
            self.pending += out
            if self.env_steps % SEND_EVERY == 0 and self.pending:  # as an Ape-X actor's chunk: |δ| at the acting weights
                batch = stack(self.pending, tuple(self.obs.shape))
                self.replay.add(batch, self.module.td_errors(batch, q, self.module.target_network))
                self.pending = []

        def __iter__(self):
            s = self.spec
            while True:
                for _ in range(s["steps_per_update"]):
                    self.step()
                if len(self.replay) >= max(s["learning_starts"], s["batch_size"]):
                    beta = annealed_beta(0.4, self.module.updates, 10_000)
                    sample, slots, weights = self.replay.sample(s["batch_size"], beta)
                    yield {**sample, "weights": weights, "slots": slots}

    class SingleDQN(DQNModule):
        """``DQNModule`` whose data loader acts: the single-process baseline, trained by a plain ``Trainer``."""

        def __init__(self, spec: dict[str, Any]) -> None:
            super().__init__(hidden=spec["hidden"], lr=spec["lr"])
            self.spec, self.updates = spec, 0
            self.target_network.load_state_dict(self.q_network.state_dict())
            self.acting = Acting(self, spec)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(self.acting, batch_size=None)

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.acting.replay.update(batch["slots"], outputs["td_errors"])
            self.updates += 1
            if self.updates % self.spec["target_every"] == 0:
                self.target_network.load_state_dict(self.q_network.state_dict())

    return SingleDQN


def counters(module: Any, strategy: Any, method: str) -> tuple[int, int, list[float]]:
    """``(updates, env_steps, recent training-episode returns)`` of this learner now."""
    if method == "dqn":
        return module.updates, module.acting.env_steps, module.acting.returns[-100:]
    steps = sum(int(s["env_steps"]) for s in strategy.actor_states if s)
    return strategy.updates, steps, list(strategy.returns)


def watch_class() -> type:
    from lightning.pytorch import Callback

    from lightning_pdist.bench.rl import solved

    class Watch(Callback):
        """The clock, learner 0's greedy evaluations, and the stop (solved, budget, or learner 0's stop file)."""

        def __init__(self, spec: dict[str, Any], rank: int, out_dir: Path) -> None:
            self.spec, self.rank, self.stop_file = spec, rank, out_dir / "stop"
            self.evals: list[list[Any]] = []
            self.solved_at: float | None = None

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.env = pl_module.make_env() if self.rank == 0 else None
            self.t0 = time.perf_counter()
            self.next_eval = self.spec["eval_every_s"]

        def evaluate(self, trainer: Any, pl_module: Any, now: float) -> None:
            s, q = self.spec, pl_module.q_network
            updates, steps, _ = counters(pl_module, trainer.strategy, s["method"])
            returns = [play(q, self.env, EVAL_SEED + j) for j in range(s["screen_episodes"])]
            screen = sum(returns) / len(returns)
            full = None
            if screen >= s["threshold"]:
                returns += [play(q, self.env, EVAL_SEED + j) for j in range(len(returns), s["solve_episodes"])]
                full = sum(returns) / len(returns)
            self.evals.append([round(now, 3), updates, steps, screen, full])
            if solved(self.evals[-1], s["threshold"]):
                self.solved_at = now

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *_: Any) -> None:
            now = time.perf_counter() - self.t0
            if self.rank == 0 and now >= self.next_eval:
                self.evaluate(trainer, pl_module, now)
                while self.next_eval <= now:
                    self.next_eval += self.spec["eval_every_s"]
            stop = self.solved_at is not None or time.perf_counter() - self.t0 >= self.spec["budget_s"]
            if self.rank == 0 and stop:
                self.stop_file.touch()
            if stop or (self.rank != 0 and self.stop_file.exists()):
                trainer.should_stop = True

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.train_s = time.perf_counter() - self.t0
            self.final = counters(pl_module, trainer.strategy, self.spec["method"])
            if self.rank == 0:
                self.stop_file.touch()
                self.env.close()

    return Watch


def build(spec: dict[str, Any]) -> tuple[Any, Any]:
    """``(module, strategy)`` of ``spec``'s method."""
    from lightning_pdist.rl import ApeXStrategy, DQNModule, GorilaStrategy

    common = dict(n_step=spec["n_step"], gamma=spec["gamma"], batch_size=spec["batch_size"], capacity=spec["capacity"],
                  learning_starts=spec["learning_starts"], target_every=spec["target_every"], seed=spec["seed"],
                  num_actors=spec["num_actors"], refresh_every=SEND_EVERY, send_every=SEND_EVERY)  # fmt: skip
    if spec["method"] == "dqn":
        return single_dqn_class()(spec), "auto"
    module = DQNModule(hidden=spec["hidden"], lr=spec["lr"], steps_per_epoch=10_000)
    if spec["method"] == "apex":
        return module, ApeXStrategy(alpha=0.6, beta=0.4, epsilon=0.4, **common)
    return module, GorilaStrategy(num_learners=spec["learners"], num_servers=2, epsilon=0.1, **common)


def run(spec: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """The learner process of one row: build, fit until solved or out of budget, report."""
    started = time.perf_counter()
    rank, learners = int(os.environ.get("RANK", "0")), spec["learners"]
    as_one_node(learners if spec["method"] == "gorila" else None)  # Gorila's learners: local ranks of one node
    from lightning.fabric.utilities.seed import seed_everything

    seed_everything(spec["seed"], verbose=False)
    out_dir.mkdir(parents=True, exist_ok=True)
    module, strategy = build(spec)
    watch = watch_class()(spec, rank, out_dir)
    trainer = bench_trainer(devices=learners, num_nodes=1, strategy=strategy, max_epochs=-1, max_steps=-1, callbacks=[watch])
    setup_t = time.perf_counter()
    trainer.fit(module)
    updates, steps, returns = watch.final
    return {"rank": rank, "method": spec["method"], "train_s": round(watch.train_s, 3), "updates": updates,
            "env_steps": steps, "train_return": round(sum(returns) / len(returns), 2) if returns else None,
            "episodes": len(returns), "evals": watch.evals,
            "solved_at_s": None if watch.solved_at is None else round(watch.solved_at, 3),
            "setup_s": round(setup_t - started, 3)}  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(worker_main("lightning_pdist.bench.rl_worker", __doc__, check_spec, run))
