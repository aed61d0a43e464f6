"""Tier 1: the LLR-weighted vote (IT-signSGD, paper 004 eqs. 3-4) against a plain-torch transcription."""

import math

import pytest
import torch

from lightning_pdist.sign.llr import (
    DEFAULT_MAX_WEIGHT,
    LLRConfig,
    LLRState,
    column_ids,
    disagreement_counts,
    llr_round_,
    llr_weights,
    vote_weights,
    weighted_vote,
)
from lightning_pdist.sign.vote import majority_vote
from lightning_pdist.sign.simulator import SignSGDSimulator


def reference_it_signsgd(signs, warmup, estimator, lengths, decay=1.0, max_weight=DEFAULT_MAX_WEIGHT, negative=False):
    """Eqs. 3-4 over rounds, in fp64: per-coordinate counts, pooled by summing them (a linear map, decay included).

    Returns the votes and, per round, the (M, d) weights used (None in warm-up).
    """
    rounds, m, d = signs.shape
    y = signs.to(torch.float64)
    k = torch.zeros(m, d, dtype=torch.float64)  # decayed disagreements per coordinate
    t = torch.zeros(d, dtype=torch.float64)  # decayed observations per coordinate
    segments = [slice(a, a + n) for a, n in zip([sum(lengths[:i]) for i in range(len(lengths))], lengths)]
    votes, weights = [], []
    for r in range(rounds):
        mv = torch.where(y[r].sum(0) >= 0, 1.0, -1.0)
        if r < warmup:
            u, w = mv, None
        else:
            if estimator == "coordinate":
                kk, tt = k, t
            elif estimator == "worker":
                kk, tt = k.sum(1, keepdim=True).expand(m, d), t.sum().expand(d)
            else:
                kk, tt = torch.empty_like(k), torch.empty_like(t)
                for s in segments:
                    kk[:, s] = k[:, s].sum(1, keepdim=True)
                    tt[s] = t[s].sum()
            p = (kk + 1) / (tt + 2)
            w = torch.log((1 - p) / p).clamp(-max_weight if negative else 0.0, max_weight)
            total = (w * y[r]).sum(0)
            tie = total.abs() <= 1e-9 * w.abs().sum(0)  # zero in exact arithmetic
            u = torch.where(tie, mv, torch.where(total > 0, 1.0, -1.0))
        k = decay * k + (y[r] != u)
        t = decay * t + 1
        votes.append(u)
        weights.append(w)
    return torch.stack(votes), weights


def heterogeneous_signs(rounds, flips, d, seed=0):
    """(rounds, M, d) signs: the truth flipped with probability flips[m] for worker m."""
    g = torch.Generator().manual_seed(seed)
    truth = torch.where(torch.rand(rounds, 1, d, generator=g) < 0.5, 1, -1)
    flip = torch.rand(rounds, len(flips), d, generator=g) < torch.tensor(flips).view(1, -1, 1)
    return torch.where(flip, -truth, truth).to(torch.int8), truth.squeeze(1)


@pytest.mark.parametrize("estimator", ["coordinate", "worker", "tensor"])
@pytest.mark.parametrize("decay", [1.0, 0.8])
def test_llr_rounds_match_reference(estimator, decay):
    """Warm-up rounds equal the majority vote; later votes and weights equal eqs. 3-4 written out in the test."""
    lengths = [7, 3, 10]
    signs, _ = heterogeneous_signs(12, [0.4, 0.35, 0.05, 0.3], sum(lengths))
    config = LLRConfig(warmup_rounds=3, estimator=estimator, decay=decay)
    columns = {"coordinate": 20, "worker": 1, "tensor": 3}[estimator]
    state = LLRState.zeros(estimator, 4, columns)
    ref_votes, ref_weights = reference_it_signsgd(signs, 3, estimator, lengths, decay)
    for r in range(12):
        vote, w = llr_round_(signs[r], state, config, lengths)
        assert vote.tolist() == ref_votes[r].to(torch.int8).tolist(), f"round {r}"
        if r < 3:
            assert w is None and torch.equal(vote, majority_vote(signs[r]))
        else:
            torch.testing.assert_close(w.expand(4, 20).double(), ref_weights[r], rtol=1e-5, atol=1e-6)
    assert state.rounds == 12


