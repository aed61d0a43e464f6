"""Gorila on real actor processes, real parameter-server processes (``python -m lightning_pdist.parameter_server.process``)
and real Lightning ranks, against the plain-torch single-process double DQN of ``test_apex.py`` with uniform replay.

One learner, one actor refreshing every step, ``deterministic=True``: each push is applied by the servers before the
actor's next pull, so the learner's losses and final weights equal the reference's (1e-5), the servers' Adam on their
two shards being the reference's Adam. The target network changes exactly every C updates, to the servers' parameters.
A resume from a mid-run checkpoint restores the servers (parameters, Adam moments, versions), the replay, the target
network, the counters and the actor's exploration generator, and continues as the reference does when its
environment restarts (the environment's state is what cannot come back). Two learners train through
``Trainer(devices=2)`` on forked ranks, every push of both reaches the servers, and they resume from a mid-run
checkpoint (each learner's state and the servers' shards and versions); a killed actor is named.
"""

from __future__ import annotations

import copy
import os
import signal

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from tests.rl.test_apex import BATCH, CAPACITY, EPS, GAMMA, LR, N_STEP, SEED, STARTS, TARGET_EVERY, TRAINER, Losses, reference

from lightning_pdist.rl import DQNModule, GorilaStrategy

SETTINGS = dict(num_actors=1, num_servers=2, n_step=N_STEP, gamma=GAMMA, batch_size=BATCH, capacity=CAPACITY,
                learning_starts=STARTS, target_every=TARGET_EVERY, epsilon=EPS, refresh_every=1, send_every=1, seed=SEED,
                deterministic=True, actor_timeout=60.0, server_timeout=60.0)  # fmt: skip


class _Watch(Callback):
    """Checks the target network after every update (changed to q exactly when updates % C == 0, else unchanged);
    saves a checkpoint at ``save_at``; checks the restored state at the start of a resumed run."""

    def __init__(self, save_at=None, path=None, stored=None):
        self.save_at, self.path, self.stored, self.syncs, self.checked = save_at, path, stored, 0, False

    def on_train_start(self, trainer, pl_module):
        self.target = copy.deepcopy(pl_module.target_network.state_dict())
        if self.stored is None:
            return
        strategy = trainer.strategy
        own = torch.load(f"{self.path}.pdist-rank0-of-1", weights_only=True)
        assert (strategy.updates, strategy.turn, list(strategy.returns)) == (own["updates"], own["turn"], own["returns"])
        mine = strategy.replay.state_dict()
        for key in ("tree", "generator", "size", "position", "added"):
            assert torch.equal(torch.as_tensor(mine[key]), torch.as_tensor(own["replay"][key])), key
        assert torch.equal(strategy.actor_states[0]["rng"], own["actors"][0]["rng"])
        for key, value in pl_module.target_network.state_dict().items():
            assert torch.equal(value, own["target"][key]), key
        servers = self.stored["pdist"]["servers"]
        assert [s["version"] for s in servers] == [own["updates"]] * 2
        pulled = torch.cat([s["shard"]["values"] for s in servers])
        assert torch.equal(pulled, torch.nn.utils.parameters_to_vector(pl_module.q_network.parameters()))
        self.checked = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        now = pl_module.target_network.state_dict()
        if trainer.strategy.updates % TARGET_EVERY == 0:
            for key, value in pl_module.q_network.state_dict().items():
                assert torch.equal(now[key], value), key
            self.syncs += 1
        else:
            for key, value in self.target.items():
                assert torch.equal(now[key], value), key
        self.target = copy.deepcopy(now)
        if trainer.global_step == self.save_at:
            trainer.save_checkpoint(self.path)


