"""Tier 1: each ScheduleSpec's facts are what its built schedule does, and only the specs read schedule names."""

import ast
from pathlib import Path

import pytest

from lightning_pdist.pipeline.config import PipelineConfig
from lightning_pdist.pipeline.schedule import SCHEDULES, SPECS, build_schedule, schedule_spec, validate

K, M, BATCHES = 3, 4, 3
PIPELINE = Path(__file__).resolve().parents[2] / "lightning_pdist" / "pipeline"


@pytest.mark.parametrize("name", SCHEDULES)
def test_each_spec_states_what_its_schedule_does(name):
    """flushed, all_forwards_first, updates_per_microbatch and delayed_weights match the simulated programs."""
    spec, schedule = SPECS[name], build_schedule(name, K, M, BATCHES)
    stats = validate(schedule)
    flushed = True
    for s, program in enumerate(schedule.programs):
        updates = [a.microbatch for a in program if a.kind == "U"]
        assert (updates == list(range(M * BATCHES))) == spec.updates_per_microbatch
        at = {(a.kind, a.microbatch): i for i, a in enumerate(program)}
        # Flushed: every stage updates once per batch, before the next batch's first forward.
        flushed &= updates == [M * (b + 1) - 1 for b in range(BATCHES)]
        flushed &= all(at[("U", M * b - 1)] < at[("F", M * b)] for b in range(1, BATCHES) if ("U", M * b - 1) in at)
        assert (stats.max_in_flight[s] == M) == spec.all_forwards_first
        assert all(v == max(0, j // M - 1) for j, v in stats.versions[s].items()) == spec.delayed_weights
    assert flushed == spec.flushed


@pytest.mark.parametrize("name", SCHEDULES)
def test_vertical_sync_is_built_exactly_where_the_spec_allows_it(name):
    """One rule, stated by the spec: build_schedule builds vertical sync where it is allowed and names the rule elsewhere."""
    if SPECS[name].allows_vertical_sync:
        assert build_schedule(name, K, M, vertical_sync=True).vertical_sync
    else:
        with pytest.raises(ValueError, match=rf"build_schedule\(vertical_sync=True\): vertical sync applies to "
                                             rf"schedule='pipedream', not '{name}'"):  # fmt: skip
            build_schedule(name, K, M, vertical_sync=True)


def test_a_config_holds_its_schedules_spec_and_unknown_names_are_refused():
    """The config looks its spec up once; an unknown name (or a non-string) is refused naming the choices."""
    assert all(PipelineConfig(schedule=name).spec is SPECS[name] for name in SCHEDULES)
    with pytest.raises(ValueError, match=r"StageCursor\(schedule='zb'\): schedule must be one of 'gpipe', '1f1b'"):
        schedule_spec("zb", "StageCursor")
    with pytest.raises(ValueError, match=r"schedule=\['1f1b'\]\): schedule must be one of"):
        schedule_spec(["1f1b"], "PipelineStrategy")


def _name_comparisons(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            for operand in [node.left, *node.comparators]:
                strings = [c.value for c in ast.walk(operand) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
                found += [f"{path.name}:{node.lineno} {s!r}" for s in strings if s in SCHEDULES]
    return found


def test_no_pipeline_module_compares_schedule_names():
    """What a schedule means is asked of its spec; a name comparison would decide it a second time."""
    assert [hit for path in sorted(PIPELINE.glob("*.py")) for hit in _name_comparisons(path)] == []
