"""Ape-X's pieces in one process: prioritized replay against P(i) = p^α/Σp^α and w = (N·P)^−β / max, written out in
plain torch; the ε_i schedule; n-step transitions; the frames; every refused argument names itself."""

from __future__ import annotations

from collections import deque
from multiprocessing import Pipe
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer

from lightning_pdist.rl import ApeXStrategy, DQNModule, PrioritizedReplay, actor_epsilon
from lightning_pdist.rl.apex_strategy import store_chunks
from lightning_pdist.rl.channel import FrameError, Kind, decode, encode, receive, send
from lightning_pdist.rl.module import due_to_log
from lightning_pdist.rl.nstep import NStep


def _batch(n: int, start: float = 0.0) -> dict[str, torch.Tensor]:
    ids = torch.arange(n, dtype=torch.float32) + start
    return {"obs": ids[:, None].repeat(1, 3), "action": torch.zeros(n, dtype=torch.long), "ret": ids,
            "next_obs": -ids[:, None].repeat(1, 3), "discount": torch.ones(n)}  # fmt: skip


def test_alpha_zero_samples_uniformly_with_unit_weights():
    """α = 0: every P(i) = 1/N (whatever the TD errors), a large sample hits every slot about equally, every w = 1."""
    replay = PrioritizedReplay(capacity=8, alpha=0.0, seed=3)
    replay.add(_batch(8), torch.tensor([0.0, 0.1, 5.0, 100.0, 1e-4, 2.0, 3.0, 7.0]))
    torch.testing.assert_close(replay.probabilities(), torch.full((8,), 1 / 8, dtype=torch.float64))
    _, slots, weights = replay.sample(8000, beta=0.4)
    assert torch.equal(weights, torch.ones(8000))
    counts = torch.bincount(slots, minlength=8).double()
    chi2 = float(((counts - 1000) ** 2 / 1000).sum())
    assert chi2 < 24.3, f"chi-square {chi2} (7 degrees of freedom, p = 0.001 at 24.3)"


def test_sampling_and_weights_follow_the_formulas():
    """The sum tree draws the slots torch.searchsorted finds on cumsum(p^α) for the same uniforms; w_i =
    (N·P(i))^−β / max_k (N·P(k))^−β; updated priorities and eviction (a full ring overwrites its oldest) included."""
    alpha, beta, eps = 0.6, 0.5, 1e-6
    replay = PrioritizedReplay(capacity=6, alpha=alpha, priority_eps=eps, seed=11)
    replay.add(_batch(4), torch.tensor([1.0, -2.0, 0.5, 3.0]))
    replay.add(_batch(4, start=4.0), torch.tensor([0.25, 4.0, -1.0, 0.0]))  # evicts slots 0, 1 (ids 0 and 1)
    replay.update(torch.tensor([2, 5]), torch.tensor([6.0, -0.1]))
    td = torch.tensor([-1.0, 0.0, 6.0, 3.0, 0.25, -0.1], dtype=torch.float64)  # ids 6, 7, 2, 3, 4, 5
    p = (td.abs() + eps) ** alpha
    torch.testing.assert_close(replay.probabilities(), p / p.sum())
    state = replay.generator.get_state()
    sample, slots, weights = replay.sample(500, beta=beta)
    u = torch.rand(500, generator=torch.Generator().set_state(state), dtype=torch.float64) * p.sum()
    expected = torch.searchsorted(p.cumsum(0), u, right=True)
    assert torch.equal(slots, expected)
    n_p = 6 * p / p.sum()
    torch.testing.assert_close(weights, ((n_p[expected] ** -beta) / (n_p.min() ** -beta)).float())
    assert set(sample["ret"].tolist()) <= {2.0, 3.0, 4.0, 5.0, 6.0, 7.0}, "an evicted transition was sampled"


