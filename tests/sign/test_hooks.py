"""Tier 2: the sign-vote DDP comm hooks on real gloo process groups (1, 2 and 3 ranks), and their states.

Multi-rank runs are fork-launched once per world size (module-scoped fixtures) and run many
scenarios each; the tests then check one property apiece against plain-torch references.
"""

import io
import math
import warnings

import pytest
import torch
import torch.distributed as dist
from _helpers import make_net, rank_batches, regression_data
from _ranks import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_pdist.sign.simulator import SignSGDSimulator
from lightning_pdist.core.accounting import CommMeter
from lightning_pdist.sign.hooks import (
    ITSignSGDState,
    SignSGDState,
    it_signsgd_hook,
    shard_bytes,
    sign_hook_bytes,
    signsgd_mv_hook,
)

SIZES = (3001, 1990, 13)  # d = 5004, not a multiple of 8·M for M = 2 or 3: the last slices are padded
D = sum(SIZES)
ROUNDS = 8
WARMUP = 3
# A good, a mediocre and a mostly inverting worker. With three honest-but-noisy workers the pooled weights,
# estimated against the vote itself, settle where no worker outweighs the other two and the LLR vote is the
# majority; an inverting worker gets weight 0 and the two others decide, so the weights visibly matter.
FLIPS = (0.1, 0.3, 0.9)


class GradProbe(nn.Module):
    """loss = sum_j <p_j, c_j>, so p_j.grad == c_j exactly: each rank's gradient is hand-made."""

    def __init__(self, sizes=SIZES, dtype=torch.float32):
        super().__init__()
        self.sizes = list(sizes)
        self.params = nn.ParameterList([nn.Parameter(torch.zeros(n, dtype=dtype)) for n in sizes])

    def forward(self, flat):
        return sum((p * c).sum() for p, c in zip(self.params, flat.split(self.sizes)))


def hand_made_grads(world_size, rounds=ROUNDS, seed=0):
    """(rounds, M, D) gradients: a common truth whose signs worker m flips with probability FLIPS[m]; zeros included."""
    g = torch.Generator().manual_seed(seed)
    truth = torch.randn(rounds, 1, D, generator=g)
    flip = torch.rand(rounds, world_size, D, generator=g) < torch.tensor(FLIPS[:world_size]).view(1, -1, 1)
    grads = torch.where(flip, -truth, truth) * (0.5 + torch.rand(rounds, world_size, D, generator=g))
    grads[:, :, :4] = 0.0  # sign(0) = +1
    grads[:, 0, 4] = -0.0
    return grads


def binary(x):
    return torch.where(x >= 0, 1.0, -1.0)


def reference_majority(grads):
    """Per round: sign(sum_m sign(g_m)), zeros and ties to +1."""
    return binary(binary(grads).sum(1))


def reference_it_signsgd(grads, warmup, estimator, lengths, decay=1.0, max_weight=math.log(99.0)):
    """Eqs. 3-4 in fp64 with Laplace-smoothed p = (k+1)/(t+2), w clipped to [0, max_weight], causal counts.

    Pooled estimators are the per-coordinate counts summed over their coordinates (the decay is linear).
    Returns the votes (rounds, D) and the final pooled counts k as (M, D)-, (M, 1)- or (M, T)-shaped tensors.
    """
    y = binary(grads).double()
    rounds, m, d = y.shape
    k, t = torch.zeros(m, d, dtype=torch.float64), torch.zeros(d, dtype=torch.float64)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    segments = [slice(a, a + n) for a, n in zip(starts, lengths)]

    def pooled(x):  # (..., d) -> (..., G)
        if estimator == "coordinate":
            return x
        if estimator == "worker":
            return x.sum(-1, keepdim=True)
        return torch.stack([x[..., s].sum(-1) for s in segments], -1)

    def spread(x):  # (..., G) -> (..., d)
        if estimator == "coordinate":
            return x
        if estimator == "worker":
            return x.expand(*x.shape[:-1], d)
        return torch.cat([x[..., j : j + 1].expand(*x.shape[:-1], n) for j, n in enumerate(lengths)], -1)

    votes = []
    for r in range(rounds):
        mv = binary(y[r].sum(0))
        if r < warmup:
            u = mv
        else:
            p = (spread(pooled(k)) + 1) / (spread(pooled(t)) + 2)
            w = torch.log((1 - p) / p).clamp(0.0, max_weight)
            total = (w * y[r]).sum(0)
            tie = total.abs() <= 1e-9 * w.abs().sum(0)
            u = torch.where(tie, mv, torch.where(total > 0, 1.0, -1.0))
        k = decay * k + (y[r] != u)
        t = decay * t + 1
        votes.append(u)
    return torch.stack(votes).float(), pooled(k)