def test_llr_weights_change_the_vote_when_one_worker_is_reliable():
    """With one reliable and three noisy workers the weighted vote tracks the truth better than the majority."""
    signs, truth = heterogeneous_signs(60, [0.42, 0.42, 0.42, 0.02], 400, seed=3)
    config = LLRConfig(warmup_rounds=5, estimator="worker")
    state = LLRState.zeros("worker", 4, 1)
    llr_hits = mv_hits = 0
    for r in range(60):
        vote, _ = llr_round_(signs[r], state, config)
        if r >= 5:
            llr_hits += int((vote == truth[r]).sum())
            mv_hits += int((majority_vote(signs[r]) == truth[r]).sum())
    assert llr_hits > mv_hits + 0.1 * 55 * 400


def test_llr_weights_laplace_formula_and_finite_at_zero_disagreement():
    """w = log((t+1-k)/(k+1)); a worker that never disagreed gets a finite weight log(t+1)."""
    k = torch.tensor([[0.0], [3.0], [5.0]], dtype=torch.float64)
    t = torch.tensor([8.0], dtype=torch.float64)
    w = llr_weights(k, t, max_weight=100.0)
    p = (k + 1) / (t + 2)
    torch.testing.assert_close(w, torch.log((1 - p) / p).clamp(min=0.0))
    assert w[0, 0].item() == pytest.approx(math.log(9.0))


def test_llr_weights_clip_magnitude_and_sign():
    """|w| is capped at max_weight; negative weights are clipped to 0 unless negative_weights=True."""
    k = torch.tensor([0.0, 90.0])
    t = torch.tensor(100.0)
    assert llr_weights(k, t, max_weight=2.0).tolist() == [2.0, 0.0]
    assert llr_weights(k, t, max_weight=2.0, negative_weights=True).tolist() == [2.0, -2.0]


def test_weighted_vote_follows_weights_and_breaks_ties_by_majority():
    """A heavy worker outvotes two light ones; a zero weighted sum falls back to the majority, then +1."""
    signs = torch.tensor([[1, 1, -1, 1], [1, -1, 1, -1], [-1, 1, 1, -1]], dtype=torch.int8)
    heavy = torch.tensor([[0.1], [0.1], [1.0]])
    assert weighted_vote(signs, heavy).tolist() == [-1, 1, 1, -1]
    # All weights zero: every sum is 0, so the result is the majority vote.
    assert weighted_vote(signs, torch.zeros(3, 1)).tolist() == majority_vote(signs).tolist()
    # Exact cancellation with an even split of two workers: majority tie -> +1.
    two = torch.tensor([[1, -1], [-1, 1]], dtype=torch.int8)
    assert weighted_vote(two, torch.ones(2, 1)).tolist() == [1, 1]


def test_weighted_vote_treats_rounding_residue_as_a_tie():
    """-0.1 - 0.2 + 0.3 + 0 is -5.6e-17 in fp64 but zero in exact arithmetic: a tie, so the majority (+1) decides."""
    signs = torch.tensor([[-1], [-1], [1], [1]], dtype=torch.int8)
    weights = torch.tensor([[0.1], [0.2], [0.3], [0.0]], dtype=torch.float64)
    assert (-0.1 - 0.2 + 0.3) != 0.0
    assert weighted_vote(signs, weights).tolist() == [1]


def test_weighted_vote_rejects_mismatched_shapes():
    """Weights must have one row per worker."""
    with pytest.raises(ValueError, match=r"weighted_vote\(signs.shape=\(3, 4\), weights.shape=\(2, 1\)\)"):
        weighted_vote(torch.ones(3, 4), torch.ones(2, 1))


