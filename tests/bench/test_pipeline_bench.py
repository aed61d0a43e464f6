"""The pipeline suite: config rules, its formulas, and tiny real runs of every part (loopback and emulated)."""

import json
import os
from dataclasses import asdict

import pytest

from lightning_pdist.pipeline.schedule import build_schedule, bubble_formula, validate
from lightning_pdist.bench import SUITES
from lightning_pdist.bench.__main__ import main as bench_main
from lightning_pdist.bench.netns import EmulatedNetwork
from lightning_pdist.bench.pipeline import (
    ROW_KEYS,
    SuiteConfig,
    convergence_summary,
    ddp_bytes,
    engine_cases,
    keep_convergence_rows,
    keep_parts,
    pipeline_bytes,
    ratios,
    steady_bubble,
    throughput_rows,
)
from lightning_pdist.bench.pipeline_probe import summary as probe_summary
from lightning_pdist.bench.pipeline_worker import HEADER_BYTES, check_spec
from lightning_pdist.bench.report import check_rows
from lightning_pdist.core.accounting import all_reduce_bytes

_OK, _REASON = EmulatedNetwork.available()
TINY = ["--width", "32", "--depth", "4", "--batch-size", "8", "--microbatches", "2", "--warmup-steps", "1", "--steps", "2"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"parts": ("speed",)}, r"pipeline\(--parts=\('speed',\)\): each value must be one of"),
        ({"engines": ("ours_1f1b", "ours_1f1b")}, r"--engines=.*give at least one value, none repeated"),
        ({"methods": ("sgd",)}, r"pipeline\(--methods=\('sgd',\)\): each value must be one of"),
        ({"stages": (1,)}, r"pipeline\(--stages=1\): a stage count must be an int in \[2, 8\]"),
        ({"stages": (3,), "num_microbatches": 3, "batch_size": 48}, r"pipeline\(--depth=8\): must be a multiple of every stage count"),
        ({"num_microbatches": 2}, r"pipeline\(--microbatches=2\): must be >= the stage count 4"),
        ({"batch_size": 66}, r"pipeline\(--batch-size=66\): must be a multiple of --microbatches"),
        ({"bubble_points": ((4, 2),)}, r"pipeline\(--bubble-points=\(4, 2\)\): each point is K:m with K in \[2, 8\] and m >= K"),
        ({"bubble_points": ((2, 3),)}, r"pipeline\(--bubble-points=\(2, 3\)\): K must divide --depth \(8\) and m --batch-size \(64\)"),
        ({"converge_stages": 3}, r"pipeline\(--converge-batch-size=32\): must be a multiple of the 4 micro-batches and of --converge-stages"),
        ({"rate": "fast"}, r"pipeline\(--rate='fast'\): must look like '100mbit'"),
        ({"steps": 0}, r"pipeline\(--steps=0\): must be an int >= 1"),
        ({"converge_lr": 0.0}, r"pipeline\(--converge-lr=0.0\): must be > 0"),
        ({"seeds": (-1,)}, r"pipeline\(--seeds=\(-1,\)\): each seed must be an int >= 0"),
        ({"converge_models": ("rnn",)}, r"pipeline\(--converge-models=\('rnn',\)\): each value must be one of"),
        ({"converge_momentum": 0.0}, r"pipeline\(--converge-momentum=0.0\): spectrain predicts the weights from SGD's momentum"),
        ({"bert_batch_size": 30}, r"pipeline\(--bert-batch-size=30\): must be a multiple of --microbatches \(4\)"),
        ({"keep_from": "/nonexistent.json"}, r"pipeline\(--keep-from='/nonexistent.json'\): must be an existing pipeline.json"),
    ],
)
def test_config_rejects_bad_values_naming_option_value_and_rule(kwargs, match):
    """Every bad option raises ValueError with the option, the value and the rule."""
    with pytest.raises(ValueError, match=match):
        SuiteConfig(**kwargs)


def test_cli_answers_bad_values_with_exit_status_2(tmp_path, capsys):
    """The suite is registered; a bad value exits 2 with its message and writes nothing; a bad K:m is argparse's."""
    assert SUITES["pipeline"] == "lightning_pdist.bench.pipeline"
    assert bench_main(["pipeline", "--quick", "--out", str(tmp_path / "o"), "--stages", "2", "9"]) == 2
    assert "pipeline(--stages=(2, 9)): a stage count must be an int in [2, 8]" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    with pytest.raises(SystemExit) as exit_info:
        bench_main(["pipeline", "--out", str(tmp_path / "o"), "--bubble-points", "2x4"])
    assert exit_info.value.code == 2
    assert "'2x4' is not K:m" in capsys.readouterr().err


