"""Tier 1: signs, the majority vote, Signum, EF-signSGD and the in-process simulator against plain torch."""

import pytest
import torch

from lightning_pdist.sign.vote import (
    binary_sign,
    ef_scaled_vote,
    ef_sign_compress,
    majority_vote,
    segment_l1_mean,
    signum_momentum,
    worker_vote,
)
from lightning_pdist.sign.simulator import SignSGDSimulator


def _ref_sign(x):
    return torch.tensor([1 if v >= 0 else -1 for v in x.tolist()], dtype=torch.int8)


def test_binary_sign_maps_zero_and_negative_zero_to_plus_one():
    """sign(0) = sign(-0.0) = +1, everything else is the usual sign, as int8."""
    x = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 3.0, -2.0])
    out = binary_sign(x)
    assert out.dtype == torch.int8
    assert out.tolist() == [1, 1, 1, -1, 1, -1]


def test_binary_sign_nan_is_minus_one_as_documented():
    """NaN maps to -1 (NaN >= 0 is False), which is why the hooks must check finiteness first."""
    assert binary_sign(torch.tensor([float("nan")])).tolist() == [-1]


@pytest.mark.parametrize("workers", [1, 2, 3, 4, 7])
def test_majority_vote_matches_loop_reference(workers):
    """The majority vote equals a per-coordinate loop, with ties (even worker counts) going to +1."""
    g = torch.Generator().manual_seed(workers)
    signs = torch.where(torch.rand(workers, 50, generator=g) < 0.5, 1, -1).to(torch.int8)
    expected = [1 if sum(signs[:, n].tolist()) >= 0 else -1 for n in range(50)]
    assert majority_vote(signs).tolist() == expected


def test_majority_vote_tie_goes_to_plus_one():
    """An even split votes +1."""
    signs = torch.tensor([[1, -1, -1], [-1, 1, -1]], dtype=torch.int8)
    assert majority_vote(signs).tolist() == [1, 1, -1]


def test_majority_vote_rejects_1d_input():
    """A flat vector is not a (workers, n) matrix."""
    with pytest.raises(ValueError, match=r"majority_vote\(signs.shape=\(5,\)\): signs must be a 2-D"):
        majority_vote(torch.ones(5))


def test_signum_momentum_is_an_ema_and_out_of_place():
    """m' = beta m + (1 - beta) g, and the old buffer is left untouched."""
    m, g = torch.tensor([1.0, -2.0]), torch.tensor([3.0, 4.0])
    out = signum_momentum(m, g, 0.9)
    torch.testing.assert_close(out, 0.9 * torch.tensor([1.0, -2.0]) + 0.1 * g)
    assert m.tolist() == [1.0, -2.0]


@pytest.mark.parametrize("beta", [-0.1, 1.0, 1.5])
def test_signum_momentum_rejects_beta_outside_unit_interval(beta):
    """beta must lie in [0, 1)."""
    with pytest.raises(ValueError, match=rf"signum_momentum\(beta={beta}\): beta must be in \[0, 1\)"):
        signum_momentum(torch.zeros(2), torch.zeros(2), beta)


def test_segment_l1_mean_per_segment():
    """Each segment's scale is its mean absolute value."""
    x = torch.tensor([1.0, -3.0, 2.0, -2.0, 4.0])
    torch.testing.assert_close(segment_l1_mean(x, [2, 3]), torch.tensor([2.0, 8.0 / 3.0]))


@pytest.mark.parametrize("lengths", [[2, 2], [3, 3], [5, 0]])
def test_segment_l1_mean_rejects_lengths_that_do_not_tile(lengths):
    """Segment lengths must be positive and sum to the vector's size."""
    with pytest.raises(ValueError, match=r"segment_l1_mean\(lengths=.*\): lengths must be positive and sum to"):
        segment_l1_mean(torch.ones(5), lengths)


def test_ef_sign_compress_matches_karimireddy_alg2():
    """p = v + e; Delta = (|p|_1 / d) sign(p) per segment; e' = p - Delta."""
    v, e = torch.tensor([0.5, -1.0, 0.0, 2.0]), torch.tensor([0.1, 0.2, -0.3, 0.0])
    p, scales, e_new = ef_sign_compress(v, e, [2, 2])
    ref_p = v + e
    ref_scales = torch.tensor([(0.6 + 0.8) / 2, (0.3 + 2.0) / 2])
    ref_delta = torch.cat([ref_scales[0] * _ref_sign(ref_p[:2]), ref_scales[1] * _ref_sign(ref_p[2:])])
    torch.testing.assert_close(p, ref_p)
    torch.testing.assert_close(scales, ref_scales)
    torch.testing.assert_close(e_new, ref_p - ref_delta)


def test_error_feedback_telescopes_to_the_gradient_sum():
    """With error feedback, the applied updates plus the final residual equal the sum of the gradients."""
    g = torch.Generator().manual_seed(0)
    residual, applied, total = torch.zeros(20), torch.zeros(20), torch.zeros(20)
    for _ in range(10):
        grad = torch.randn(20, generator=g)
        total += grad
        vote = worker_vote(grad, None, residual, lengths=[12, 8])
        applied += ef_scaled_vote(binary_sign(vote.vector), vote.scales.unsqueeze(0), [12, 8])
        residual = vote.residual
    torch.testing.assert_close(applied + residual, total)