# --- launching ---------------------------------------------------------------------------------------------


def _entry(rank, world_size, worker, out, args):
    torch.set_num_threads(1)
    result = worker(rank, world_size, *args)
    torch.save(result, f"{out}/rank{rank}.pt")
    # Give gloo's threads a moment to release the last collective's tensors before teardown (see sign_hooks).
    dist.barrier()


def launch(worker, world_size, out, *args):
    """Run worker(rank, world_size, *args) on world_size fork-started gloo ranks; return each rank's result."""
    run_ranks(_entry, world_size, out, worker, str(out), args)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def run_rounds(rank, grads, state, hook, dtype=torch.float32, layouts=None):
    """Backward through a DDP GradProbe once per round; return the gradients DDP hands back, (rounds, D)."""
    model = DDP(GradProbe(dtype=dtype))

    def recording(s, bucket):
        if layouts is not None:
            layouts.append([p.numel() for p in bucket.parameters()])
        return hook(s, bucket)

    model.register_comm_hook(state, recording)
    outs = []
    for t in range(grads.shape[0]):
        model.zero_grad()
        model(grads[t, rank].to(dtype)).backward()
        outs.append(torch.cat([p.grad.reshape(-1) for p in model.module.params]).clone())
    return torch.stack(outs)


def roundtrip(state_dict):
    """What a checkpoint does to a state dict: serialize and load it back."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


# Configurations compared with the simulator (and, for the IT ones, the reference).
IT_CONFIGS = {
    "coordinate": dict(estimator="coordinate"),
    "worker": dict(estimator="worker"),
    "tensor_ema": dict(estimator="tensor", decay=0.8),
}
STATEFUL_CONFIGS = {
    "mv_signum_ef": (signsgd_mv_hook, dict(momentum=0.9, error_feedback=True)),
    "it_coordinate_signum_ef": (it_signsgd_hook, dict(warmup_rounds=WARMUP, estimator="coordinate", momentum=0.9,
                                                      error_feedback=True)),
}


def _state_for(hook, kwargs):
    cls = ITSignSGDState if hook is it_signsgd_hook else SignSGDState
    return cls(meter=CommMeter(), **kwargs)


def _three_rank_worker(rank, world_size, grads):
    results = {}
    layouts = []
    state = SignSGDState(meter=CommMeter())
    results["mv"] = run_rounds(rank, grads, state, signsgd_mv_hook, layouts=layouts)
    results["mv_bytes"] = dict(state.meter.by_kind)
    results["layouts"] = layouts
    results["canonical"] = list(state.buckets[0].lengths)

    for name, kwargs in IT_CONFIGS.items():
        state = ITSignSGDState(meter=CommMeter(), warmup_rounds=WARMUP, **kwargs)
        out = run_rounds(rank, grads, state, it_signsgd_hook)
        results[f"it_{name}"] = (out, state.state_dict(), dict(state.meter.by_kind))

    for name, (hook, kwargs) in STATEFUL_CONFIGS.items():
        state = _state_for(hook, kwargs)
        results[name] = run_rounds(rank, grads, state, hook)
        # Interrupted run: 4 rounds, a checkpoint, then a new DDP model and a new state restored from it.
        first = _state_for(hook, kwargs)
        head = run_rounds(rank, grads[:4], first, hook)
        resumed = _state_for(hook, kwargs)
        resumed.load_state_dict(roundtrip(first.state_dict()))
        tail = run_rounds(rank, grads[4:], resumed, hook)
        results[f"{name}_resumed"] = torch.cat([head, tail])

    results["fp16"] = run_rounds(rank, grads[:2].half(), SignSGDState(), signsgd_mv_hook, dtype=torch.float16)
    results["bf16"] = run_rounds(rank, grads[:2].bfloat16(), ITSignSGDState(warmup_rounds=2), it_signsgd_hook,
                                 dtype=torch.bfloat16)

    # Non-finite gradients on rank 1 only: every rank must raise (none may wait in a collective) ...
    bad = grads[:2].clone()
    bad[1, 1, 7] = float("nan")
    try:
        run_rounds(rank, bad, ITSignSGDState(warmup_rounds=0), it_signsgd_hook)
        results["nan_raise"] = None
    except FloatingPointError as error:
        results["nan_raise"] = str(error)
    # skip_step needs a round (LossScaledRound) whose owner skips the step: refused on every rank before any collective.
    try:
        run_rounds(rank, grads[:2], SignSGDState(nonfinite="skip_step"), signsgd_mv_hook)
        results["skip_without_round"] = None
    except RuntimeError as error:
        results["skip_without_round"] = str(error)
    # ... or, with nonfinite="propagate", every rank gets a NaN bucket and the state skips that round.
    state = SignSGDState(nonfinite="propagate", momentum=0.5)
    bad[1, 1, 7] = float("inf")
    results["nan_propagate"] = run_rounds(rank, bad, state, signsgd_mv_hook)
    results["nan_propagate_rounds"] = state.buckets[0].rounds
    return results


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    grads = hand_made_grads(3)
    return grads, launch(_three_rank_worker, 3, tmp_path_factory.mktemp("three"), grads)


def test_three_rank_majority_equals_reference(three_ranks):
    """With 3 gloo ranks every rank gets sign(sum_m sign(g_m)) on hand-made gradients (zeros to +1, padding unseen)."""
    grads, results = three_ranks
    expected = reference_majority(grads)
    for rank in range(3):
        assert torch.equal(results[rank]["mv"], expected)


def test_state_follows_ddp_bucket_rebuild(three_ranks):
    """DDP reorders the bucket after its first iteration; the state keeps its first (canonical) layout throughout."""
    _, results = three_ranks
    layouts = results[0]["layouts"]
    assert layouts[0] == list(SIZES) and layouts[-1] != layouts[0] and sorted(layouts[-1]) == sorted(SIZES)
    assert results[0]["canonical"] == list(SIZES)


@pytest.mark.parametrize("name", list(IT_CONFIGS))
def test_it_signsgd_warmup_equals_majority(three_ranks, name):
    """During warm-up IT-signSGD's result is exactly the majority vote."""
    _, results = three_ranks
    for rank in range(3):
        out = results[rank][f"it_{name}"][0]
        assert torch.equal(out[:WARMUP], results[rank]["mv"][:WARMUP])


