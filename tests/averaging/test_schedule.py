"""Tier 1: the warm-up/period schedule shared by local SGD, BMUF and EASGD."""

import pytest

from lightning_pdist.averaging.schedule import PeriodicSchedule


def test_schedule_matches_definition():
    """Steps 1..warmup average gradients; afterwards sync exactly when (t - warmup) % period == 0."""
    s = PeriodicSchedule(period=3, warmup_steps=2)
    assert [s.averages_gradients(t) for t in range(1, 6)] == [True, True, False, False, False]
    assert [t for t in range(1, 15) if s.syncs_after(t)] == [5, 8, 11, 14]


def test_period_one_syncs_every_local_step():
    """period=1 without warm-up synchronizes after every step."""
    s = PeriodicSchedule(period=1)
    assert all(s.syncs_after(t) for t in range(1, 10))
    assert not any(s.averages_gradients(t) for t in range(1, 10))


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(period=0), ValueError, r"X\(period=0\): period must be >= 1"),
        (dict(period=-3), ValueError, r"period=-3"),
        (dict(period=2.5), TypeError, r"period must be an int"),
        (dict(period=True), TypeError, r"period must be an int"),
        (dict(period=2, warmup_steps=-1), ValueError, r"X\(warmup_steps=-1\): warmup_steps must be >= 0"),
        (dict(period=2, warmup_steps=1.0), TypeError, r"warmup_steps must be an int"),
    ],
)
def test_bad_input_names_argument_value_and_rule(kwargs, exc, match):
    """Bad period/warmup_steps raise with the owner, the value and the rule."""
    with pytest.raises(exc, match=match):
        PeriodicSchedule(owner="X", **kwargs)