def test_warmup_zero_first_round_is_majority():
    """With warmup_rounds=0 the first round has all-zero weights and therefore returns the majority vote."""
    signs, _ = heterogeneous_signs(1, [0.3, 0.3, 0.3], 50)
    state = LLRState.zeros("coordinate", 3, 50)
    vote, w = llr_round_(signs[0], state, LLRConfig(warmup_rounds=0, estimator="coordinate"))
    assert torch.equal(w, torch.zeros(3, 50)) and torch.equal(vote, majority_vote(signs[0]))


def test_column_ids_slices():
    """column_ids maps coordinates to their tensor index, for a whole bucket or a slice of it."""
    assert column_ids([2, 3]).tolist() == [0, 0, 1, 1, 1]
    assert column_ids([2, 3], 1, 4).tolist() == [0, 1, 1]


def test_tensor_estimator_requires_columns():
    """The tensor estimator cannot guess which tensor a coordinate belongs to."""
    state = LLRState.zeros("tensor", 2, 2)
    with pytest.raises(ValueError, match=r"vote_weights\(columns=None\)"):
        vote_weights(state, LLRConfig(estimator="tensor"))
    with pytest.raises(ValueError, match=r"disagreement_counts\(columns=None\)"):
        disagreement_counts(torch.ones(2, 3), torch.ones(3), "tensor")


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(warmup_rounds=-1), ValueError, r"LLRConfig\(warmup_rounds=-1\): warmup_rounds must be >= 0"),
        (dict(warmup_rounds=2.5), TypeError, r"LLRConfig\(warmup_rounds=2.5\): warmup_rounds must be an int"),
        (dict(estimator="layer"), ValueError,
         r"LLRConfig\(estimator='layer'\): estimator must be one of 'coordinate', 'tensor', 'worker'"),
        (dict(decay=0.0), ValueError, r"LLRConfig\(decay=0.0\): decay must be in \(0, 1\]"),
        (dict(decay=1.5), ValueError, r"LLRConfig\(decay=1.5\): decay must be in \(0, 1\]"),
        (dict(max_weight=0.0), ValueError, r"LLRConfig\(max_weight=0.0\): max_weight must be finite and > 0"),
        (dict(max_weight=math.inf), ValueError, r"LLRConfig\(max_weight=inf\): max_weight must be finite and > 0"),
    ],
)
def test_config_rejects_bad_values(kwargs, error, message):
    """Each bad hyperparameter is named with its value and rule."""
    with pytest.raises(error, match=message):
        LLRConfig(**kwargs)


def test_state_zeros_rejects_unknown_estimator_and_multi_column_worker():
    """LLRState.zeros checks the estimator name and that 'worker' has one column."""
    with pytest.raises(ValueError, match=r"LLRState.zeros\(estimator='layer'\): estimator must be one of"):
        LLRState.zeros("layer", 2, 1)
    with pytest.raises(ValueError, match=r"LLRState.zeros\(num_columns=3\): the 'worker' estimator has exactly 1"):
        LLRState.zeros("worker", 2, 3)


def test_state_dict_round_trip_continues_identically():
    """Saving after 4 rounds and loading into fresh state gives the same next votes as continuing."""
    signs, _ = heterogeneous_signs(10, [0.4, 0.1, 0.3], 30, seed=5)
    config = LLRConfig(warmup_rounds=2, estimator="coordinate", decay=0.9)
    a = LLRState.zeros("coordinate", 3, 30)
    for r in range(4):
        llr_round_(signs[r], a, config)
    b = LLRState.zeros("coordinate", 3, 30)
    b.load_state_dict(a.state_dict())
    for r in range(4, 10):
        assert torch.equal(llr_round_(signs[r], a, config)[0], llr_round_(signs[r], b, config)[0])
    assert b.rounds == 10