def test_gorila_equals_single_process_dqn_syncs_targets_and_resumes(tmp_path):
    """1 learner, 1 actor, 2 servers: losses and weights equal the uniform-replay reference's (1e-5) over 30
    updates; the target syncs at updates 10, 20, 30; a resume from the checkpoint taken at update 30 restores servers,
    replay, target, counters and the actor's generator exactly, and its 8 updates follow the reference that restarts
    its environment there (1e-4, as for Ape-X)."""
    torch.manual_seed(0)
    module = DQNModule(hidden=16, lr=LR, steps_per_epoch=1000)
    start = copy.deepcopy(module.q_network)
    losses, ckpt = Losses(), tmp_path / "gorila.ckpt"
    watch = _Watch(save_at=30, path=str(ckpt))
    Trainer(**TRAINER, max_steps=30, callbacks=[losses, watch], strategy=GorilaStrategy(**SETTINGS)).fit(module)
    expected, net = reference(start, 30, alpha=0.0)
    torch.testing.assert_close(torch.tensor(losses.losses), torch.tensor(expected), atol=1e-5, rtol=0)
    for mine, theirs in zip(module.q_network.parameters(), net.parameters()):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
    assert watch.syncs == 3

    resumed, restored = Losses(), _Watch(path=str(ckpt), stored=torch.load(ckpt, weights_only=True))
    module2 = DQNModule(hidden=16, lr=LR, steps_per_epoch=1000)
    trainer = Trainer(**TRAINER, max_steps=38, callbacks=[resumed, restored], strategy=GorilaStrategy(**SETTINGS))
    trainer.fit(module2, ckpt_path=str(ckpt))
    assert restored.checked
    expected, net = reference(start, 38, resume_at=30, alpha=0.0)
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(expected[30:]), atol=1e-4, rtol=0)
    for mine, theirs in zip(module2.q_network.parameters(), net.parameters()):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=0)
    assert trainer.strategy.actor_states[0]["restarts"] == 1


class _EveryPushArrives(Callback):
    """On each learner, at the end: it made max_steps updates, and (once both are done) each server applied 2·max_steps;
    both learners save a checkpoint at step ``save_at``."""

    def __init__(self, save_at, path):
        self.save_at, self.path = save_at, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.save_at:
            trainer.save_checkpoint(self.path)

    def on_train_end(self, trainer, pl_module):
        strategy = trainer.strategy
        assert strategy.updates == trainer.max_steps and strategy.global_rank in (0, 1) and strategy.world_size == 2
        assert strategy.replay.added >= strategy.config.learning_starts
        strategy.barrier("test_all_pushed")
        _, metas = strategy.client.pull(record=False)
        assert [m["version"] for m in metas] == [2 * trainer.max_steps] * 2, metas


class _ResumedLearners(Callback):
    """At the start of the resumed 2-learner run, on each learner: its replay, counters, target network and actors'
    generators are its rank file's, the servers hold the checkpoint's shards at its versions (checked before either
    learner pushes: both meet at a barrier first); at the end every server applied exactly 2·(max_steps − save_at)
    pushes on top of the checkpoint's version."""

    def __init__(self, path):
        self.path = path

    def on_train_start(self, trainer, pl_module):
        strategy, rank = trainer.strategy, trainer.global_rank
        own = torch.load(f"{self.path}.pdist-rank{rank}-of-2", weights_only=True)
        assert (strategy.updates, strategy.turn, list(strategy.returns)) == (own["updates"], own["turn"], own["returns"])
        mine = strategy.replay.state_dict()
        for key in ("tree", "generator", "size", "position", "added"):
            assert torch.equal(torch.as_tensor(mine[key]), torch.as_tensor(own["replay"][key])), key
        assert all(torch.equal(a["rng"], b["rng"]) for a, b in zip(strategy.actor_states, own["actors"]))
        for key, value in pl_module.target_network.state_dict().items():
            assert torch.equal(value, own["target"][key]), key
        servers = torch.load(self.path, weights_only=True)["pdist"]["servers"]
        # each server's own: a checkpoint taken while the other learner's push was between the servers holds
        # versions one apart (Downpour applies each server's shard of a push on its own)
        self.saved_versions = [s["version"] for s in servers]
        shards, metas = strategy.client.pull(record=False)
        assert [m["version"] for m in metas] == [s["version"] for s in servers]
        assert all(torch.equal(a.float(), s["shard"]["values"].float()) for a, s in zip(shards, servers))
        strategy.barrier("test_resumed_checked")

    def on_train_end(self, trainer, pl_module):
        strategy = trainer.strategy
        strategy.barrier("test_resumed_all_pushed")
        _, metas = strategy.client.pull(record=False)
        extra = 2 * (trainer.max_steps - torch.load(f"{self.path}.pdist-rank0-of-2", weights_only=True)["updates"])
        assert [m["version"] for m in metas] == [v + extra for v in self.saved_versions], metas