@pytest.mark.parametrize("name", list(IT_CONFIGS))
def test_it_signsgd_votes_and_weights_equal_reference(three_ranks, name):
    """After warm-up the votes and the disagreement statistics behind the weights equal eqs. 3-4 written out here."""
    grads, results = three_ranks
    kwargs = IT_CONFIGS[name]
    votes, counts = reference_it_signsgd(grads, WARMUP, kwargs["estimator"], SIZES, kwargs.get("decay", 1.0))
    for rank in range(3):
        assert torch.equal(results[rank][f"it_{name}"][0], votes)
    # The weights are log((t + 1 - k)/(k + 1)) of these counts; per coordinate, each rank holds its slice.
    slices = [results[rank][f"it_{name}"][1]["buckets"][0]["llr"]["disagreements"] for rank in range(3)]
    held = torch.cat(slices, dim=1) if kwargs["estimator"] == "coordinate" else slices[0]
    if kwargs["estimator"] != "coordinate":
        assert all(torch.equal(s, slices[0]) for s in slices)
    torch.testing.assert_close(held.double(), counts, rtol=1e-6, atol=1e-6)
    # The weights matter here: after warm-up the LLR vote departs from the majority somewhere.
    assert not torch.equal(votes[WARMUP:], reference_majority(grads)[WARMUP:])


@pytest.mark.parametrize("name", [*[f"it_{n}" for n in IT_CONFIGS], "mv", *STATEFUL_CONFIGS])
def test_simulator_equals_three_real_ranks(three_ranks, name):
    """The one-process simulator gives the same aggregate, to the bit, as 3 real ranks for the same inputs."""
    grads, results = three_ranks
    if name == "mv":
        sim, key = SignSGDSimulator(3), "mv"
    elif name in STATEFUL_CONFIGS:
        hook, kwargs = STATEFUL_CONFIGS[name]
        aggregation = "llr" if hook is it_signsgd_hook else "majority"
        sim, key = SignSGDSimulator(3, aggregation, **kwargs), name
    else:
        sim, key = SignSGDSimulator(3, "llr", warmup_rounds=WARMUP, **IT_CONFIGS[name[3:]]), name
    out = results[0][key] if key in ("mv", *STATEFUL_CONFIGS) else results[0][key][0]
    expected = torch.stack([sim.aggregate(grads[t], SIZES) for t in range(ROUNDS)])
    assert torch.equal(out, expected)