def test_worker_spec_is_checked():
    """Worker specs refuse unknown jobs, missing keys, torch schedules torch lacks and uneven cuts."""
    spec = {"job": "stash", "num_stages": 2, "seed": 0, "width": 8, "depth": 4, "batch_size": 4, "num_microbatches": 2,
            "batches": 1, "lr": 0.1, "schedule": "2bw", "weight_stashing": True}  # fmt: skip
    assert check_spec(dict(spec)) == spec
    with pytest.raises(ValueError, match=r"job='train'\): job must be one of"):
        check_spec({**spec, "job": "train"})
    with pytest.raises(ValueError, match=r"missing keys \['weight_stashing'\]"):
        check_spec({k: v for k, v in spec.items() if k != "weight_stashing"})
    with pytest.raises(ValueError, match=r"depth=3\): depth must be a multiple of num_stages \(2\)"):
        check_spec({**spec, "depth": 3})
    engines = {"job": "engines", "num_stages": 2, "seed": 0, "width": 8, "depth": 2, "batch_size": 4, "warmup_steps": 1,
               "steps": 1, "lr": 0.1, "cases": [{"engine": "torch", "schedule": "2bw", "num_microbatches": 2}]}  # fmt: skip
    with pytest.raises(ValueError, match=r"torch's schedules here are \('gpipe', '1f1b'\)"):
        check_spec(engines)


@pytest.mark.parametrize("K, m", [(2, 2), (2, 8), (3, 5), (4, 4)])
def test_steady_bubble_is_the_formula_when_flushed_and_zero_without_flushes(K, m):
    """The simulation's steady state: (K-1)/(m+K-1) for GPipe/1F1B, 0 for PipeDream/2BW (fill and drain aside)."""
    for schedule in ("gpipe", "1f1b"):
        whole, steady = steady_bubble(schedule, K, m, 3)
        assert steady == pytest.approx(bubble_formula(K, m)) and whole == pytest.approx(bubble_formula(K, m))
    for schedule in ("pipedream", "2bw"):
        whole, steady = steady_bubble(schedule, K, m, 3)
        assert steady == pytest.approx(0.0, abs=1e-12) and 0 < whole < bubble_formula(K, m)


def test_header_size_matches_the_transport():
    """The suite's header constant is the transport's."""
    from lightning_pdist.pipeline.p2p import HEADER_BYTES as transport

    assert HEADER_BYTES == transport


def test_byte_formulas_follow_the_survey_table():
    """Pipeline: 2 ways × cuts × (samples × activation + header per message); DDP: R · 2(R-1)/R · model per step."""
    assert pipeline_bytes(10, 4, [5]) == 2 * (10 * 5 * 4 + 4 * HEADER_BYTES)
    assert pipeline_bytes(10, 4, [5, 7]) == pipeline_bytes(10, 4, [5]) + pipeline_bytes(10, 4, [7])
    assert ddp_bytes(3, 1000, 4) == 4 * 3 * all_reduce_bytes(4000, 4) == 4 * 3 * 6000


def test_ratios_and_the_stashing_note_come_from_the_rows():
    """Ours/torch 1F1B per (K, network); the note says when stashing made no difference, and why."""
    rows = [{"engine": e, "schedule": "1f1b", "stages": 2, "network": "loopback", "samples_per_s": v}
            for e, v in (("ours", 80.0), ("torch", 100.0))]  # fmt: skip
    rows.append({"engine": "ours", "schedule": "1f1b", "stages": 4, "network": "loopback", "samples_per_s": 10.0})
    assert ratios(rows) == [{"stages": 2, "network": "loopback", "ours_1f1b_samples_per_s": 80.0,
                             "torch_1f1b_samples_per_s": 100.0, "ratio": 0.8}]  # fmt: skip
    runs = [{"model": "cnn", "method": "pipedream", "final_val_acc": 0.9}, {"model": "cnn", "method": "pipedream_nostash", "final_val_acc": 0.895},
            {"model": "transformer", "method": "dni", "final_val_acc": 0.7}, {"model": "transformer", "method": "dni", "final_val_acc": 0.8}]  # fmt: skip
    summary = convergence_summary(runs)
    assert summary["final_val_acc"]["cnn"]["pipedream"] == 0.9 and summary["final_val_acc"]["cnn"]["ddp"] is None
    assert summary["final_val_acc"]["transformer"]["dni"] == 0.75  # the mean over seeds
    assert summary["stashing_note"]["cnn"].startswith("no difference at this lr")
    assert summary["stashing_note"]["transformer"] == "stashing was not compared (a run is missing)"
    runs[1]["final_val_acc"] = 0.1
    assert "do not train" in convergence_summary(runs)["stashing_note"]["cnn"]