class _KillActor(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 2:
            os.kill(trainer.strategy.pool.pids[1], signal.SIGKILL)


def test_two_learners_train_through_the_trainer_resume_and_a_killed_actor_is_named(tmp_path):
    """Trainer(strategy=gorila, devices=2) on forked ranks, 2 actors each: 12 updates per learner, 24 pushes on every
    server, a checkpoint at step 6; resumed from it to step 10, each learner gets back its replay, counters, target
    network and actors' generators, the servers their shards and versions, and each server applies exactly the 8 new
    pushes (the order in which the two learners' pushes arrive is not reproducible); then one learner's killed actor
    stops the run, named."""
    from _helpers import fit

    settings = dict(num_actors=2, num_learners=2, learning_starts=16, batch_size=8, send_every=4, refresh_every=8,
                    target_every=5, start_method="fork")  # fmt: skip
    ckpt = str(tmp_path / "gorila2.ckpt")
    fit(GorilaStrategy(**settings), DQNModule(hidden=16, steps_per_epoch=100), devices=2, max_steps=12,
        callbacks=[_EveryPushArrives(save_at=6, path=ckpt)])  # fmt: skip
    fit(GorilaStrategy(**settings), DQNModule(hidden=16, steps_per_epoch=100), devices=2, max_steps=10,
        callbacks=[_ResumedLearners(ckpt)], ckpt_path=ckpt)  # fmt: skip

    killed = Trainer(**TRAINER, max_steps=10_000, callbacks=[_KillActor()],
                     strategy=GorilaStrategy(num_actors=2, learning_starts=16, batch_size=8, send_every=4, refresh_every=8))  # fmt: skip
    with pytest.raises(RuntimeError, match=r"GorilaStrategy: actor 1 \(pid \d+\) closed its connection and was killed by SIGKILL"):
        killed.fit(DQNModule(hidden=16))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_actors": 0}, r"GorilaStrategy\(num_actors=0\): num_actors must be an int in \[1, 256\]"),
    ({"epsilon": 1.5}, r"GorilaStrategy\(epsilon=1.5\): epsilon must be a number in \[0, 1\]"),
    ({"epsilon": -0.1}, r"GorilaStrategy\(epsilon=-0.1\): epsilon must be a number in \[0, 1\]"),
    ({"num_learners": 0}, r"GorilaStrategy\(num_learners=0\): num_learners must be an int >= 1"),
    ({"num_servers": 0}, r"GorilaStrategy\(num_servers=0\): num_servers must be an int in \[1, 64\]"),
])  # fmt: skip
def test_bad_arguments_are_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GorilaStrategy(**kwargs)


class _NotALearner(LightningModule):
    def __init__(self):
        super().__init__()
        self.q_network = torch.nn.Linear(4, 2)


def test_a_learner_count_other_than_the_ranks_a_module_without_hooks_and_an_unknown_env_are_refused():
    """Before any process starts: num_learners ≠ devices × num_nodes, or num_nodes > 1, at Trainer construction; a
    module without the learner hooks at fit; an environment id gymnasium does not know at the module's construction."""
    with pytest.raises(ValueError, match=r"GorilaStrategy\(num_learners=3\): num_learners must equal the Trainer's "
                                         r"devices × num_nodes \(2 × 1 = 2\)"):  # fmt: skip
        Trainer(accelerator="cpu", devices=2, strategy=GorilaStrategy(num_learners=3, start_method="fork"), logger=False)
    with pytest.raises(ValueError, match=r"GorilaStrategy: Trainer\(num_nodes=2\): the learners must share the first "
                                         r"learner's machine"):  # fmt: skip
        Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy=GorilaStrategy(start_method="fork"), logger=False)
    trainer = Trainer(**TRAINER, max_steps=1, strategy=GorilaStrategy())
    with pytest.raises(TypeError, match=r"GorilaStrategy: the LightningModule _NotALearner has no make_env, target_network, "
                                        r"td_errors; the learner hooks are make_env, q_network, target_network, td_errors"):  # fmt: skip
        trainer.fit(_NotALearner())
    with pytest.raises(ValueError, match=r"DQNModule\(env_id='NoSuchEnv-v0'\): gymnasium does not know this environment id"):
        DQNModule(env_id="NoSuchEnv-v0")