@pytest.mark.parametrize("name", list(STATEFUL_CONFIGS))
def test_checkpoint_resume_continues_identically(three_ranks, name):
    """Restoring each rank's state_dict into a new state and a new DDP model reproduces the uninterrupted run."""
    _, results = three_ranks
    for rank in range(3):
        assert torch.equal(results[rank][f"{name}_resumed"], results[rank][name])


def test_bytes_per_direction_within_ten_percent_of_d_over_8(three_ranks):
    """The meter's bytes per step and direction equal sign_hook_bytes and lie within 10% of (M-1)/M * d/8."""
    _, results = three_ranks
    ideal = 2 / 3 * D / 8
    fp32_all_reduce = 2 * 2 / 3 * 4 * D
    for by_kind, estimator in [(results[0]["mv_bytes"], None), (results[0]["it_worker"][2], "worker")]:
        per_step = {kind: n / ROUNDS for kind, n in by_kind.items()}
        assert per_step == sign_hook_bytes(D, 3, len(SIZES), estimator=estimator)
        for kind in ("sign_all_to_all", "sign_all_gather"):
            assert abs(per_step[kind] - ideal) <= 0.1 * ideal, (kind, per_step[kind], ideal)
        assert fp32_all_reduce / sum(per_step.values()) >= 28


def test_half_precision_buckets_vote_and_keep_dtype(three_ranks):
    """fp16 and bf16 buckets vote on their signs and come back in their own dtype."""
    grads, results = three_ranks
    for key, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        out = results[0][key]
        assert out.dtype == dtype
        assert torch.equal(out.float(), reference_majority(grads[:2].to(dtype).float()))


def test_nonfinite_gradient_raises_on_every_rank(three_ranks):
    """A NaN on rank 1 makes every rank raise a FloatingPointError naming the bucket and the rank, instead of voting."""
    _, results = three_ranks
    for rank in range(3):
        message = results[rank]["nan_raise"]
        assert message is not None and "bucket 0 holds non-finite gradients (NaN/Inf) on rank(s) [1]" in message


def test_skip_step_without_a_round_is_refused_on_every_rank(three_ranks):
    """nonfinite='skip_step' without state.loss_scaling is refused by the hook (nothing could drop the pass)."""
    _, results = three_ranks
    for rank in range(3):
        assert "signsgd_mv_hook: nonfinite='skip_step' needs state.loss_scaling" in results[rank]["skip_without_round"]


def test_nonfinite_propagate_returns_nan_and_skips_the_round(three_ranks):
    """nonfinite='propagate' hands every rank a NaN bucket for that round and leaves the state one round behind."""
    grads, results = three_ranks
    for rank in range(3):
        out = results[rank]["nan_propagate"]
        assert torch.isnan(out[1]).all()
        assert torch.equal(out[0], reference_majority(grads[:1])[0])  # first momentum 0.5·g: the signs of g
        assert results[rank]["nan_propagate_rounds"] == 1


# --- two ranks: a real model trained with SGD --------------------------------------------------------------

STEPS, LR = 5, 0.05


def _train(rank, world_size, state, hook, lr):
    torch.manual_seed(0)
    model = DDP(make_net())
    model.register_comm_hook(state, hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    batches = rank_batches(regression_data(), rank, world_size, batch_size=4)
    for x, y in batches[:STEPS]:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])


def _two_rank_worker(rank, world_size):
    return {
        "mv": _train(rank, world_size, SignSGDState(), signsgd_mv_hook, LR),
        "it": _train(rank, world_size, ITSignSGDState(warmup_rounds=2, estimator="tensor", momentum=0.9,
                                                      error_feedback=True), it_signsgd_hook, 10 * LR),
    }