def test_a_large_sum_tree_equals_a_full_rebuild_after_many_adds_and_updates():
    """1000 slots (1024 leaves, 10 levels), adds that wrap the ring, updates with repeated slots: every leaf holds the
    last p^α written to its slot (a plain dict kept alongside), every inner node equals the sum of its two children
    (the tree rebuilt level by level from the leaves, bit for bit), and the draws are torch.searchsorted's."""
    alpha, eps, capacity = 0.6, 1e-6, 1000
    replay = PrioritizedReplay(capacity=capacity, alpha=alpha, priority_eps=eps, seed=5)
    g = torch.Generator().manual_seed(0)
    last: dict[int, float] = {}
    for step in range(60):
        td = torch.randn(37, generator=g) * 3
        slots = replay.add(_batch(37, start=37.0 * step), td)
        last.update(zip(slots.tolist(), replay.scaled(td).tolist()))
        upd = torch.randint(replay.size, (32,), generator=g)
        upd[:4] = upd[4]  # one slot five times: the last value stays
        td = torch.randn(32, generator=g)
        replay.update(upd, td)
        last.update(zip(upd.tolist(), replay.scaled(td).tolist()))
    leaves = torch.zeros(replay.leaves, dtype=torch.float64)
    leaves[list(last)] = torch.tensor(list(last.values()), dtype=torch.float64)
    levels, level = [leaves], leaves
    while level.numel() > 1:
        level = level[0::2] + level[1::2]
        levels.append(level)
    rebuilt = torch.cat([torch.zeros(1, dtype=torch.float64), *reversed(levels)])
    assert torch.equal(replay.tree, rebuilt)
    p = leaves[:capacity]
    state = replay.generator.get_state()
    _, slots, weights = replay.sample(2000, beta=0.7)
    u = torch.rand(2000, generator=torch.Generator().set_state(state), dtype=torch.float64) * rebuilt[1]
    assert torch.equal(slots, torch.searchsorted(p.cumsum(0), u, right=True))
    n_p = capacity * p / p.sum()
    torch.testing.assert_close(weights, ((n_p[slots] ** -0.7) / (n_p.min() ** -0.7)).float())


def test_chunks_stored_with_one_add_equal_one_add_per_chunk_and_the_metrics_log_at_lightnings_cadence():
    """store_chunks (the learner's one add per collect) leaves the same storage, sum tree, ring position and actor
    states as one add per chunk in arrival order, a wrap past the ring's end included; due_to_log is true on every
    log_every_n_steps-th update only (never with 0)."""
    g = torch.Generator().manual_seed(2)
    chunks = [({"actor": i % 2, "env_steps": 16 * (i + 1), "restarts": 0, "episodes": [float(i)]},
               {**_batch(5, start=5.0 * i), "td": torch.randn(5, generator=g), "rng": torch.tensor([i])})
              for i in range(4)]  # fmt: skip
    one, each = PrioritizedReplay(capacity=12, alpha=0.6, seed=0), PrioritizedReplay(capacity=12, alpha=0.6, seed=0)
    states, returns = [None, None], deque(maxlen=100)
    store_chunks(one, chunks, states, returns)
    for _, tensors in chunks:
        each.add({k: tensors[k] for k in ("obs", "action", "ret", "next_obs", "discount")}, tensors["td"])
    assert torch.equal(one.tree, each.tree) and (one.position, one.size, one.added) == (each.position, each.size, 20)
    assert all(torch.equal(one.storage[k], each.storage[k]) for k in each.storage)
    assert [int(s["rng"]) for s in states] == [2, 3] and [s["env_steps"] for s in states] == [48, 64]
    assert list(returns) == [0.0, 1.0, 2.0, 3.0]
    assert [u for u in range(120) if due_to_log(SimpleNamespace(log_every_n_steps=50), u)] == [49, 99]
    assert not any(due_to_log(SimpleNamespace(log_every_n_steps=0), u) for u in range(10))


def test_replay_state_round_trips():
    """state_dict/load_state_dict keep storage, priorities and the generator: the next draws are the same."""
    replay = PrioritizedReplay(capacity=5, alpha=0.6, seed=1)
    replay.add(_batch(3), torch.tensor([1.0, 2.0, 3.0]))
    other = PrioritizedReplay(capacity=5, alpha=0.6, seed=99)
    other.load_state_dict(replay.state_dict())
    assert torch.equal(replay.sample(20, 0.4)[1], other.sample(20, 0.4)[1])
    with pytest.raises(ValueError, match=r"capacity=5, alpha=0.6; this run has capacity=4"):
        PrioritizedReplay(capacity=4, alpha=0.6).load_state_dict(replay.state_dict())


def test_actor_epsilons_follow_the_ape_x_schedule():
    """ε_i = 0.4^(1 + 7·i/(N−1)): ε_0 = 0.4, ε_{N−1} = 0.4⁸; one actor explores with ε."""
    for n in (2, 4, 8):
        eps = ApeXStrategy(num_actors=n).config.epsilons()
        assert eps == [0.4 ** (1 + 7 * i / (n - 1)) for i in range(n)]
        assert eps[0] == 0.4 and abs(eps[-1] - 0.4**8) < 1e-15
    assert actor_epsilon(0, 1) == 0.4 and ApeXStrategy(num_actors=1, epsilon=0.1).config.epsilons() == [0.1]


