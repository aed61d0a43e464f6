"""Tier 1 and 2: LossScaledRound, the sign hooks' loss-scale overflow agreement across buckets and ranks."""

import pytest
import torch
from sign.test_hooks import SIZES, GradProbe, _state_for, hand_made_grads, launch
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_pdist.sign.hooks import it_signsgd_hook, signsgd_mv_hook
from lightning_pdist.sign.overflow import LossScaledRound

SCALE = 2.0**10
ROUNDS = 5
OVERFLOW = (2, 1)  # (round, rank): rank 1 alone overflows in round 2, in its first tensor only


def test_finish_applies_staged_changes_only_without_overflow():
    """finish() applies the pass's staged changes and reports False; after an overflow it drops them and reports True."""
    log, scaled = [], LossScaledRound()
    scaled.begin(8.0)
    scaled.enter_bucket(0, "hook")
    scaled.stage(lambda: log.append("a"))
    assert scaled.finish() is False and log == ["a"] and scaled.loss_scale == 8.0
    scaled.begin(4.0)
    scaled.enter_bucket(0, "hook")  # a new pass: the same bucket may vote again
    scaled.stage(lambda: log.append("b"))
    scaled.overflow(1, [1])
    scaled.overflow(2, [0])  # the first overflow is the one reported
    assert scaled.overflow_at == (1, [1])
    assert scaled.finish() is True and log == ["a"] and not scaled.overflowed and scaled.overflow_at is None


@pytest.mark.parametrize("scale", [0.0, -1.0, float("inf"), float("nan"), "2"])
def test_begin_rejects_a_bad_loss_scale(scale):
    """A loss scale that is not finite and positive is refused, naming the value."""
    with pytest.raises(ValueError, match=r"LossScaledRound.begin\(loss_scale=.*\): the loss scale must be finite and > 0"):
        LossScaledRound().begin(scale)


def test_a_pass_that_is_not_finished_is_refused():
    """A bucket voting twice, or a new pass begun, without finish() in between raises RuntimeError."""
    scaled = LossScaledRound()
    scaled.enter_bucket(3, "signsgd_mv_hook")
    with pytest.raises(RuntimeError, match=r"signsgd_mv_hook: bucket 3 voted twice without LossScaledRound.finish"):
        scaled.enter_bucket(3, "signsgd_mv_hook")
    with pytest.raises(RuntimeError, match=r"LossScaledRound.begin: buckets \[3\] voted since the last finish\(\)"):
        scaled.begin(2.0)


CONFIGS = {
    "mv_signum_ef": (signsgd_mv_hook, dict(momentum=0.9, error_feedback=True)),
    "it_coordinate_signum": (it_signsgd_hook, dict(warmup_rounds=1, estimator="coordinate", momentum=0.5)),
    "it_worker_l1": (it_signsgd_hook, dict(warmup_rounds=1, estimator="worker", scale="l1")),
}


def _overflow_worker(rank, world_size, grads):
    """Per config: DDP with several buckets; the loss-scaled run with the overflow, and the fp32 run without that round."""
    results = {}
    for name, (hook, kwargs) in CONFIGS.items():
        for mode in ("scaled", "plain"):
            state = _state_for(hook, kwargs)
            scaling = LossScaledRound() if mode == "scaled" else None
            state.loss_scaling = scaling
            model = DDP(GradProbe(), bucket_cap_mb=0.005)  # 5,242 bytes: [13 + 1990 floats], [3001 floats]
            order = []

            def recording(s, bucket, hook=hook, order=order):
                order.append(bucket.index())
                return hook(s, bucket)

            model.register_comm_hook(state, recording)
            outs, skipped, overflow_at, states, orders = [], [], [], [], []
            for t in range(grads.shape[0]):
                if mode == "plain" and t == OVERFLOW[0]:
                    continue  # the reference: that round never happened
                g = grads[t, rank].clone()
                if mode == "scaled":
                    if (t, rank) == OVERFLOW:
                        g[0] = float("inf")
                    scaling.begin(SCALE)
                    g = g * SCALE
                model.zero_grad()
                order.clear()
                model(g).backward()
                orders.append(list(order))
                if scaling is not None:
                    overflow_at.append(scaling.overflow_at)
                    skipped.append(scaling.finish())
                outs.append(torch.cat([p.grad.reshape(-1) for p in model.module.params]).clone())
                states.append(state.state_dict())
            results[name, mode] = dict(outs=outs, skipped=skipped, overflow_at=overflow_at, states=states, orders=orders)
    return results


@pytest.fixture(scope="module")
def overflow_runs(tmp_path_factory):
    return launch(_overflow_worker, 2, tmp_path_factory.mktemp("overflow"), hand_made_grads(2, ROUNDS))


def _assert_states_equal(a, b):
    assert a["buckets"].keys() == b["buckets"].keys()
    for index in a["buckets"]:
        x, y = a["buckets"][index], b["buckets"][index]
        assert x["rounds"] == y["rounds"]
        for key in ("momentum", "residual"):
            assert (x[key] is None) == (y[key] is None) and (x[key] is None or torch.equal(x[key], y[key]))
        if x["llr"] is not None or y["llr"] is not None:
            for key in ("disagreements", "observations"):
                assert torch.equal(x["llr"][key], y["llr"][key])
            assert x["llr"]["rounds"] == y["llr"]["rounds"]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_overflow_in_a_later_bucket_on_one_rank_skips_the_whole_pass_on_every_rank(overflow_runs, name):
    """Rank 1 overflows in its last-voting bucket only: both ranks skip the pass, the bucket that voted first commits
    nothing (momentum, residual, LLR statistics, rounds), and every other round equals the fp32 run without it."""
    t = OVERFLOW[0]
    for rank, result in enumerate(overflow_runs):
        scaled, plain = result[name, "scaled"], result[name, "plain"]
        assert scaled["skipped"] == [s == t for s in range(ROUNDS)]
        index, ranks = scaled["overflow_at"][t]
        assert ranks == [1] and scaled["orders"][t][-1] == index and len(scaled["orders"][t]) == 2
        assert scaled["orders"][t][0] != index  # another bucket voted before the overflow was known
        # .grad after the skipped pass: NaN in the overflowed bucket, the vote in the one before, the same on every rank
        assert torch.isnan(scaled["outs"][t][: SIZES[0]]).all() and not torch.isnan(scaled["outs"][t][SIZES[0] :]).any()
        torch.testing.assert_close(scaled["outs"][t], overflow_runs[0][name, "scaled"]["outs"][t], equal_nan=True)
        _assert_states_equal(scaled["states"][t], scaled["states"][t - 1])
        kept = [s for s in range(ROUNDS) if s != t]
        for s, p in zip(kept, range(ROUNDS - 1)):
            torch.testing.assert_close(scaled["outs"][s], plain["outs"][p], atol=0, rtol=0)
        _assert_states_equal(scaled["states"][-1], plain["states"][-1])  # rounds included: the skipped pass is no round