def test_rounds_pool_into_one_row_per_engine_with_each_rounds_ratio():
    """--rounds R: the launch runs its cases R times in turn; one row per engine pools the steps, ratios keep each round's."""
    assert [c["engine"] for c in engine_cases(SuiteConfig(engines=("ours_1f1b", "torch_1f1b"), rounds=3))] == ["ours", "torch"] * 3

    def case(engine, steps, per_step=None):
        return {"engine": engine, "schedule": "1f1b", "num_microbatches": 4, "step_s": steps, "loop_s": sum(steps),
                "wait_s": per_step and [0.1] * len(steps), "bytes": per_step and [per_step] * len(steps)}  # fmt: skip

    ranks = [{"cases": [case("ours", [1, 1, 3], 5), case("torch", [2, 2, 2]), case("ours", [2, 2, 2], 5), case("torch", [4, 4, 4])]}] * 2
    rows = throughput_rows({"error": None, "ranks": ranks}, {"num_stages": 2, "width": 8, "depth": 2, "batch_size": 8}, 2, "loopback")
    assert [(r["engine"], r["median_step_s"], r["round_median_step_s"]) for r in rows] == [("ours", 2, [1, 2]), ("torch", 3, [2, 4])]
    assert rows[0]["bytes_per_step"] == 10 and rows[0]["bubble_measured"] == round(0.6 / 11, 4)
    assert ratios(rows)[0]["ratio"] == 1.498 and ratios(rows)[0]["round_ratios"] == [2.0, 2.0]


def test_receives_posted_ahead_or_late_are_rows_of_their_own():
    """ours_1f1b_ahead / ours_1f1b_late force P2P(post_ahead=True/False); each pools into its own row, which keeps the
    value the ranks used; the plain ours_1f1b row (the default: late) is the one the ratio to torch reads."""
    cases = engine_cases(SuiteConfig(engines=("ours_1f1b_late", "ours_1f1b_ahead", "ours_1f1b", "torch_1f1b")))
    assert [(c["engine"], c.get("variant"), c.get("post_ahead")) for c in cases] == [
        ("ours", "late", False), ("ours", "ahead", True), ("ours", None, None), ("torch", None, None)]
    used = [False, True, False, None]
    ranks = [{"cases": [{**c, "step_s": [1.0 + i], "loop_s": 1.0, "wait_s": None, "bytes": None,
                         **({"post_ahead": u} if u is not None else {})} for i, (c, u) in enumerate(zip(cases, used))]}] * 2
    rows = throughput_rows({"error": None, "ranks": ranks}, {"num_stages": 2, "width": 8, "depth": 2, "batch_size": 8}, 2, "loopback")
    assert [(r["engine"], r.get("post_ahead")) for r in rows] == [("ours (late)", False), ("ours (ahead)", True),
                                                                   ("ours", False), ("torch", None)]
    assert ratios(rows)[0]["ours_1f1b_samples_per_s"] == 2.67  # 8 samples / 3 s: the plain row