def _reference_training(aggregate, lr):
    """Plain torch: both ranks' gradients on their own batches, aggregated, applied by the same SGD."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same kernels as the one-thread workers, so the gradients agree to the bit
    try:
        torch.manual_seed(0)
        model = make_net()
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        params = list(model.parameters())
        batches = [rank_batches(regression_data(), r, 2, batch_size=4) for r in range(2)]
        for step in range(STEPS):
            grads = []
            for r in range(2):
                model.zero_grad()
                x, y = batches[r][step]
                nn.functional.mse_loss(model(x), y).backward()
                grads.append(torch.cat([p.grad.reshape(-1) for p in params]))
            update = aggregate(torch.stack(grads), [p.numel() for p in params])
            for p, u in zip(params, update.split([p.numel() for p in params])):
                p.grad = u.view_as(p).clone()
            optimizer.step()
        return torch.cat([p.detach().reshape(-1) for p in params])
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return launch(_two_rank_worker, 2, tmp_path_factory.mktemp("two"))


def test_ddp_training_with_majority_hook_matches_reference(two_ranks):
    """A 2-rank DDP model trained 5 steps with signsgd_mv_hook ends identical on both ranks and equal to plain torch."""
    expected = _reference_training(lambda g, _: binary(binary(g).sum(0)), LR)
    assert torch.equal(two_ranks[0]["mv"], two_ranks[1]["mv"])
    torch.testing.assert_close(two_ranks[0]["mv"], expected, rtol=0, atol=1e-6)


def test_ddp_training_with_it_signsgd_signum_ef_matches_simulator(two_ranks):
    """The same with it_signsgd_hook (tensor estimator, Signum, EF) equals the simulator driving plain torch."""
    sim = SignSGDSimulator(2, "llr", warmup_rounds=2, estimator="tensor", momentum=0.9, error_feedback=True)
    expected = _reference_training(lambda g, lengths: sim.aggregate(g, lengths), 10 * LR)
    assert torch.equal(two_ranks[0]["it"], two_ranks[1]["it"])
    torch.testing.assert_close(two_ranks[0]["it"], expected, rtol=0, atol=1e-6)


# --- one rank ---------------------------------------------------------------------------------------------


def _one_rank_worker(rank, world_size, grads):
    results = {}
    for name, hook, state in [
        ("mv", signsgd_mv_hook, SignSGDState(meter=CommMeter())),
        ("it_warm", it_signsgd_hook, ITSignSGDState(meter=CommMeter(), warmup_rounds=0, estimator="coordinate")),
        ("it", it_signsgd_hook, ITSignSGDState(meter=CommMeter(), warmup_rounds=2)),
    ]:
        results[name] = (run_rounds(rank, grads, state, hook), state.meter.total_bytes)
    for dtype in (torch.float16, torch.bfloat16):
        results[dtype] = run_rounds(rank, grads[:2].to(dtype), SignSGDState(), signsgd_mv_hook, dtype=dtype)
    results["ef"] = run_rounds(rank, grads[:3], SignSGDState(error_feedback=True), signsgd_mv_hook)

    # Another rank's state (or another world size) is refused, not silently misused.
    state = SignSGDState()
    state.load_state_dict({"rank": 1, "world_size": 3, "buckets": {}})
    try:
        run_rounds(rank, grads[:1], state, signsgd_mv_hook)
        results["wrong_rank"] = None
    except RuntimeError as error:
        results["wrong_rank"] = str(error)

    # The same state on a model whose bucket regroups tensors: that bucket restarts, with a warning.
    state = SignSGDState(momentum=0.9)
    model_a, model_b = DDP(GradProbe((4, 3))), DDP(GradProbe((6,)))
    model_a.register_comm_hook(state, signsgd_mv_hook)
    model_b.register_comm_hook(state, signsgd_mv_hook)
    model_a(torch.ones(7)).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model_b(torch.ones(6)).backward()
    results["regroup_warnings"] = [str(w.message) for w in caught]
    results["regroup_lengths"] = state.buckets[0].lengths
    return results


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    grads = hand_made_grads(1, rounds=4)
    return grads, launch(_one_rank_worker, 1, tmp_path_factory.mktemp("one"), grads)[0]


@pytest.mark.parametrize("name", ["mv", "it_warm", "it"])
def test_one_rank_result_is_sign_of_grad(one_rank, name):
    """With one rank both hooks return sign(grad) (zeros to +1) and send nothing."""
    grads, results = one_rank
    out, sent = results[name]
    assert torch.equal(out, binary(grads[:, 0]))
    assert sent == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_one_rank_half_precision(one_rank, dtype):
    """fp16/bf16 buckets with one rank return sign(grad) in the bucket's dtype."""
    grads, results = one_rank
    out = results[dtype]
    assert out.dtype == dtype and torch.equal(out.float(), binary(grads[:2, 0].to(dtype).float()))


