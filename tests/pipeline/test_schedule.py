"""Tier 1: pipeline schedules as values (actions, generators, validator, derived stash depths and bubbles)."""

import pytest

from lightning_pdist.pipeline.schedule import (
    SCHEDULES,
    Action,
    Schedule,
    StageCursor,
    bubble_formula,
    build_schedule,
    validate,
)


@pytest.mark.parametrize("text", ["0F0", "1F3", "0B2", "12U105"])
def test_action_text_round_trips(text):
    """The compact form parses back to the same action."""
    assert str(Action.parse(text)) == text


@pytest.mark.parametrize("bad", ["F3", "1X3", "1F", "", "1f3"])
def test_action_parse_refuses_malformed_text(bad):
    """Malformed text or an unknown kind is refused with the expected form."""
    with pytest.raises(ValueError, match="Action"):
        Action.parse(bad)


@pytest.mark.parametrize("name", SCHEDULES)
def test_schedule_text_round_trips(name):
    """A schedule written with to_text reads back equal."""
    s = build_schedule(name, 3, 4, num_batches=2)
    assert Schedule.from_text(s.to_text()) == s


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("K, m", [(2, 1), (2, 4), (3, 3), (4, 4), (4, 16)])
def test_flushed_bubble_equals_the_formula(name, K, m):
    """Simulated idle share of GPipe and 1F1B equals (K-1)/(m+K-1), for any backward cost."""
    for cost in (1.0, 2.0):
        assert validate(build_schedule(name, K, m, 3), cost).bubble_fraction == pytest.approx(bubble_formula(K, m))


@pytest.mark.parametrize("K, m", [(2, 4), (4, 4), (4, 8)])
def test_asynchronous_schedules_have_less_bubble(K, m):
    """Without flushes the bubble shrinks with the number of batches (ramp up and down only once)."""
    few = validate(build_schedule("pipedream", K, m, 2)).bubble_fraction
    many = validate(build_schedule("pipedream", K, m, 20)).bubble_fraction
    assert many < few < bubble_formula(K, m)
    assert many < 0.1


@pytest.mark.parametrize(
    "name, vs, expected",
    [("gpipe", False, (1, 1, 1, 1)), ("1f1b", False, (1, 1, 1, 1)), ("pipedream", False, (4, 3, 2, 1)),
     ("pipedream", True, (4, 4, 4, 4)), ("2bw", False, (2, 2, 2, 2))],
)  # fmt: skip
def test_stash_depth_derived_from_the_schedule(name, vs, expected):
    """Weight versions alive per stage: PipeDream K-s (vertical sync K everywhere), 2BW 2, flushed 1."""
    assert validate(build_schedule(name, 4, 4, 5, vertical_sync=vs)).stash_depth == expected


@pytest.mark.parametrize("name", ["1f1b", "pipedream", "2bw"])
def test_in_flight_is_the_warm_up(name):
    """1F1B-style schedules hold at most K - s micro-batches on stage s; GPipe holds all m."""
    assert validate(build_schedule(name, 4, 8, 3)).max_in_flight == (4, 3, 2, 1)
    assert validate(build_schedule("gpipe", 4, 8, 3)).max_in_flight == (8, 8, 8, 8)


def test_pipedream_updates_after_every_backward_and_2bw_per_batch():
    """PipeDream: B j then U j for every j; 2BW and flushed: one U after the batch's last B."""
    pd = build_schedule("pipedream", 2, 4, 2).programs[0]
    assert [str(a) for a in pd if a.kind == "U"] == [f"0U{j}" for j in range(8)]
    for name in ("2bw", "1f1b", "gpipe"):
        prog = build_schedule(name, 2, 4, 2).programs[1]
        assert [str(a) for a in prog if a.kind == "U"] == ["1U3", "1U7"]


def test_1f1b_program_is_warm_up_then_alternation():
    """Stage 0 of a 3-stage 1F1B: three forwards, alternation, cool-down, one update."""
    prog = " ".join(map(str, build_schedule("1f1b", 3, 4).programs[0]))
    assert prog == "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3 0U3"


@pytest.mark.parametrize("name", SCHEDULES)
def test_windows_concatenate_to_the_finite_schedule(name):
    """Running a cursor one batch at a time (as the strategy does) gives the schedule's programs exactly."""
    s = build_schedule(name, 3, 4, num_batches=4)
    for stage in range(3):
        cursor, program = StageCursor(name, 3, stage), []
        for _ in range(4):
            cursor.admit(4)
            program += cursor.run()
        program += cursor.run(draining=True)
        assert tuple(program) == s.programs[stage]
        assert cursor.ends == [] and cursor.first_batch == 4  # finished batches are forgotten


def test_validator_refuses_a_backward_before_its_forward():
    """B j ahead of F j on the same stage is named."""
    s = build_schedule("gpipe", 2, 2)
    prog = list(s.programs[1])
    prog[0], prog[2] = prog[2], prog[0]
    bad = Schedule("gpipe", 2, 2, 1, (s.programs[0], tuple(prog)))
    with pytest.raises(ValueError, match="before stage 1's forward"):
        validate(bad)


def test_validator_refuses_a_deadlock():
    """Stage 0 waiting for a backward that waits for stage 0's later forward deadlocks, and says where."""
    s = build_schedule("gpipe", 2, 2)
    p0 = tuple(Action.parse(t) for t in "0F0 0B0 0F1 0B1 0U1".split())
    p1 = tuple(Action.parse(t) for t in "1F1 1F0 1B0 1B1 1U1".split())
    with pytest.raises(ValueError, match="deadlocks"):
        validate(Schedule("gpipe", 2, 2, 1, (p0, p1)))
    assert validate(s).makespan > 0


def test_validator_refuses_a_missing_or_misplaced_update():
    """An update must follow the backward that closes it."""
    s = build_schedule("pipedream", 2, 2)
    prog = tuple(a for a in s.programs[0] if str(a) != "0U1")
    with pytest.raises(ValueError, match="updates after"):
        validate(Schedule("pipedream", 2, 2, 1, (prog, s.programs[1])))


def test_validator_refuses_a_2bw_version_that_does_not_exist_yet():
    """With one micro-batch per batch and three stages, 2BW's one-step delay cannot hold."""
    with pytest.raises(ValueError, match="needs weight version"):
        validate(build_schedule("2bw", 3, 1, 4))


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(name="zb"), "name must be one of"), (dict(num_stages=0), "num_stages must be >= 1"),
     (dict(num_microbatches=0), "num_microbatches must be >= 1"), (dict(vertical_sync=True, name="1f1b"), "vertical sync")],
)  # fmt: skip
def test_build_schedule_refuses_bad_arguments(kwargs, match):
    """Each bad argument is named with its rule."""
    args = dict(name="pipedream", num_stages=2, num_microbatches=2) | kwargs
    with pytest.raises(ValueError, match=match):
        build_schedule(**args)


def test_timeline_draws_the_bubble():
    """The text timeline shows idle slots as '..' and one row per stage."""
    drawing = build_schedule("gpipe", 2, 2).timeline()
    assert drawing.splitlines() == ["stage 0 | F0 F1 .. .. B0 B1", "stage 1 | .. F0 F1 B0 B1 .."]