def test_kept_parts_come_from_the_earlier_run_with_its_command_and_must_match_its_settings():
    """--keep-from copies the parts not run now, says from which run, and refuses a part run with other settings."""
    cfg = SuiteConfig(parts=("bert",), epochs=3)
    old = {"command": "python -m lightning_pdist.bench pipeline --quick", "created": "2026-01-01T00:00:00Z",
           "host": {"loadavg_1m_at_start": 1.5}, "config": json.loads(json.dumps(asdict(cfg))), "rows": [{"engine": "ours"}],
           "ratios": [], "networks": {"emulated 100mbit": {"detail": "d"}}, "stash": {"rows": [1]},
           "convergence": {"rows": [2]}, "bytes": {"rows": [3]}, "part_wall_s": {"stash": 5.0}}  # fmt: skip
    doc = {"config": asdict(cfg), "networks": {"loopback": {"detail": "lo"}}, "part_wall_s": {"bert": 1.0}, "bert": {"rows": []}}
    keep_parts(doc, old, cfg)
    assert doc["kept"]["parts"] == ["throughput", "stash", "convergence"] and doc["kept"]["from_created"] == old["created"]
    assert doc["rows"] == old["rows"] and doc["stash"] == old["stash"] and doc["bytes"] == old["bytes"] and "bubble" not in doc
    assert set(doc["networks"]) == {"loopback", "emulated 100mbit"} and doc["part_wall_s"] == {"bert": 1.0, "throughput": None,
                                                                                                "stash": 5.0, "convergence": None}
    old["config"]["epochs"] = 8
    with pytest.raises(ValueError, match=r"its convergence part ran with other settings \(epochs=8\); re-run that part"):
        keep_parts(doc, old, cfg)


def _conv_doc(cfg, command, runs, created="2026-01-01T00:00:00Z", kept=None):
    """A pipeline.json with convergence runs ``(model, method, final val_acc)``, seed 0, 2 epochs each."""
    name = lambda mo, me: {"model": mo, "method": me, "seed": 0}  # noqa: E731
    return {"suite": "pipeline", "command": command, "created": created, "host": {"loadavg_1m_at_start": 1.5},
            "config": json.loads(json.dumps(asdict(cfg))), "part_wall_s": {},
            "bytes": {"rows": [{"method": me, "measured_bytes_per_epoch": acc} for mo, me, acc in runs if mo == "cnn"]},
            "convergence": {"rows": [{**name(mo, me), "epoch": e, "val_acc": acc / e} for mo, me, acc in runs for e in (2, 1)],
                            "runs": [{**name(mo, me), "error": None, "final_val_acc": acc} for mo, me, acc in runs],
                            **({"kept": kept} if kept else {})}}  # fmt: skip