def test_one_rank_error_feedback_is_ef_signsgd(one_rank):
    """With one rank and error feedback the bucket is Karimireddy's per-tensor scaled sign, residual carried over."""
    grads, results = one_rank
    e = torch.zeros(D)
    for t in range(3):
        p = grads[t, 0] + e
        delta = torch.cat([s.abs().mean() * binary(s) for s in p.split(list(SIZES))])
        e = p - delta
        torch.testing.assert_close(results["ef"][t], delta)


def test_state_from_another_rank_is_refused(one_rank):
    """Running a state restored from rank 1 of 3 on rank 0 of 1 raises a RuntimeError that names both."""
    _, results = one_rank
    assert "belongs to rank 1 of 3" in results["wrong_rank"] and "now runs on rank 0 of 1" in results["wrong_rank"]


def test_regrouped_bucket_restarts_with_a_warning(one_rank):
    """A bucket index that now holds other tensors gets fresh state and a warning naming the old and new layouts."""
    _, results = one_rank
    assert results["regroup_lengths"] == (6,)
    messages = results["regroup_warnings"]
    assert any("DDP bucket 0 now holds tensors of sizes [6]" in m and "0: [4, 3]" in m for m in messages)


# --- in-process: arguments, state dicts, byte model ----------------------------------------------------------


@pytest.mark.parametrize(
    "cls, kwargs, error, message",
    [
        (SignSGDState, dict(momentum=1.0), ValueError, r"SignSGDState\(momentum=1.0\): momentum must be in \[0, 1\)"),
        (SignSGDState, dict(nonfinite="skip"), ValueError,
         r"SignSGDState\(nonfinite='skip'\): nonfinite must be one of 'raise', 'skip_step', 'propagate'"),
        (SignSGDState, dict(error_feedback=1), TypeError,
         r"SignSGDState\(error_feedback=1\): error_feedback must be a bool"),
        (ITSignSGDState, dict(warmup_rounds=-2), ValueError,
         r"ITSignSGDState\(warmup_rounds=-2\): warmup_rounds must be >= 0"),
        (ITSignSGDState, dict(estimator="per_layer"), ValueError,
         r"ITSignSGDState\(estimator='per_layer'\): estimator must be one of 'coordinate', 'tensor', 'worker'"),
        (ITSignSGDState, dict(momentum=-0.1), ValueError, r"ITSignSGDState\(momentum=-0.1\): momentum must be in"),
    ],
)
def test_states_reject_bad_arguments(cls, kwargs, error, message):
    """Each bad argument is named with its value and the rule."""
    with pytest.raises(error, match=message):
        cls(**kwargs)


def test_hooks_reject_the_other_state_type():
    """Each hook insists on its own state class (an IT state on the majority hook would ignore its settings)."""
    with pytest.raises(TypeError, match=r"signsgd_mv_hook\(state=ITSignSGDState\): state must be a SignSGDState"):
        signsgd_mv_hook(ITSignSGDState(), None)
    with pytest.raises(TypeError, match=r"it_signsgd_hook\(state=SignSGDState\): state must be an ITSignSGDState"):
        it_signsgd_hook(SignSGDState(), None)


WORKER_STATS = {"estimator": "worker", "disagreements": torch.zeros(2, 1), "observations": torch.zeros(1), "rounds": 2}


def _saved_bucket(**overrides):
    bucket = {"lengths": [4], "rounds": 2, "momentum": None, "residual": None, "llr": None}
    bucket.update(overrides)
    return {"rank": 0, "world_size": 2, "buckets": {0: bucket}}