def test_state_load_rejects_other_estimator_and_shape():
    """Statistics of another estimator or another worker count are refused."""
    saved = LLRState.zeros("worker", 3, 1).state_dict()
    with pytest.raises(ValueError, match=r"LLRState.load_state_dict\(estimator='worker'\)"):
        LLRState.zeros("tensor", 3, 1).load_state_dict(saved)
    with pytest.raises(ValueError, match=r"load_state_dict\(disagreements.shape=\(3, 1\)\): expected \(4, 1\)"):
        LLRState.zeros("worker", 4, 1).load_state_dict(saved)


@pytest.mark.parametrize("estimator", ["coordinate", "tensor"])
def test_simulator_llr_equals_llr_round(estimator):
    """The simulator's LLR aggregate is llr_round_ on the workers' signs (the same functions, the same bits)."""
    lengths = [5, 11]
    g = torch.Generator().manual_seed(9)
    sim = SignSGDSimulator(3, "llr", warmup_rounds=2, estimator=estimator)
    state = LLRState.zeros(estimator, 3, 16 if estimator == "coordinate" else 2)
    config = LLRConfig(warmup_rounds=2, estimator=estimator)
    for _ in range(6):
        grads = torch.randn(3, 16, generator=g)
        vote, _ = llr_round_(torch.where(grads >= 0, 1, -1).to(torch.int8), state, config, lengths)
        assert torch.equal(sim.aggregate(grads, lengths), vote.float())
    assert torch.equal(sim.llr_state().disagreements, state.disagreements)


@pytest.mark.parametrize("estimator", ["worker", "tensor"])
def test_pooled_vote_tables_equal_the_vote_on_every_pattern(estimator):
    """Each row of pooled_vote_tables is llr_vote of its group's weights on all 2^M sign patterns."""
    from lightning_pdist.sign.llr import pooled_vote_tables
    from lightning_pdist.sign.vote import sign_patterns

    groups = 1 if estimator == "worker" else 3
    state = LLRState.zeros(estimator, 4, groups)
    state.observations.fill_(100.0)
    state.disagreements.copy_(torch.tensor([[1.0], [10.0], [30.0], [60.0]]).expand(4, groups))
    config = LLRConfig(warmup_rounds=0, estimator=estimator)
    tables = pooled_vote_tables(state, config)
    patterns = sign_patterns(4)
    for j in range(groups):
        w = llr_weights(state.disagreements[:, j : j + 1], state.observations[j]).to(torch.float32)
        assert torch.equal(tables[j], weighted_vote(patterns, w) > 0)
    with pytest.raises(ValueError, match="coordinate"):
        pooled_vote_tables(LLRState.zeros("coordinate", 2, 3), LLRConfig(estimator="coordinate"))


def test_weight_sums_give_observation_weighted_mean_weights():
    """weight_sums: Σ_c w·t and Σ_c t with w = clamp(log((t+1-k)/(k+1)), 0, max); one pooled column gives w itself."""
    from lightning_pdist.sign.llr import LLRConfig, LLRState, weight_sums

    config = LLRConfig()
    state = LLRState("tensor", torch.tensor([[1.0, 30.0], [10.0, 2.0]], dtype=torch.float64),
                     torch.tensor([40.0, 60.0], dtype=torch.float64))  # fmt: skip
    w = torch.log((state.observations + 1 - state.disagreements) / (state.disagreements + 1)).clamp(0, config.max_weight)
    weighted, mass = weight_sums(state, config)
    torch.testing.assert_close(weighted / mass, (w * state.observations).sum(1) / 100.0)
    worker = LLRState("worker", torch.tensor([[3.0], [9.0]], dtype=torch.float64), torch.tensor([50.0], dtype=torch.float64))
    weighted, mass = weight_sums(worker, config)
    torch.testing.assert_close(weighted / mass, torch.log(torch.tensor([48.0 / 4.0, 42.0 / 10.0], dtype=torch.float64)))