def test_convergence_runs_not_made_again_are_kept_with_their_command_and_must_match_its_settings():
    """--keep-from with --converge-models/--methods: the earlier run's other convergence runs join this run's, in
    model and method order, with the summary and bytes rows recomputed from them; each run's command is recorded
    (through a chain of pieces), and a keep-from with other convergence settings is refused naming the setting."""
    full = SuiteConfig(parts=("convergence",), epochs=2)
    old = _conv_doc(full, "cmd0", [("cnn", m, 0.5) for m in ("ddp", "gpipe", "dni")] + [("transformer", m, 0.6) for m in ("ddp", "dni")])
    cnn = SuiteConfig(parts=("convergence",), epochs=2, converge_models=("cnn",), methods=("dni", "gpipe"))
    doc = _conv_doc(cnn, "cmd1", [("cnn", "gpipe", 0.8), ("cnn", "dni", 0.9)], created="2026-01-02T00:00:00Z")
    keep_convergence_rows(doc, old, cnn)
    conv = doc["convergence"]
    runs = [(r["model"], r["method"], r["final_val_acc"]) for r in conv["runs"]]
    assert runs == [("cnn", "ddp", 0.5), ("cnn", "gpipe", 0.8), ("cnn", "dni", 0.9), ("transformer", "ddp", 0.6), ("transformer", "dni", 0.6)]
    assert [(r["model"], r["method"], r["epoch"]) for r in conv["rows"]][:4] == [("cnn", "ddp", 1), ("cnn", "ddp", 2), ("cnn", "gpipe", 1), ("cnn", "gpipe", 2)]
    assert conv["rows"][3]["val_acc"] == 0.4 and conv["rows"][5]["val_acc"] == 0.45  # this run's curve, not the old one
    assert [(r["method"], r["measured_bytes_per_epoch"]) for r in doc["bytes"]["rows"]] == [("ddp", 0.5), ("gpipe", 0.8), ("dni", 0.9)]
    assert conv["summary"]["final_val_acc"]["cnn"]["dni"] == 0.9 and conv["summary"]["final_val_acc"]["transformer"]["dni"] == 0.6
    assert conv["kept"] == [{"rows": ["cnn ddp s0", "transformer ddp s0", "transformer dni s0"], "command": "cmd0",
                             "created": "2026-01-01T00:00:00Z", "loadavg_1m_at_start": 1.5}]  # fmt: skip
    assert conv["covers"] == {"converge_models": ["cnn", "transformer"], "methods": ["ddp", "gpipe", "dni"], "seeds": [0]}
    # the next piece keeps from this one: the run cmd1 made keeps its own entry, cmd0's loses what is made again
    tr = SuiteConfig(parts=("convergence",), epochs=2, converge_models=("transformer",), methods=("dni",))
    nxt = _conv_doc(tr, "cmd2", [("transformer", "dni", 0.7)])
    keep_convergence_rows(nxt, doc, tr)
    assert [(e["command"], e["rows"]) for e in nxt["convergence"]["kept"]] == [
        ("cmd0", ["cnn ddp s0", "transformer ddp s0"]), ("cmd1", ["cnn gpipe s0", "cnn dni s0"])]  # fmt: skip
    assert nxt["convergence"]["summary"]["final_val_acc"]["transformer"]["dni"] == 0.7
    # a later run of another part keeps the whole merged convergence part: its covers, not cmd2's --methods, are compared
    bert = SuiteConfig(parts=("bert",), epochs=2, methods=("ddp", "gpipe", "dni"))
    later = {"config": asdict(bert), "networks": {}, "part_wall_s": {}, "bert": {"rows": []}}
    keep_parts(later, nxt, bert)
    assert later["convergence"] == nxt["convergence"] and later["kept"]["parts"] == ["convergence"]
    # a part kept through a chain of runs is named under the run that made it, once
    nxt["kept"] = {"parts": ["bert"], "from_command": "cmd1", "from_created": "c1", "from_host": {},
                   "earlier": [{"parts": ["bert"], "from_command": "cmd0", "from_created": "c0", "from_host": {}}]}  # fmt: skip
    nxt["bert"] = {"rows": []}
    again = {"config": asdict(tr), "networks": {}, "part_wall_s": {}, "convergence": {}}
    keep_parts(again, nxt, tr)
    assert again["kept"]["from_command"] == "cmd2" and [(e["from_command"], e["parts"]) for e in again["kept"]["earlier"]] == [("cmd0", ["bert"])]
    for setting, value in (("converge_lr", 0.5), ("epochs", 3), ("converge_momentum", 0.5)):
        other = SuiteConfig(parts=("convergence",), converge_models=("transformer",), methods=("dni",), **{"epochs": 2, setting: value})
        with pytest.raises(ValueError, match=rf"its convergence rows ran with other settings \({setting}=.* \(now {value}\)\); re-run them"):
            keep_convergence_rows(_conv_doc(other, "cmd3", [("transformer", "dni", 0.7)]), doc, other)
    with pytest.raises(ValueError, match=r"holds suite 'rl', not 'pipeline'"):
        keep_convergence_rows(nxt, {**doc, "suite": "rl"}, tr)


def test_a_failed_launch_gives_a_row_with_its_reason_and_no_figure():
    """A launch that failed (DeepSpeed cannot run, a rank died) leaves the reason in the row, never a number."""
    spec = {"num_stages": 4, "width": 8, "depth": 4, "batch_size": 8, "num_microbatches": 4}
    (row,) = throughput_rows({"error": "deepspeed cannot be imported: ImportError: x", "ranks": []}, spec, 4, "loopback", "deepspeed")
    assert row["samples_per_s"] is None and row["median_step_s"] is None and row["error"].startswith("deepspeed cannot")
    assert (row["engine"], row["schedule"], row["network"], row["processes"]) == ("deepspeed", "1f1b", "loopback", 4)
    assert row["oversubscribed"] == (4 > (os.cpu_count() or 1))
    check_rows([row], ROW_KEYS, "test")


