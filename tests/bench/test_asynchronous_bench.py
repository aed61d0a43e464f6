"""The asynchronous suite: option rules, the plan, rows, time to accuracy and goals by hand (per model), keeping an
earlier run's rows, and one tiny real run (Hogwild! on 2 processes sharing the sparse text model's weights, keeping
CNN rows from an earlier file)."""

from __future__ import annotations

import json
import re

import pytest

from lightning_pdist.bench.__main__ import main as bench_main
from lightning_pdist.bench.asynchronous import (SuiteConfig, build_rows, compare, docs_section, goals, keep_rows, plan,
                                                run_suite)  # fmt: skip
from lightning_pdist.bench.asynchronous_worker import check_spec
from lightning_pdist.bench.launch import Launched


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"methods": ("adpsgd",)}, r"asynchronous\(--methods=\('adpsgd',\)\): must include ddp"),
        ({"methods": ("ddp", "gossip")}, r"--methods=\('ddp', 'gossip'\)\): each value must be one of"),
        ({"shared": ("hogwild", "hogwild")}, r"--shared=\('hogwild', 'hogwild'\)\): give at least one value, none repeated"),
        ({"world_size": 1}, r"--world-size=1\): must be an int >= 2"),
        ({"slowdown": 0.5}, r"--slowdown=0.5\): must be a number >= 1"),
        ({"shared_samples": 64}, r"--shared-samples=64\): must be a multiple of 2 \* batch_size = 64, at least 128"),
        ({"steps": 1}, r"--steps=1\): must be an int >= 2"),
        ({"parts": ("wan",)}, r"--parts=\('wan',\)\): each value must be one of"),
        ({"rate": "fast"}, r"rate"),
        ({"models": ("cnn", "lstm")}, r"--models=\('cnn', 'lstm'\)\): each value must be one of \('cnn', 'text'\)"),
        ({"text_head_lr": 0.0}, r"--text-head-lr=0.0\): must be > 0"),
        ({"keep_from": "/nonexistent.json"}, r"--keep-from='/nonexistent.json'\): must be an existing asynchronous.json"),
    ],
)  # fmt: skip
def test_bad_options_are_refused_naming_option_value_and_rule(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SuiteConfig(**kwargs)


def test_cli_answers_a_bad_value_with_exit_status_2(tmp_path, capsys):
    assert bench_main(["asynchronous", "--quick", "--out", str(tmp_path), "--slowdown", "0"]) == 2
    assert "asynchronous(--slowdown=0.0)" in capsys.readouterr().err


def test_plan_and_worker_spec_rules():
    """Network methods: two fits each (no straggler, then the last rank); shared: one process with every sample, two
    processes with half each. The worker refuses a straggler at rank 0 (it keeps the clock) and 'single' on 2."""
    launches = plan(SuiteConfig(world_size=4, steps=10, shared_samples=256), "/tmp/reviews")
    one_model = [("network", "ddp", 4, 10, [None, 3]), ("network", "adpsgd", 4, 10, [None, 3]),
                 ("shared", "single", 1, 8, [None]), ("shared", "hogwild", 2, 4, [None]),
                 ("shared", "hogwild_lock", 2, 4, [None]), ("shared", "ddp", 2, 4, [None])]  # fmt: skip
    assert [(s["model"], p, s["method"], s["world_size"], s["steps"], s["stragglers"]) for p, s in launches] == [
        (m, *launch) for m in ("cnn", "text") for launch in one_model]  # fmt: skip
    for _, spec in launches:
        check_spec(spec)
    cnn, text = launches[0][1], launches[6][1]  # the text model: its own rates, no momentum, the reviews' folder
    assert (cnn["lr"], cnn["momentum"], cnn["width"], cnn["head_lr"], cnn["data_dir"]) == (0.05, 0.9, 32, None, None)
    assert (text["lr"], text["momentum"], text["width"], text["head_lr"], text["data_dir"]) == (0.2, 0.0, 32, 0.02, "/tmp/reviews")
    with pytest.raises(ValueError, match=r"the text model needs data_dir \(str\) and head_lr > 0; the cnn takes neither"):
        check_spec({**cnn, "data_dir": "/tmp/reviews"})
    spec = launches[0][1]
    with pytest.raises(ValueError, match=r"stragglers must be a non-empty list, each None or a rank in \[1, 4\)"):
        check_spec({**spec, "stragglers": [0]})
    with pytest.raises(ValueError, match=r"world_size must be 1 exactly for method 'single'"):
        check_spec({**spec, "method": "single"})
    assert [p for p, _ in plan(SuiteConfig(parts=("shared",)))] == ["shared"] * 8
    assert {s["model"] for _, s in plan(SuiteConfig(models=("text",)))} == {"text"}


def _fit(straggler, acc_curve, loop_s, steps=8):
    return {"straggler": straggler, "steps": steps, "loop_s": loop_s, "slept_s": 1.0, "compute_s": 0.5,
            "evals": [[4 * (i + 1), t, a] for i, (t, a) in enumerate(acc_curve)], "val_acc": acc_curve[-1][1],
            "model_params": 100, "error": None}  # fmt: skip


def _launch(method, curves, loops):
    """Two ranks, fits without and with rank 1 slowed."""
    ranks = [{"rank": r, "fits": [_fit(s, c, lp) for s, c, lp in zip((None, 1), curves, loops)]} for r in range(2)]
    return ("network", {"model": "cnn", "method": method, "world_size": 2, "steps": 8, "batch_size": 32, "stragglers": [None, 1]},
            Launched(ranks, 10.0, 1.0, 0.5))  # fmt: skip


def test_rows_time_to_ddps_accuracy_and_the_goals_by_hand():
    """DDP with the straggler reaches its final 0.9 at 6 s; AD-PSGD reaches 0.9 at 2 s: 3x sooner (met). Hogwild!
    does 1.5x one process's samples/s (after the first step: 2·7·32 samples in 1.2444 s against 15·32 in 2 s): not met."""
    rows = []
    for method, curves, loops in [("ddp", [[(1, 0.5), (2, 0.95)], [(3, 0.5), (6, 0.9)]], [2.0, 6.0]),
                                  ("adpsgd", [[(1, 0.6), (2, 0.94)], [(1, 0.7), (2, 0.91)]], [2.0, 2.5])]:  # fmt: skip
        rows += build_rows(*_launch(method, curves, loops))
    one = {"rank": 0, "fits": [_fit(None, [(1, 0.9)], 2.0, steps=16)]}
    hog = [{"rank": r, "fits": [_fit(None, [(1, 0.905)], 1.0 + r * 0.2444)]} for r in range(2)]
    rows += build_rows("shared", {"model": "cnn", "method": "single", "world_size": 1, "steps": 16, "batch_size": 32, "stragglers": [None]},
                       Launched([one], 3.0, 2.0, 0.1))  # fmt: skip
    rows += build_rows("shared", {"model": "cnn", "method": "hogwild", "world_size": 2, "steps": 8, "batch_size": 32, "stragglers": [None]},
                       Launched(hog, 3.0, 4.0, 0.1))  # fmt: skip
    by = {(r["method"], r["straggler"]): r for r in compare(rows)}
    assert by[("ddp", 1)]["time_to_target_s"] == 6 and by[("adpsgd", 1)]["time_to_target_s"] == 2
    assert by[("adpsgd", 1)]["tta_speedup"] == 3.0 and by[("adpsgd", None)]["time_to_target_s"] is None  # 0.94 < 0.95
    assert by[("ddp", 1)]["straggler_slept_s"] == 1.0 and by[("ddp", 1)]["samples_per_s"] == round(2 * 7 * 32 / 6, 1)
    assert by[("hogwild", None)]["vs_single"] == 1.5 and by[("hogwild", None)]["acc_vs_single"] == 0.005
    judged = goals(rows, 3.0)
    assert [g["met"] for g in judged] == [True, False] and "3.00x sooner" in judged[0]["measured"]
    assert judged[0]["goal"].startswith("cnn: with one rank 3x slower")
    low = lambda r: {"evals": [[s, t, a - 0.1] for s, t, a in r["evals"]]} if r["method"] == "adpsgd" else {}  # noqa: E731
    text = [{**r, "model": "text", **low(r)} for r in rows if r["part"] == "network"]
    by_model = compare(rows + text)  # each model against its own DDP: the text AD-PSGD never reaches its DDP
    assert by[("adpsgd", 1)]["tta_speedup"] == 3.0 and all(r["time_to_target_s"] is None for r in text if r["method"] == "adpsgd")
    thirds = build_rows(*_launch("ddp", [[(1, 0.5), (2, 2 / 3)], [(1, 0.5), (3, 2 / 3)]], [2.0, 3.0]))
    assert [r["val_acc"] for r in thirds] == [0.6667, 0.6667]  # rounded up: the copies still reach it
    assert [r["time_to_target_s"] for r in compare(thirds)] == [2, 3]
    both = goals(by_model, 3.0)
    assert [g["goal"].split(":")[0] for g in both] == ["cnn", "cnn", "text", "text"]
    assert [g["met"] for g in both] == [True, False, False, None] and "never reached" in both[2]["measured"]
    failed = build_rows(*_launch("sgp", [[(1, 0.5)], [(1, 0.5)]], [1.0, 1.0]))
    failed[0]["error"] = failed[1]["error"] = "AssertionError: Torch not compiled with CUDA enabled"
    doc = {"command": "c", "created": "t", "suite_wall_s": 1.0, "config": SuiteConfig(world_size=2).__dict__,
           "host": {"cpus": 2, "loadavg_1m_at_start": 1.0, "torch": "x"}, "networks": {}, "rows": rows + failed,
           "goals": judged, "not_run": []}  # fmt: skip
    text = docs_section(doc, "x.json")
    assert "Torch not compiled with CUDA enabled" in text and "| adpsgd |" in text and "**not met**" in text


def _old_cnn_doc(**config):
    """An earlier run's file from before the text model: rows without a model (the CNN's), no text settings."""
    cfg = {k: v for k, v in SuiteConfig(**config).__dict__.items() if not k.startswith("text_") and k != "models"}
    row = {"part": "shared", "method": "single", "straggler": None, "world_size": 1, "val_acc": 0.9, "error": None,
           "steps": 4, "samples_per_s": 100.0, "evals": [], "model_params": 10, "other_load_cores": 0.1}  # fmt: skip
    return {"suite": "asynchronous", "command": "old", "created": "t0", "suite_wall_s": 5.0, "config": cfg,
            "host": {"loadavg_1m_at_start": 0.5}, "rows": [row, {**row, "method": "hogwild", "world_size": 2}]}  # fmt: skip


def test_keep_from_adds_the_rows_not_made_again_and_refuses_other_settings():
    """Rows are kept per model/part/method: the text rows made now stay, the CNN's come from the old file (as CNN
    rows) with its command; a CNN setting that differs is refused naming it, a text setting the kept rows do not
    depend on is not checked, and another suite's file is refused."""
    config = SuiteConfig(models=("text",), parts=("shared",))
    made = {"model": "text", "part": "shared", "method": "hogwild", "straggler": None, "world_size": 2, "error": None}
    doc = {"rows": [made, {**made, "model": "cnn"}], "config": config.__dict__}
    keep_rows(doc, _old_cnn_doc(), config)
    assert [(r["model"], r["method"]) for r in doc["rows"]] == [("cnn", "single"), ("cnn", "hogwild"), ("text", "hogwild")]
    assert "samples_per_s" not in doc["rows"][1]  # the CNN hogwild row made now, not the old one
    assert doc["kept"] == [{"rows": ["cnn/shared/single"], "command": "old", "created": "t0",
                            "loadavg_1m_at_start": 0.5, "suite_wall_s": 5.0}]  # fmt: skip
    with pytest.raises(ValueError, match=r"keep-from=None\): its rows ran with other settings \(lr=0.1 \(now 0.05\)\)"):
        keep_rows({"rows": [made], "config": config.__dict__}, _old_cnn_doc(lr=0.1), config)
    with pytest.raises(ValueError, match=r"holds suite 'rl', not 'asynchronous'"):
        keep_rows({"rows": [], "config": config.__dict__}, {**_old_cnn_doc(), "suite": "rl"}, config)


def test_a_tiny_real_run_of_hogwild(tmp_path):
    """Hogwild! on 2 processes for 2 steps each on the sparse text model (one launch), keeping the CNN rows of an
    earlier file: the rank 0 copies are evaluated, the samples per second come from the processes' clocks, the goals
    say per model what they cannot judge, and the JSON, plot and docs (with the kept rows' command) are written."""
    old = tmp_path / "old.json"
    old.write_text(json.dumps(_old_cnn_doc(width=4, shared_samples=128, eval_every=1)))
    config = SuiteConfig(parts=("shared",), shared=("hogwild",), models=("text",), shared_samples=128, width=4,
                         text_width=4, eval_every=1, timeout=120.0, keep_from=str(old))  # fmt: skip
    doc = run_suite(config, tmp_path, "test", log=lambda _: None)
    cnn_single, cnn_hog, row = doc["rows"]
    assert (cnn_single["model"], cnn_hog["model"], cnn_hog["method"]) == ("cnn", "cnn", "hogwild")
    assert row["model"] == "text" and row["error"] is None and row["world_size"] == 2 and row["steps"] == 2, row
    assert row["model_params"] == 12012 * 4 + 4 * 2 + 2
    assert [e[0] for e in row["evals"]] == [1, 2] and 0 <= row["val_acc"] <= 1 and row["samples_per_s"] > 0
    assert [g["goal"].split(":")[0] for g in doc["goals"]] == ["cnn", "cnn", "text", "text"]
    assert doc["goals"][3]["met"] is None and "did not run" in doc["goals"][3]["measured"]
    assert doc["kept"][0]["rows"] == ["cnn/shared/single", "cnn/shared/hogwild"]
    written = json.loads((tmp_path / "asynchronous.json").read_text())
    assert written["rows"][2]["method"] == "hogwild" and (tmp_path / "asynchronous.png").stat().st_size > 0
    text = docs_section(written, "x.json")
    assert re.search(r"\| +text \| +hogwild \|", text) and "kept from an earlier command: `old`" in text