@pytest.mark.parametrize(
    "state, saved, message",
    [
        (SignSGDState(), _saved_bucket(momentum=torch.zeros(4)),
         "a Signum momentum buffer, but this state has momentum=0.0"),
        (SignSGDState(), _saved_bucket(residual=torch.zeros(4)),
         "an error-feedback residual, but this state has error_feedback=False"),
        (SignSGDState(), _saved_bucket(llr=WORKER_STATS),
         "LLR statistics, but this state takes the plain majority vote"),
        (ITSignSGDState(estimator="tensor"), _saved_bucket(llr=WORKER_STATS),
         "LLR statistics of estimator='worker', but this state has estimator='tensor'"),
    ],
)
def test_load_state_dict_rejects_buffers_of_other_settings(state, saved, message):
    """A checkpoint whose buffers this state would ignore or misread is refused with the reason."""
    with pytest.raises(ValueError, match=rf"load_state_dict\(bucket 0\): the saved state holds {message}"):
        state.load_state_dict(saved)


def test_state_dict_holds_no_process_group_and_round_trips():
    """state_dict carries rank, world size and buffers only, and load_state_dict restores them."""
    state = SignSGDState(process_group=object(), momentum=0.5)
    saved = _saved_bucket(momentum=torch.arange(4.0))
    state.load_state_dict(saved)
    again = state.state_dict()
    assert set(again) == {"rank", "world_size", "buckets"}
    assert again["rank"] == 0 and again["world_size"] == 2 and again["buckets"][0]["rounds"] == 2
    assert torch.equal(again["buckets"][0]["momentum"], torch.arange(4.0))


def test_sign_hook_bytes_formula():
    """The byte model: (M-1)(C+H) up and (M-1)(C+G) down, C = ceil(d/8M), nothing for one rank."""
    c = shard_bytes(1000, 4)
    assert c == 32
    assert sign_hook_bytes(1000, 4) == {"sign_all_to_all": 3 * (32 + 4), "sign_all_gather": 3 * 32}
    assert sign_hook_bytes(1000, 4, 5, error_feedback=True, estimator="tensor") == {
        "sign_all_to_all": 3 * (32 + 4 * 6),
        "sign_all_gather": 3 * (32 + 4 * 4 * 5),
    }
    assert sign_hook_bytes(1000, 1) == {"sign_all_to_all": 0, "sign_all_gather": 0}


def test_sign_hook_bytes_with_scales_and_participation_flags():
    """scale='l1' adds T fp32 scales to the header, find_unused_parameters ceil(T/32) flag words."""
    assert sign_hook_bytes(1000, 4, 5, scale="l1") == sign_hook_bytes(1000, 4, 5, error_feedback=True)
    assert sign_hook_bytes(1000, 4, 40, find_unused_parameters=True)["sign_all_to_all"] == 3 * (32 + 4 * (1 + 2))
    assert sign_hook_bytes(1000, 4, 5, scale="l1", find_unused_parameters=True)["sign_all_to_all"] == 3 * (32 + 4 * 7)


def test_participation_flags_round_trip():
    """pack_flags/unpack_flags keep every flag, bit 31 included; used_runs skips unused tensors and merges runs."""
    from lightning_pdist.sign.participation import pack_flags, unpack_flags, used_runs

    flags = [j % 3 == 0 or j == 31 for j in range(70)]
    assert unpack_flags(pack_flags(flags).unsqueeze(0), 70)[0].tolist() == flags
    used = torch.tensor([True, True, False, True])
    assert used_runs([3, 4, 5, 6], used, 2, 16, per_tensor=False) == [(0, 0, 5), (0, 10, 14)]
    assert used_runs([3, 4, 5, 6], used, 0, 18, per_tensor=True) == [(0, 0, 3), (1, 3, 7), (3, 12, 18)]
    assert used_runs([3, 4], None, 0, 7, per_tensor=False) == [(0, 0, 7)]


def test_watch_is_required_with_find_unused_parameters():
    """find_unused_parameters=True without state.watch(...) raises, naming the call to make."""
    from lightning_pdist.sign.participation import ParticipationTracker

    with pytest.raises(RuntimeError, match=r"signsgd_mv_hook: find_unused_parameters=True but tensors \[0\] .* call "
                                           r"state.watch\(model.parameters\(\)\)"):  # fmt: skip
        ParticipationTracker().take([123], "signsgd_mv_hook")


def test_bad_scale_is_refused_by_the_state():
    """SignSGDState(scale=...) names the argument, the value and the choices."""
    with pytest.raises(ValueError, match=r"^SignSGDState\(scale='sign'\): scale must be one of 'unit', 'l1'"):
        SignSGDState(scale="sign")