@pytest.mark.standalone
def test_real_throughput_and_bubble_run_on_loopback(tmp_path, monkeypatch):
    """Every engine on 2 real ranks: ours' bytes are exactly its messages, versions its depth, failures honest; the
    per-step probe (``PDIST_PROBE``) leaves the rows as they are and counts both engines' transport calls."""
    monkeypatch.setenv("PDIST_PROBE", str(tmp_path / "probe"))
    out = tmp_path / "out"
    argv = ["pipeline", "--out", str(out), "--parts", "throughput", "bubble", "--network", "loopback", "--stages", "2",
            *TINY, "--bubble-points", "2:2", "--bubble-width", "32"]  # fmt: skip
    assert bench_main(argv) == 0
    doc = json.loads((out / "pipeline.json").read_text())
    assert (out / "pipeline.png").stat().st_size > 10_000 and "### Bubble" in (out / "docs_section.md").read_text()
    check_rows(doc["rows"], ROW_KEYS, "test")
    by = {(r["engine"], r["schedule"]): r for r in doc["rows"]}
    assert set(by) == {("ours", s) for s in ("gpipe", "1f1b", "pipedream", "2bw")} | {
        ("torch", "gpipe"), ("torch", "1f1b"), ("ddp", None), ("deepspeed", "1f1b"), ("fairscale", "gpipe"), ("ours+lightning", "1f1b")}
    B, m, W = 8, 2, 32
    for row in doc["rows"]:
        # a figure or the reason there is none, never both
        assert (row["samples_per_s"] is None) == (row["error"] is not None)
        assert row["network"] == ("single process" if row["engine"] == "fairscale" else "loopback")
        assert not row["oversubscribed"]
        if row["engine"] == "ours":
            # per step, stage 0 sends m activations and stage 1 m gradients, each (B/m) x W floats and a header
            assert row["bytes_per_step"] == 2 * (m * HEADER_BYTES + B * W * 4)
            assert row["max_versions"] == validate(build_schedule(row["schedule"], 2, m, num_batches=3)).stash_depth[0]
            assert 0 <= row["bubble_measured"] < 1
    assert by[("ddp", None)]["bytes_per_step"] == 2 * all_reduce_bytes(4 * (4 * W * W + 4 * W), 2)
    assert by[("ours", "1f1b")]["samples_per_s"] > 0 and by[("torch", "1f1b")]["samples_per_s"] > 0
    (ratio,) = doc["ratios"]
    assert ratio["ratio"] == round(by[("ours", "1f1b")]["samples_per_s"] / by[("torch", "1f1b")]["samples_per_s"], 3)
    for engine in ("deepspeed", "fairscale"):  # installed by the test set-up (scripts/setup_env.sh): they must run
        row = by[(engine, "gpipe" if engine == "fairscale" else "1f1b")]
        assert row["samples_per_s"] is not None and row["samples_per_s"] > 0, row["error"]
    assert [(r["schedule"], r["formula"]) for r in doc["bubble"]["rows"]] == [(s, round(1 / 3, 4)) for s in ("gpipe", "1f1b", "pipedream", "2bw")]
    for row in doc["bubble"]["rows"]:
        assert row["simulated_steady"] == (row["formula"] if row["schedule"] in ("gpipe", "1f1b") else 0.0)
        assert 0 <= row["bubble_measured"] < 1 and row["network"] == "loopback"
        # the bubble point is the throughput launch's own (K=2, m=2, width 32): its rows are reused, not launched again
        assert (row["bubble_measured"], row["median_step_s"]) == (by[("ours", row["schedule"])]["bubble_measured"],
                                                                  by[("ours", row["schedule"])]["median_step_s"])  # fmt: skip
    probes = {}  # engine -> rank 0's probe of the 1f1b case (names: probe_<schedule>_<engine>_<rank>_...)
    for path in (tmp_path / "probe").glob("probe_1f1b_*_0_*.json"):
        probes[path.name.split("_")[2]] = json.loads(path.read_text())
    for engine, calls in (("ours", {"send", "recv", "_frame", "_parse", "dist.isend", "dist.recv"}),
                          ("torch", {"_batch_p2p", "_wait_batch_p2p"})):  # fmt: skip
        rows = probes[engine]["rows"]  # per timed step: wall, wait, CPU, main-thread CPU, switches, threads, ...
        assert rows and calls <= set(probes[engine]["by_name"]) and all(r[2] > 0 and r[6] >= 2 for r in rows)
    assert "sum over ranks, ours 1f1b" in probe_summary(tmp_path / "probe")


@pytest.mark.standalone
@pytest.mark.skipif(not _OK, reason=_REASON)
def test_real_throughput_run_on_emulated_links_names_the_network(tmp_path):
    """On emulated links the rows say so and carry the rate; ours' bytes do not depend on the network."""
    out = tmp_path / "out"
    argv = ["pipeline", "--out", str(out), "--parts", "throughput", "--network", "emulated", "--rate", "1gbit",
            "--stages", "2", *TINY, "--engines", "ours_1f1b", "ddp"]  # fmt: skip
    assert bench_main(argv) == 0
    doc = json.loads((out / "pipeline.json").read_text())
    assert [r["engine"] for r in doc["rows"]] == ["ours", "ddp"]
    assert all(r["network"] == "emulated 1gbit" and r["rate"] == "1gbit" for r in doc["rows"])
    assert doc["rows"][0]["bytes_per_step"] == 2 * (2 * HEADER_BYTES + 8 * 32 * 4)
    assert doc["networks"]["emulated 1gbit"]["measured_tcp_goodput_bytes_per_s"] > 0


