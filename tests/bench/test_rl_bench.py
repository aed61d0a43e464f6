"""The rl suite: option rules, the time-to-solve computation and the rows by hand, and one tiny real run (Ape-X with
one actor, a threshold any greedy CartPole episode reaches, so the run solves at its first evaluation and stops)."""

from __future__ import annotations

import json

import pytest

from lightning_pdist.bench.__main__ import main as bench_main
from lightning_pdist.bench.launch import Launched
from lightning_pdist.bench.rl import (SuiteConfig, best_means, build_row, compare, docs_section, goals, keep_rows, parse_row,
                                      run_suite, time_to_solve, worker_spec)  # fmt: skip
from lightning_pdist.bench.rl_worker import check_spec


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"rows": ("dqn", "apex0")}, r"rl\(--rows=\('dqn', 'apex0'\)\): each value must be dqn, apex<N> or gorila<L> .*'apex0'"),
        ({"rows": ("dqn", "dqn")}, r"--rows=\('dqn', 'dqn'\)\): give at least one value, none repeated"),
        ({"budget": 0}, r"rl\(--budget=0\): must be > 0 seconds"),
        ({"screen": 20, "episodes": 10}, r"rl\(--episodes=10\): must be >= --screen \(20\)"),
        ({"seed": -1}, r"rl\(--seed=-1\): must be an int >= 0"),
    ],
)  # fmt: skip
def test_bad_options_are_refused_naming_option_value_and_rule(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SuiteConfig(**kwargs)


def test_rows_parse_into_method_actors_learners_and_the_cli_refuses_a_bad_value(tmp_path, capsys):
    assert [parse_row(r) for r in ("dqn", "apex1", "apex4", "gorila2")] == [
        ("dqn", 1, 1), ("apex", 1, 1), ("apex", 4, 1), ("gorila", 2, 2)]  # fmt: skip
    for name in ("dqn", "apex4", "gorila2"):
        check_spec(worker_spec(SuiteConfig(), name))
    with pytest.raises(ValueError, match=r"rl_worker spec\(learners=2\): learners must be 1 except for method 'gorila'"):
        check_spec({**worker_spec(SuiteConfig(), "apex2"), "learners": 2})
    assert bench_main(["rl", "--quick", "--out", str(tmp_path), "--budget", "-1"]) == 2
    assert "rl(--budget=-1.0)" in capsys.readouterr().err


def _evals(*screens_fulls):
    """Evaluations every 5 s: ``[t, updates, env_steps, screen, full]``."""
    return [[5.0 * (i + 1), 100 * (i + 1), 1000 * (i + 1), s, f] for i, (s, f) in enumerate(screens_fulls)]


def test_time_to_solve_is_the_first_evaluation_whose_full_mean_reaches_the_threshold():
    """A screen at the threshold whose 100-episode mean falls short does not solve; the first full mean >= 475 does,
    at that evaluation's time, updates and steps; later ones do not move it. The best means are the largest seen."""
    evals = _evals((100.0, None), (480.0, 470.0), (500.0, 475.0), (500.0, 499.0))
    assert time_to_solve(evals, 475.0) == (15.0, 300, 3000)
    assert time_to_solve(evals, 480.0) == (20.0, 400, 4000)
    assert time_to_solve(evals, 499.5) is None
    assert best_means(evals) == (499.0, 500.0)
    assert best_means(_evals((12.0, None), (30.0, None))) == (None, 30.0)
    assert time_to_solve([], 475.0) is None and best_means([]) == (None, None)


def _launch(results, error=None):
    return Launched(results, 40.0, 30.0, 8.0, error=error)


def _result(evals, train_s=40.0, updates=4000, env_steps=8000):
    return {"rank": 0, "train_s": train_s, "updates": updates, "env_steps": env_steps, "train_return": 50.0,
            "episodes": 100, "evals": evals, "solved_at_s": None, "setup_s": 1.0}  # fmt: skip


def test_rows_speedup_goal_and_section_by_hand():
    """dqn solves at 30 s, apex4 at 10 s (3x sooner: met), gorila2 sums its two learners' steps and updates and does
    not solve within its budget (the cell says so, with the best 100-episode mean); a failed row keeps its error."""
    cfg = {"threshold": 475.0, "budget": 60.0}
    dqn = build_row("dqn", cfg, _launch([_result(_evals((200.0, None), (300.0, None), (480.0, 476.0)))]))
    apex = build_row("apex4", cfg, _launch([_result(_evals((490.0, 480.0)), train_s=10.0, updates=500, env_steps=6000)]))
    gorila = build_row("gorila2", cfg, _launch([_result(_evals((480.0, 400.0)), train_s=60.0),
                                                _result([], train_s=61.0, updates=3000, env_steps=7000)]))  # fmt: skip
    failed = build_row("apex2", cfg, _launch([], error="ApeXStrategy: actor 1 ... was killed by SIGKILL"))
    rows = compare([dqn, apex, gorila, failed])
    assert (dqn["time_to_solve_s"], dqn["solve_updates"], dqn["solve_env_steps"], dqn["vs_dqn"]) == (15.0, 300, 3000, 1.0)
    assert (apex["time_to_solve_s"], apex["vs_dqn"], apex["env_steps_per_s"], apex["updates_per_s"]) == (5.0, 3.0, 600.0, 50.0)
    assert (gorila["time_to_solve_s"], gorila["best_mean"], gorila["actors"], gorila["env_steps"], gorila["updates"],
            gorila["train_s"]) == (None, 400.0, 4, 15000, 7000, 61.0)  # fmt: skip
    assert failed["error"] and failed["time_to_solve_s"] is None and failed["vs_dqn"] is None
    [goal] = goals(rows)
    assert goal["met"] is True and "solved after 5.0 s, DQN after 15.0 s (3.00x sooner)" in goal["measured"]
    doc = {"config": {**asdict_config(), "budget": 60.0}, "rows": rows, "goals": [goal], "command": "cmd", "created": "now",
           "suite_wall_s": 200.0, "host": {"cpus": 2, "loadavg_1m_at_start": 1.0, "torch": "x"}}  # fmt: skip
    section = docs_section(doc, "docs/results/rl.json")
    assert "| not solved in 60 s |" in section and "- apex2: ApeXStrategy: actor 1" in section and "3.00" in section
    apex_slow = {**apex, "time_to_solve_s": None, "best_mean": None, "best_screen": 300.0}
    [goal] = goals([dqn, apex_slow])
    assert goal["met"] is False
    assert "did not solve within 60 s (best greedy mean 300.0 (10 ep)); DQN solved after 15.0 s" in goal["measured"]
    dqn_slow = {**dqn, "time_to_solve_s": None}
    assert goals([dqn_slow, apex])[0]["met"] is True  # 5 s against more than 60 s
    assert goals([dqn_slow, {**apex, "time_to_solve_s": 40.0}])[0]["met"] is None  # 40 s against more than 60 s


def asdict_config():
    from dataclasses import asdict

    return asdict(SuiteConfig())


def test_a_tiny_real_run_solves_an_easy_threshold_stops_and_writes_json_plot_and_section(tmp_path):
    """Ape-X with one actor: a threshold of 5 (every CartPole episode lasts longer) is reached at the first greedy
    evaluation, so the run stops there, long before its budget; the JSON, PNG and rendered table come out."""
    config = SuiteConfig(rows=("apex1",), budget=30.0, eval_every=0.5, screen=2, episodes=3, threshold=5.0, hidden=8,
                         batch_size=8, learning_starts=16, timeout=120.0)  # fmt: skip
    doc = run_suite(config, tmp_path, "python -m lightning_pdist.bench rl --rows apex1", log=lambda _: None)
    [row] = doc["rows"]
    assert row["error"] is None, row["error"]
    assert row["time_to_solve_s"] is not None and row["time_to_solve_s"] < row["train_s"] + 1e-6 < 30.0
    assert row["updates"] > 0 and row["env_steps"] >= 16 and row["best_mean"] >= 5.0 and len(row["evals"]) == 1
    assert json.loads((tmp_path / "rl.json").read_text())["rows"][0]["row"] == "apex1"
    assert (tmp_path / "rl.png").stat().st_size > 0
    assert "| apex1 |" in docs_section(doc, "rl.json")


def test_keep_from_adds_the_rows_not_run_again_in_suite_order_and_refuses_other_settings(tmp_path):
    """A run of dqn kept with an earlier file of apex4 and dqn: the new dqn replaces the old one, apex4 is kept (after
    dqn, as in ROWS) with its command in doc["kept"] and in the section; chained keeps remember the first command; an
    earlier file of another suite, or with another budget, is refused naming the option; a missing file too."""
    cfg = {"threshold": 475.0, "budget": 60.0}
    old = {"suite": "rl", "command": "cmd-old", "created": "t0", "host": {"loadavg_1m_at_start": 1.5}, "suite_wall_s": 70.0,
           "config": {**asdict_config(), "budget": 60.0},
           "rows": [build_row("apex4", cfg, _launch([_result(_evals((490.0, 480.0)), train_s=10.0)])),
                    build_row("dqn", cfg, _launch([_result(_evals((100.0, None)))]))]}  # fmt: skip
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    config = SuiteConfig(rows=("dqn",), budget=60.0, keep_from=str(path))
    new_dqn = build_row("dqn", cfg, _launch([_result(_evals((200.0, None)))]))
    doc = {"config": json.loads(json.dumps(asdict_config() | {"rows": ["dqn"], "budget": 60.0})), "rows": [new_dqn],
           "command": "cmd-new", "created": "t1", "host": {"cpus": 2, "loadavg_1m_at_start": 1.0, "torch": "x"},
           "suite_wall_s": 80.0}  # fmt: skip
    keep_rows(doc, old, config)
    assert [r["row"] for r in doc["rows"]] == ["dqn", "apex4"] and doc["rows"][0]["best_screen"] == 200.0
    assert doc["kept"] == [{"rows": ["apex4"], "command": "cmd-old", "created": "t0", "loadavg_1m_at_start": 1.5,
                            "suite_wall_s": 70.0}]  # fmt: skip
    doc["goals"] = goals(compare(doc["rows"]))
    assert "Rows apex4 kept from an earlier command: `cmd-old` (run t0, 70.0 s" in docs_section(doc, "rl.json")
    again = {**doc, "rows": [build_row("gorila2", cfg, _launch([_result([])]))]}
    keep_rows(again, {**doc, "suite": "rl", "command": "cmd-new"}, config)
    assert [r["row"] for r in again["rows"]] == ["dqn", "apex4", "gorila2"]
    assert [(e["rows"], e["command"]) for e in again["kept"]] == [(["apex4"], "cmd-old"), (["dqn"], "cmd-new")]
    with pytest.raises(ValueError, match=r"rl\(--keep-from='.*old.json'\): holds suite 'sign', not 'rl'"):
        keep_rows(doc, {**old, "suite": "sign"}, config)
    with pytest.raises(ValueError, match=r"its rows ran with other settings \(budget=85.0 \(now 60.0\)\)"):
        keep_rows(doc, {**old, "config": {**old["config"], "budget": 85.0}}, config)
    with pytest.raises(ValueError, match=r"rl\(--keep-from='nope.json'\): must be an existing rl.json"):
        SuiteConfig(keep_from="nope.json")
