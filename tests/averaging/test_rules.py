"""Tier 1: the rule objects both shells drive, run on N replicas simulated in one process (no Lightning)."""

import pytest
import torch

from lightning_pdist.averaging import (BMUFFabricStrategy, BMUFRule, BMUFStrategy, EASGDFabricStrategy, EASGDRule,
                                       EASGDStrategy, LocalSGDFabricStrategy, LocalSGDRule, LocalSGDStrategy,
                                       SimuParallelRule, SimuParallelSGDFabricStrategy, SimuParallelSGDStrategy)  # fmt: skip


class Replica:
    """One simulated rank's flat model; ``average_of_replicas`` is the mean over ``peers`` (counted)."""

    def __init__(self, vector, peers):
        self.vector, self.peers, self.collectives = vector.clone(), peers, 0

    def local_vector(self):
        return self.vector.clone()

    def load_vector(self, vector):
        self.vector.copy_(vector)

    def average_of_replicas(self):
        self.collectives += 1
        return torch.stack([p.vector for p in self.peers]).mean(0)


def _world(n, dim=6, seed=0):
    torch.manual_seed(seed)
    peers = []
    peers.extend(Replica(torch.randn(dim), peers) for _ in range(n))
    return peers


def _sync(rules, peers):
    """One synchronization on every rank: the all-reduce the shell runs, then each rank's rule applies it."""
    stacked = torch.stack([p.vector for p in peers])
    combined = stacked.sum(0) if rules[0].reduce == "sum" else stacked.mean(0)
    for rule, peer in zip(rules, peers):
        rule.apply(combined.clone(), peer)


@pytest.mark.parametrize("trainer_cls, fabric_cls, rule_cls", [
    (LocalSGDStrategy, LocalSGDFabricStrategy, LocalSGDRule),
    (SimuParallelSGDStrategy, SimuParallelSGDFabricStrategy, SimuParallelRule),
    (BMUFStrategy, BMUFFabricStrategy, BMUFRule),
    (EASGDStrategy, EASGDFabricStrategy, EASGDRule),
])  # fmt: skip
def test_trainer_and_fabric_shells_hold_the_same_rule(trainer_cls, fabric_cls, rule_cls):
    """Both shells of an algorithm drive one rule class, built from the same flat arguments."""
    trainer, fabric = trainer_cls(), fabric_cls()
    assert type(trainer.rule) is type(fabric.rule) is rule_cls
    assert (trainer.schedule.period, trainer.schedule.warmup_steps) == (fabric.schedule.period, fabric.schedule.warmup_steps)
    assert trainer.schedule.owner == trainer_cls.__name__ and fabric.schedule.owner == fabric_cls.__name__


def test_local_sgd_rule_loads_the_mean_and_its_consensus_is_the_mean():
    peers = _world(3)
    rules = [LocalSGDRule(period=2) for _ in peers]
    for rule, peer in zip(rules, peers):
        rule.start(peer, 3)
    mean = torch.stack([p.vector for p in peers]).mean(0)
    torch.testing.assert_close(rules[0].consensus(1, peers[0]), mean)
    _sync(rules, peers)
    for peer in peers:
        torch.testing.assert_close(peer.vector, mean)
    assert rules[0].state_dict() == {}


def test_simuparallel_rule_never_communicates_while_training():
    rule = SimuParallelRule(owner="S")
    assert not any(rule.schedule.averages_gradients(t) or rule.schedule.syncs_after(t) for t in range(1, 50))


def test_bmuf_rule_runs_the_block_update_on_every_rank():
    """Two blocks on 4 simulated ranks: every rank loads S = W_g - η·Δ and the anchor and Δ follow the equations."""
    peers = _world(4)
    rules = [BMUFRule(period=2, block_lr=1.2, nesterov=True) for _ in peers]
    start = peers[0].vector.clone()
    for peer in peers:
        peer.load_vector(start)  # DDP's broadcast: the replicas start equal
    for rule, peer in zip(rules, peers):
        rule.start(peer, 4)
    eta = rules[0].block_momentum
    assert eta == pytest.approx(0.75)  # 1 - 1/N
    anchor, delta = start.clone(), torch.zeros_like(start)
    for block in range(2):
        for peer in peers:
            peer.vector.add_(0.1 * torch.randn_like(peer.vector))  # local steps
        g = anchor - torch.stack([p.vector for p in peers]).mean(0)
        delta = eta * delta + 1.2 * g
        w_g = anchor - delta
        open_consensus = rules[0].consensus(1, peers[0])  # mid-block: the block closed early on a copy
        torch.testing.assert_close(open_consensus, w_g)
        _sync(rules, peers)
        anchor = w_g - eta * delta
        for rule, peer in zip(rules, peers):
            torch.testing.assert_close(peer.vector, anchor)
            torch.testing.assert_close(rule.state.delta, delta)
        collectives = peers[0].collectives
        torch.testing.assert_close(rules[0].consensus(2, peers[0]), w_g)  # block just ended: W_g = S + η·Δ
        assert peers[0].collectives == collectives  # and no collective for it


def test_easgd_rule_sums_and_pulls_replicas_and_center_together():
    """The all-reduce is Σ_i x_i; with the old center, x_i ← x_i - α·d_i and x̃ ← x̃ + α·Σ_i d_i."""
    peers = _world(3)
    rules = [EASGDRule(period=1, alpha=0.2) for _ in peers]
    center = peers[0].vector.clone()
    for peer in peers:
        peer.load_vector(center)
    for rule, peer in zip(rules, peers):
        rule.start(peer, 3)
    assert rules[0].reduce == "sum"
    for peer in peers:
        peer.vector.add_(torch.randn_like(peer.vector))
    xs = [p.vector.clone() for p in peers]
    total = torch.stack(xs).sum(0)
    torch.testing.assert_close(rules[0].replica_mean(total), total / 3)
    _sync(rules, peers)
    for rule, peer, x in zip(rules, peers, xs):
        torch.testing.assert_close(peer.vector, x - 0.2 * (x - center))
        torch.testing.assert_close(rule.consensus(1, peer), center + 0.2 * (total - 3 * center))
    assert all(p.collectives == 0 for p in peers)  # the center is the consensus: no collective


def test_easgd_rule_refuses_alpha_times_world_size_above_one_at_start():
    peer = _world(1)[0]
    with pytest.raises(ValueError, match=r"E\(alpha=0.5\): alpha \* world_size = 1.5 must be <= 1"):
        EASGDRule(alpha=0.5, owner="E").start(peer, 3)


def test_rule_state_round_trips():
    peers = _world(2)
    rule = BMUFRule(period=1)
    rule.start(peers[0], 2)
    rule.state.delta.fill_(0.25)
    saved = rule.state_dict()
    other = BMUFRule(period=1)
    other.start(peers[1], 2)
    other.load_state_dict(saved)
    torch.testing.assert_close(other.state.delta, torch.full_like(other.state.delta, 0.25))
    torch.testing.assert_close(other.state.anchor, rule.state.anchor)