@pytest.mark.standalone
def test_real_stash_convergence_and_bert_runs(tmp_path):
    """Versions and their bytes equal the schedule's depth; training bytes per epoch equal Table 1's formulas exactly
    (DDP, and cDNI: the delayed-gradient family sends what PipeDream sends, the labels never travel); the BERT cut by
    split_points runs under ours and under torch's pipeline() on the same block."""
    out = tmp_path / "out"
    argv = ["pipeline", "--out", str(out), "--parts", "stash", "convergence", "bert", "--stash-width", "64", "--epochs", "1",
            "--methods", "ddp", "cdni", "--converge-models", "cnn", "--seeds", "0", "--microbatches", "2",
            "--bert-batch-size", "8", "--warmup-steps", "1", "--steps", "2"]  # fmt: skip
    assert bench_main(argv) == 0
    doc = json.loads((out / "pipeline.json").read_text())
    stash = {(r["variant"], r["stage"]): r for r in doc["stash"]["rows"]}
    assert set(stash) == {(v, s) for v in ("1f1b", "2bw", "pipedream", "pipedream_nostash") for s in (0, 1)}
    assert [stash[("pipedream", s)]["stash_depth"] for s in (0, 1)] == [2, 1]
    for row in stash.values():
        assert row["max_versions"] == row["expected_versions"]
        assert row["max_weight_bytes"] == row["expected_weight_bytes"] == row["max_versions"] * row["param_bytes"]
        assert row["param_bytes"] == 2 * (64 * 64 + 64) * 4 and row["network"] == "loopback"
        assert isinstance(row["rss_growth"], int) and isinstance(row["rss_over_baseline"], int)
    assert stash[("pipedream_nostash", 0)]["max_versions"] == 1
    # 2BW's second version is the only weight memory it holds beyond 1F1B; PipeDream's first stage one beyond no stashing
    assert stash[("2bw", 1)]["expected_over_baseline"] == stash[("pipedream", 0)]["expected_over_baseline"] == row["param_bytes"]
    curves = doc["convergence"]["rows"]
    assert [(r["model"], r["method"], r["epoch"], r["samples"]) for r in curves] == [("cnn", "ddp", 1, 1438), ("cnn", "cdni", 1, 1438)]
    assert all(0 <= r["val_acc"] <= 1 and r["network"] == "loopback" and r["lr"] == 0.02 for r in curves)
    assert "not compared" in doc["convergence"]["summary"]["stashing_note"]["cnn"]
    rows = {r["method"]: r for r in doc["bytes"]["rows"]}
    assert rows["ddp"]["measured_bytes_per_epoch"] == rows["ddp"]["formula_bytes_per_epoch"] > 0
    assert rows["cdni"]["measured_bytes_per_epoch"] == rows["cdni"]["formula_bytes_per_epoch"] > 0
    # the CNN's cut carries 512 floats a sample both ways, plus a header per micro-batch message
    assert rows["cdni"]["activation_numel"] == [512]
    # 180 data frames each way, plus two announce frames: the first message's (header only) and the epoch's short
    # last batch's (32 -> 8, 8, 7, 7: sized like the 8-sample frame before it)
    assert rows["cdni"]["measured_bytes_per_epoch"] == 2 * (1438 * 512 * 4 + 180 * HEADER_BYTES + HEADER_BYTES + HEADER_BYTES + 8 * 512 * 4)
    bert = {r["engine"]: r for r in doc["bert"]["rows"]}
    assert set(bert) == {"ours+lightning", "torch"} and doc["not_run"] == []
    assert bert["ours+lightning"]["split_point"] == "model." + bert["torch"]["split_point"] == "model.encoder.bert.encoder.layer.1"
    for row in bert.values():
        assert row["samples_per_s"] > 0 and row["error"] is None and (row["schedule"], row["num_microbatches"]) == ("1f1b", 2)
    assert "### BERT cut by split_points" in (out / "docs_section.md").read_text()