def test_worker_vote_applies_momentum_then_error_feedback_without_touching_inputs():
    """worker_vote signs m' = beta m + (1-beta) g plus the residual, and returns new buffers only."""
    g, m, e = torch.tensor([1.0, -1.0, 0.2]), torch.tensor([0.5, 0.5, -1.0]), torch.tensor([0.0, 0.3, 0.1])
    m0, e0 = m.clone(), e.clone()
    vote = worker_vote(g, m, e, beta=0.8, lengths=[3])
    m_ref = 0.8 * m + 0.2 * g
    p_ref = m_ref + e
    torch.testing.assert_close(vote.momentum, m_ref)
    torch.testing.assert_close(vote.vector, p_ref)
    torch.testing.assert_close(vote.scales, p_ref.abs().mean().reshape(1))
    torch.testing.assert_close(vote.residual, p_ref - p_ref.abs().mean() * _ref_sign(p_ref))
    assert torch.equal(m, m0) and torch.equal(e, e0)


def test_worker_vote_without_options_signs_the_gradient_itself():
    """No momentum and no residual: the vector is the gradient and nothing else is produced."""
    g = torch.tensor([1.0, -2.0])
    vote = worker_vote(g)
    assert vote.vector is g and vote.scales is None and vote.momentum is None and vote.residual is None


# --- simulator -------------------------------------------------------------------------------------------


def test_simulator_one_worker_equals_sign_of_gradient():
    """A one-worker vote (majority or LLR) is sign(grad), zeros to +1."""
    grad = torch.tensor([[0.0, -1.0, 2.0, -0.0, -3.0]])
    for sim in (SignSGDSimulator(1), SignSGDSimulator(1, "llr", warmup_rounds=0)):
        for _ in range(3):
            assert sim.aggregate(grad).tolist() == [1.0, -1.0, 1.0, 1.0, -1.0]


def test_simulator_one_worker_error_feedback_equals_ef_signsgd():
    """A one-worker EF vote is Karimireddy's scaled sign, with the residual carried across rounds."""
    g = torch.Generator().manual_seed(1)
    sim = SignSGDSimulator(1, error_feedback=True)
    e = torch.zeros(6)
    for _ in range(4):
        grad = torch.randn(6, generator=g)
        p = grad + e
        delta = torch.cat([p[:4].abs().mean() * _ref_sign(p[:4]), p[4:].abs().mean() * _ref_sign(p[4:])])
        e = p - delta
        torch.testing.assert_close(sim.aggregate(grad.unsqueeze(0), [4, 2]), delta)


def test_simulator_majority_with_momentum_matches_reference():
    """Majority vote over Signum momenta equals the loop written out here."""
    g = torch.Generator().manual_seed(2)
    sim = SignSGDSimulator(4, momentum=0.9)
    m = torch.zeros(4, 9)
    for _ in range(5):
        grads = torch.randn(4, 9, generator=g)
        m = 0.9 * m + 0.1 * grads
        expected = torch.where(torch.where(m >= 0, 1, -1).sum(0) >= 0, 1.0, -1.0)
        assert torch.equal(sim.aggregate(grads), expected)


def test_simulator_buckets_are_independent():
    """Two bucket indices keep separate momentum state."""
    sim = SignSGDSimulator(1, momentum=0.5)
    sim.aggregate(torch.tensor([[1.0]]), bucket=0)
    # Bucket 1 starts from zero momentum: its first vote is the sign of its own gradient.
    assert sim.aggregate(torch.tensor([[-0.1]]), bucket=1).tolist() == [-1.0]
    # Bucket 0 remembers +0.5: 0.5*0.5 + 0.5*(-0.1) > 0.
    assert sim.aggregate(torch.tensor([[-0.1]]), bucket=0).tolist() == [1.0]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(world_size=0), r"SignSGDSimulator\(world_size=0\): world_size must be an int >= 1"),
        (dict(world_size=2, aggregation="mean"), r"SignSGDSimulator\(aggregation='mean'\): aggregation must be one of"),
        (dict(world_size=2, momentum=1.0), r"SignSGDSimulator\(momentum=1.0\): momentum must be in \[0, 1\)"),
        (dict(world_size=2, warmup_rounds=-1), r"SignSGDSimulator\(warmup_rounds=-1\): warmup_rounds must be >= 0"),
        (dict(world_size=2, estimator="layer"), r"SignSGDSimulator\(estimator='layer'\): estimator must be one of"),
    ],
)
def test_simulator_rejects_bad_settings(kwargs, message):
    """Each bad constructor argument is named with its value and rule."""
    with pytest.raises(ValueError, match=message):
        SignSGDSimulator(**kwargs)


def test_simulator_rejects_wrong_shape_nan_and_layout_change():
    """aggregate refuses a wrong worker count, non-finite gradients, and a new layout for a known bucket."""
    sim = SignSGDSimulator(2)
    with pytest.raises(ValueError, match=r"grads must be \(world_size=2, d\)"):
        sim.aggregate(torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"bucket 0 holds non-finite gradients \(NaN/Inf\) on worker\(s\) \[1\]"):
        sim.aggregate(torch.tensor([[1.0, 2.0], [float("inf"), 0.0]]))
    sim.aggregate(torch.zeros(2, 4), [2, 2])
    with pytest.raises(ValueError, match=r"bucket 0 was made of tensors \[2, 2\] in earlier rounds"):
        sim.aggregate(torch.zeros(2, 4), [1, 3])


def test_tie_table_marks_the_even_splits():
    """tie_table(M)[p] iff pattern p has as many +1 as -1: C(M, M/2) patterns for even M, none for odd M."""
    from math import comb

    from lightning_pdist.sign.vote import sign_patterns, tie_table

    for m in (1, 2, 3, 4, 6):
        table = tie_table(m)
        assert int(table.sum()) == (comb(m, m // 2) if m % 2 == 0 else 0)
        assert torch.equal(table, sign_patterns(m).sum(0) == 0)