def test_nstep_returns_and_discounts():
    """G_t = Σ_{j<k} γ^j r_{t+j}, d = γ^k; a terminal episode end flushes with d = 0, a truncation with γ^k."""
    gamma, obs = 0.5, [torch.tensor([float(i)]) for i in range(6)]
    ns = NStep(2, gamma)
    assert ns.push(obs[0], 0, 1.0, obs[1], False, False) == []
    (t0,) = ns.push(obs[1], 1, 2.0, obs[2], False, False)
    assert (t0["ret"], t0["discount"], float(t0["next_obs"])) == (1.0 + 0.5 * 2.0, 0.25, 2.0)
    t1, t2 = ns.push(obs[2], 0, 4.0, obs[3], True, False)
    assert (t1["ret"], t1["discount"], t2["ret"], t2["discount"]) == (2.0 + 0.5 * 4.0, 0.0, 4.0, 0.0)
    ns.push(obs[3], 1, 1.0, obs[4], False, False)
    (t3,) = ns.push(obs[4], 1, 1.0, obs[5], False, True)[-1:]
    assert (t3["ret"], t3["discount"]) == (1.0, 0.5)


def test_frames_are_bounded_and_checked():
    """A frame round-trips raw tensors; one longer than the reader allows, or whose sizes do not add up, is refused."""
    a, b = Pipe()
    send(a, Kind.PARAMS, {"version": 3}, {"flat": torch.arange(5.0)})
    kind, meta, tensors = receive(b, 4096, (Kind.PARAMS,))
    assert kind == Kind.PARAMS and meta == {"version": 3} and torch.equal(tensors["flat"], torch.arange(5.0))
    send(a, Kind.PARAMS, {}, {"flat": torch.zeros(10_000)})
    with pytest.raises(OSError):
        receive(b, 4096, (Kind.PARAMS,))
    frame = encode(Kind.PARAMS, {}, {"flat": torch.zeros(4)})
    with pytest.raises(FrameError, match="runs past the frame's end"):
        decode(frame[:-1], (Kind.PARAMS,))
    with pytest.raises(FrameError, match="message kind 3 where"):
        decode(frame, (Kind.PULL,))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_actors": 0}, r"ApeXStrategy\(num_actors=0\): num_actors must be an int in \[1, 256\]"),
    ({"alpha": -0.5}, r"ApeXStrategy\(alpha=-0.5\): alpha must be a number in \[0, 1\]"),
    ({"epsilon": 1.5}, r"ApeXStrategy\(epsilon=1.5\): epsilon must be a number in \[0, 1\]"),
    ({"epsilon": -0.1}, r"ApeXStrategy\(epsilon=-0.1\): epsilon must be a number in \[0, 1\]"),
    ({"beta": 2.0}, r"ApeXStrategy\(beta=2.0\): beta must be a number in \[0, 1\]"),
    ({"capacity": 4, "batch_size": 8}, r"ApeXStrategy\(capacity=4\): capacity must be >= batch_size \(8\)"),
])  # fmt: skip
def test_bad_arguments_are_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ApeXStrategy(**kwargs)


def test_an_unknown_environment_id_is_refused():
    with pytest.raises(ValueError, match=r"DQNModule\(env_id='NoSuchEnv-v0'\): gymnasium does not know this environment id"):
        DQNModule(env_id="NoSuchEnv-v0")


class _NotALearner(LightningModule):
    def __init__(self):
        super().__init__()
        self.q_network = torch.nn.Linear(4, 2)

    def make_env(self):
        raise AssertionError("never called")


def test_a_module_without_the_learner_hooks_is_refused_naming_them():
    """Refused before any actor starts, naming the hooks it lacks."""
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, strategy=ApeXStrategy(num_actors=1))  # fmt: skip
    with pytest.raises(TypeError, match=r"ApeXStrategy: the LightningModule _NotALearner has no target_network, td_errors; "
                                        r"the learner hooks are make_env, q_network, target_network, td_errors"):  # fmt: skip
        trainer.fit(_NotALearner())


def test_several_devices_are_refused_before_any_actor_starts():
    """Trainer(devices=2) would silently train on one device: refused at setup, naming the argument and the rule."""
    trainer = Trainer(accelerator="cpu", devices=2, strategy=ApeXStrategy(num_actors=1), logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, max_steps=1)
    with pytest.raises(ValueError, match=r"ApeXStrategy: Trainer\(devices=2\): the learner is one process .* use devices=1"):
        trainer.fit(DQNModule(hidden=8, steps_per_epoch=2))
