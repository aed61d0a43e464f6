"""Ape-X on real actor processes against a single-process double DQN written here in plain torch.

One actor refreshing its parameters every step, ``deterministic=True`` and a fixed seed: the learner's losses and its
final weights equal the reference loop's (1e-5), which acts ε-greedily with the same generator, builds n-step
transitions, keeps a prioritized ring buffer (priorities from the |TD error| at the acting weights), samples with
``searchsorted`` on the cumulative priorities, weights by ``(N·P)^−β``, steps Adam and syncs the target network.
A resume from the checkpoint continues as the reference does when its environment restarts (seed + 1000), which
only holds if replay, priorities, sampler, target network, optimizer, step count and the actor's exploration
generator all came back; the environment's own state cannot (the actor starts a new episode). A crashed actor and a
killed actor are named, and the run stops.
"""

from __future__ import annotations

import copy
import os
import signal

import gymnasium as gym
import pytest
import torch
from lightning.pytorch import Callback, Trainer

from lightning_pdist.rl import ApeXStrategy, DQNModule

SEED, N_STEP, GAMMA, BATCH, CAPACITY, STARTS, TARGET_EVERY = 0, 3, 0.9, 8, 40, 16, 10
ALPHA, BETA, BETA_STEPS, LR, EPS = 0.6, 0.4, 50, 1e-2, 0.4
SETTINGS = dict(num_actors=1, n_step=N_STEP, gamma=GAMMA, batch_size=BATCH, capacity=CAPACITY, learning_starts=STARTS,
                target_every=TARGET_EVERY, alpha=ALPHA, beta=BETA, beta_steps=BETA_STEPS, epsilon=EPS, refresh_every=1,
                send_every=1, seed=SEED, deterministic=True, actor_timeout=60.0)  # fmt: skip
TRAINER = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
               enable_checkpointing=False)  # fmt: skip


class Losses(Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def reference(q: torch.nn.Module, steps: int, resume_at: int | None = None,
              alpha: float = ALPHA) -> tuple[list[float], torch.nn.Module]:  # fmt: skip
    """Single-process double DQN, n-step, proportional prioritized replay (``alpha=0``: uniform, every weight 1);
    ``resume_at``: restart the environment."""
    q = copy.deepcopy(q)
    target = copy.deepcopy(q)
    opt = torch.optim.Adam(q.parameters(), lr=LR)
    env = gym.make("CartPole-v1")
    obs = torch.tensor(env.reset(seed=SEED)[0], dtype=torch.float32)
    act_gen, sample_gen = torch.Generator().manual_seed(SEED), torch.Generator().manual_seed(SEED)
    store = {k: [None] * CAPACITY for k in ("obs", "action", "ret", "next_obs", "discount")}
    prio = torch.zeros(CAPACITY, dtype=torch.float64)
    size = pos = updates = 0
    pending, losses = [], []

    def td(o, a, g, n, d, net):
        best = net(n).argmax(1, keepdim=True)
        return g + d * target(n).gather(1, best).squeeze(1) - net(o).gather(1, a[:, None]).squeeze(1)

    while updates < steps:
        if resume_at is not None and updates == resume_at and pending is not None:
            obs = torch.tensor(env.reset(seed=SEED + 1000)[0], dtype=torch.float32)
            pending, resume_at = [], None
        with torch.no_grad():
            explore = float(torch.rand((), generator=act_gen)) < EPS
            action = int(torch.randint(2, (), generator=act_gen)) if explore else int(q(obs[None]).argmax(1))
        nxt, reward, term, trunc, _ = env.step(action)
        nxt = torch.tensor(nxt, dtype=torch.float32)
        pending.append((obs, action, float(reward)))
        ready = []
        while pending and (term or trunc or len(pending) == N_STEP):
            g = sum(GAMMA**j * r for j, (_, _, r) in enumerate(pending))
            ready.append((pending[0][0], pending[0][1], g, nxt, 0.0 if term else GAMMA ** len(pending)))
            pending.pop(0)
            if not (term or trunc):
                break
        obs = torch.tensor(env.reset()[0], dtype=torch.float32) if term or trunc else nxt
        if ready:
            o, a = torch.stack([t[0] for t in ready]), torch.tensor([t[1] for t in ready])
            g, n = torch.tensor([t[2] for t in ready]), torch.stack([t[3] for t in ready])
            d = torch.tensor([t[4] for t in ready])
            with torch.no_grad():
                delta = td(o, a, g, n, d, q)
            for j in range(len(ready)):
                for key, value in zip(store, (o[j], a[j], g[j], n[j], d[j])):
                    store[key][pos] = value
                prio[pos] = (abs(float(delta[j])) + 1e-6) ** alpha
                pos, size = (pos + 1) % CAPACITY, min(CAPACITY, size + 1)
        if size < max(STARTS, BATCH):
            continue
        p = prio[:size]
        u = torch.rand(BATCH, generator=sample_gen, dtype=torch.float64) * p.sum()
        idx = torch.searchsorted(p.cumsum(0), u, right=True).clamp(max=size - 1)
        beta = BETA + (1 - BETA) * min(1.0, updates / BETA_STEPS)
        n_p = size * p / p.sum()
        w = ((n_p[idx] ** -beta) / (n_p.min() ** -beta)).float()
        o, a, g, n, d = (torch.stack([store[k][i] for i in idx.tolist()]) for k in store)
        delta = td(o, a, g, n, d, q)
        loss = (w * torch.nn.functional.huber_loss(delta, torch.zeros_like(delta), reduction="none")).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        prio[idx] = (delta.detach().double().abs() + 1e-6) ** alpha
        updates += 1
        if updates % TARGET_EVERY == 0:
            target.load_state_dict(q.state_dict())
        losses.append(float(loss.detach()))
    return losses, q


class _RestoredState(Callback):
    """At the resumed run's start: the strategy's replay, counters, actors and the target network are the checkpoint's."""

    def __init__(self, ckpt):
        self.stored = torch.load(ckpt, weights_only=True)
        self.checked = False

    def on_train_start(self, trainer, pl_module):
        rl, mine = self.stored["rl"], trainer.strategy.rl_state()
        assert (mine["updates"], mine["turn"], mine["returns"]) == (rl["updates"], rl["turn"], rl["returns"])
        for key in ("tree", "generator", "size", "position", "added"):
            assert torch.equal(torch.as_tensor(mine["replay"][key]), torch.as_tensor(rl["replay"][key])), key
        for key, value in rl["replay"]["storage"].items():
            assert torch.equal(mine["replay"]["storage"][key], value), key
        assert torch.equal(mine["actors"][0]["rng"], rl["actors"][0]["rng"])
        for key, value in pl_module.target_network.state_dict().items():
            assert torch.equal(value, self.stored["state_dict"][f"target_network.{key}"]), key
        self.checked = True


class _CrashingEnv(gym.Wrapper):
    def __init__(self, env):
        super().__init__(env)
        self.steps = 0

    def step(self, action):
        self.steps += 1
        if self.steps == 30:
            raise RuntimeError("the simulator lost its licence")
        return self.env.step(action)


class _CrashingDQN(DQNModule):
    def make_env(self):
        return _CrashingEnv(super().make_env())


class _KillActor(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 3:
            os.kill(trainer.strategy.pool.pids[1], signal.SIGKILL)


def test_apex_equals_single_process_dqn_resumes_and_names_failed_actors(tmp_path):
    """Losses and weights equal the reference's (1e-5) over 30 updates; a resume restores the replay, priorities,
    sampler, counters, actor generator and target network exactly, and its 8 updates follow the reference that
    restarts its environment there (1e-4: the two loops are bitwise equal for the first updates, then differ by
    ~1e-6 per loss, float rounding that grows slowly); an actor whose environment raises, and one killed, are named."""
    torch.manual_seed(0)
    module = DQNModule(hidden=16, lr=LR, steps_per_epoch=1000)
    start = copy.deepcopy(module.q_network)
    losses = Losses()
    trainer = Trainer(**TRAINER, max_steps=30, callbacks=[losses], strategy=ApeXStrategy(**SETTINGS))
    trainer.fit(module)
    ckpt = tmp_path / "apex.ckpt"
    trainer.save_checkpoint(ckpt)
    expected, net = reference(start, 30)
    torch.testing.assert_close(torch.tensor(losses.losses), torch.tensor(expected), atol=1e-5, rtol=0)
    for mine, theirs in zip(module.q_network.parameters(), net.parameters()):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
    stored = torch.load(ckpt, weights_only=True)["rl"]
    assert stored["updates"] == 30 and stored["replay"]["added"] > CAPACITY  # the ring evicted: the check covers it

    resumed, restored = Losses(), _RestoredState(ckpt)
    module2 = DQNModule(hidden=16, lr=LR, steps_per_epoch=1000)
    trainer = Trainer(**TRAINER, max_steps=38, callbacks=[resumed, restored], strategy=ApeXStrategy(**SETTINGS))
    trainer.fit(module2, ckpt_path=str(ckpt))
    assert restored.checked
    expected, net = reference(start, 38, resume_at=30)
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(expected[30:]), atol=1e-4, rtol=0)
    for mine, theirs in zip(module2.q_network.parameters(), net.parameters()):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=0)
    assert trainer.strategy.actor_states[0]["restarts"] == 1

    crash = Trainer(**TRAINER, max_steps=100, strategy=ApeXStrategy(**{**SETTINGS, "learning_starts": 8}))
    with pytest.raises(RuntimeError, match=r"(?s)ApeXStrategy: actor 0 \(pid \d+\) failed:.*the simulator lost its licence"):
        crash.fit(_CrashingDQN(hidden=16))

    killed = Trainer(**TRAINER, max_steps=10_000, callbacks=[_KillActor()],
                     strategy=ApeXStrategy(num_actors=2, learning_starts=16, batch_size=8, send_every=4, refresh_every=8))  # fmt: skip
    with pytest.raises(RuntimeError, match=r"ApeXStrategy: actor 1 \(pid \d+\) closed its connection and was killed by SIGKILL"):
        killed.fit(DQNModule(hidden=16))
