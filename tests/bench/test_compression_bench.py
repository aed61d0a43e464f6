"""The compression suite: options, byte models, rows and goals, and one tiny real loopback run whose logged bytes
equal the byte model exactly where it is exact."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from lightning_pdist.bench.compression import (CLI, SuiteConfig, assemble, build_rows, compare, docs_section, goals,
                                               lm_params, long_checkpoints, long_spec, model_bytes, plot, run_suite,
                                               worker_spec)  # fmt: skip
from lightning_pdist.bench.compression_keep import check_keep, kept_lines
from lightning_pdist.bench.compression_worker import check_spec
from lightning_pdist.bench.text_lm import make_model
from lightning_pdist.core.accounting import all_reduce_bytes

SHAPES = [[64, 1, 3, 3], [64], [10, 64], [10]]  # 576 + 64 + 640 + 10 = 1,290 parameters


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"methods": ("topk",)}, r"compression\(--methods=\('topk',\)\): must include ddp"),
        ({"methods": ("ddp", "gzip")}, r"--methods=\('ddp', 'gzip'\)\): each value must be one of"),
        ({"world_sizes": (1,)}, r"--world-size=1\): world_size must be an int in \[2, 8\]"),
        ({"rates": ("fast",)}, r"rate"),
        ({"samples": 10}, r"--samples=10\): must be an int >= world_size \* batch_size = 64"),
        ({"models": ("cnn", "gpt")}, r"--models=\('cnn', 'gpt'\)\): each value must be one of \('cnn', 'lm'\)"),
        ({"models": ()}, r"--models=\(\)\): give at least one value"),
        ({"dgc_warmup": 1.0}, r"--dgc-warmup=1.0\): must be a fraction of the steps in \[0, 1\)"),
        ({"lm_width": 30}, r"--lm-width=30\): must be a multiple of 4"),
        ({"lm_width": 160}, r"--lm-width=160\): with --lm-layers=2 the LM has 711,296 parameters; the byte model needs"),
        ({"lm_lr": 0}, r"--lm-lr=0\): must be > 0"),
        ({"budget": -1.0}, r"--budget=-1.0\): must be >= 0 seconds"),
        ({"parts": ("main", "longer")}, r"--parts=\('main', 'longer'\)\): each value must be one of \('main', 'long'\)"),
        ({"long_scale": 0}, r"--long-scale=0\): must be an int >= 1"),
        ({"long_methods": ("ddp", "topk")}, r"--long-methods=\('ddp', 'topk'\)\): must include ddp and dgc or dgc_warmup"),
        ({"keep_from": "/nonexistent.json"}, r"--keep-from='/nonexistent.json'\): must be an existing compression.json"),
    ],
)  # fmt: skip
def test_bad_options_are_refused_naming_option_value_and_rule(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SuiteConfig(**kwargs)


def test_lm_options_reach_the_worker_spec_and_the_full_plan_is_the_issues():
    """No launch: the LM's spec carries its own lr/width/layers/context and passes the worker's check, the warm-up is
    a fraction of each world size's steps, a bad model is refused by the worker too; the full plan is emulated
    100 Mbit/s and 1 Gbit/s at 2 and 4 ranks on both models; the analytic LM size is the real model's."""
    config = SuiteConfig(lm_lr=0.3, lm_width=32, lm_layers=1, lm_context=16)
    spec = check_spec(worker_spec(config, 4, "lm"))
    assert (spec["lr"], spec["width"], spec["layers"], spec["context"], spec["steps"]) == (0.3, 32, 1, 16, 48)
    assert spec["dgc_warmup_steps"] == 12 and worker_spec(config, 2)["dgc_warmup_steps"] == 24
    assert worker_spec(config, 2)["lr"] == 0.05 and SuiteConfig(dgc_warmup=0.0).dgc_warmup_steps(2) == 0
    with pytest.raises(ValueError, match=r"compression_worker spec\(model='gpt'\): model must be one of"):
        check_spec({**spec, "model": "gpt"})
    args = CLI.config_of(type("Args", (), {"quick": False, "out": "x", **{f: None for f in SuiteConfig.__dataclass_fields__}})())
    assert (args.networks, args.rates, args.world_sizes, args.models) == (("emulated",), ("100mbit", "1gbit"), (2, 4), ("cnn", "lm"))
    for width, layers, context in ((64, 2, 64), (32, 1, 16)):
        model = make_model({"width": width, "layers": layers, "context": context, "seed": 0})
        assert sum(p.numel() for p in model.parameters()) == lm_params(width, layers, context)


def test_byte_models():
    """DDP and fp16 are ring all-reduces; TernGrad/sign the gathered 2-/1-bit payload with a per-tensor scale; top-k's
    uncoded payload is k·(4 + 4) + a 4-byte prefix; BMUF+top-k pays the 8-byte flag per step and the payload every 8th."""
    n, p = 2, 1290
    assert model_bytes("ddp", SHAPES, n, 1) == all_reduce_bytes(4 * p, n) == 5160
    assert model_bytes("fp16_hook", SHAPES, n, 5) == 2580
    header = 16  # (N − 1) · (length, flag) int64
    assert model_bytes("terngrad", SHAPES, n, 1) == header + 4 * 4 + 323  # ceil(2·1290/8) = 323
    assert model_bytes("ef_sign", SHAPES, n, 1) == header + 4 * 4 + 162
    k = 6 + 1 + 7 + 1  # ceil(0.01 · d) per tensor
    assert model_bytes("topk", SHAPES, n, 1) == header + 4 + 8 * k
    assert model_bytes("bmuf_topk", SHAPES, n, 7) == 8 and model_bytes("bmuf_topk", SHAPES, n, 8) == 8 + header + 4 + 8 * k
    assert model_bytes("powersgd_hook", SHAPES, n, 2) == 5160 > model_bytes("powersgd_hook", SHAPES, n, 3)
    # DGC's warm-up: density 0.001^(1/5) = 0.251 in the first stage of 8 steps (2 per stage), 0.001 after it
    k0 = 145 + 17 + 161 + 3  # ceil(0.2512 · d)
    assert model_bytes("dgc_warmup", SHAPES, n, 1, 8) == model_bytes("dgc_warmup", SHAPES, n, 2, 8) == header + 4 + 8 * k0
    assert model_bytes("dgc_warmup", SHAPES, n, 9, 8) == model_bytes("dgc", SHAPES, n, 1) == header + 4 + 8 * 4


def _rank(rank, method_fits, model="cnn"):
    return {"rank": rank, "world_size": 2, "spec": {"model": model, "dgc_warmup_steps": 0}, "fits": [
        {"method": m, "train_steps": 4, "loop_comm_bytes": b, "comm_by_kind": {}, "train_s": t, "step_ms": [],
         "evals": [[*e, 3.0 - e[2]] for e in ev], "val_acc": ev[-1][2], "val_loss": 3.0 - ev[-1][2], "tx": None,
         "tx_packets": None, "param_digest": "d", "shapes": SHAPES}
        for m, b, t, ev in method_fits]}  # fmt: skip


def test_rows_compare_with_ddp_and_the_goals_are_judged_from_them():
    fits = [("ddp", 4 * 5160, 4.0, [[2, 2.0, 0.5], [4, 4.0, 0.9]]),
            ("powersgd_hook", 0, 2.0, [[2, 1.0, 0.5], [4, 2.0, 0.9]]),
            ("dgc", 4 * 40, 1.0, [[2, 0.4, 0.9], [4, 0.8, 0.93]])]  # fmt: skip
    rows = compare(build_rows([_rank(0, fits), _rank(1, fits)], "100mbit", "emulated"))
    by = {r["method"]: r for r in rows}
    assert by["ddp"]["logged_bytes_per_step"] == by["ddp"]["model_bytes_per_step"] == 5160
    assert by["powersgd_hook"]["logged_bytes_per_step"] is None  # a peer: its bytes are the model's
    assert by["dgc"]["compression"] == 129.0 and by["dgc"]["acc_vs_ddp"] == pytest.approx(0.03)
    assert by["dgc"]["time_to_ddp_acc_s"] == 0.4 and by["dgc"]["tta_speedup"] == 10.0
    judged = {g["goal"][:3]: g["met"] for g in goals(rows, "100mbit")}
    assert judged == {"DGC": True, "at ": True}
    # the LM reaches DDP by val_loss, lower is better: a row whose loss falls below DDP's final loss reached it
    lm = [("ddp", 4 * 5160, 4.0, [[2, 2.0, 0.5], [4, 4.0, 0.9]]), ("qsgd", 4 * 40, 1.0, [[2, 0.5, 0.85], [4, 1.0, 0.95]])]
    lm_rows = compare(build_rows([_rank(0, lm, "lm"), _rank(1, lm, "lm")], "100mbit", "emulated"))
    assert [r["target"] for r in lm_rows] == ["val_loss"] * 2 and lm_rows[1]["loss_vs_ddp"] == pytest.approx(-0.05)
    assert [r["time_to_ddp_acc_s"] for r in lm_rows] == [4.0, 1.0]
    both = goals(rows + lm_rows, "100mbit")
    assert [g["goal"].rsplit("(", 1)[1] for g in both[1:]] == ["CNN)", "LM, by val_loss)"]
    assert both[2]["met"] is False and "qsgd reached DDP's final val_loss 2.1000 after 1.00 s of training, DDP after " \
        "4.00 s (4.00x sooner)" in both[2]["measured"]
    slower = [("ddp", *fits[0][1:]), ("dgc", 4 * 40, 1.0, [[2, 1.5, 0.8], [4, 3.0, 0.9]])]
    late = goals(compare(build_rows([_rank(0, slower), _rank(1, slower)], "100mbit", "x")), "100mbit")
    assert [g["met"] for g in late] == [True, False] and "1.33x sooner" in late[1]["measured"]


def test_a_tiny_real_run_logs_exactly_the_exact_byte_models(tmp_path):
    """Two loopback ranks, 2 steps per method: DDP and TernGrad log exactly their byte model, DGC less than its
    uncoded payload; every rank ends with the same weights; the JSON, plot and docs section are written."""
    config = SuiteConfig(networks=("loopback",), models=("cnn",), methods=("ddp", "terngrad", "dgc", "local_only"), samples=128,
                         width=8, eval_every=1, timeout=300.0)  # fmt: skip
    check_spec(worker_spec(config, 2))
    doc = run_suite(config, tmp_path, "test", log=lambda _: None)
    by = {r["method"]: r for r in doc["rows"]}
    assert set(by) == {"ddp", "terngrad", "dgc", "local_only"} and all(r["replicas_agree"] for r in doc["rows"])
    for method in ("ddp", "terngrad", "local_only"):
        assert by[method]["logged_bytes_per_step"] == by[method]["model_bytes_per_step"], method
    assert 0 < by["dgc"]["logged_bytes_per_step"] < by["dgc"]["model_bytes_per_step"]
    assert [len(r["evals"]) for r in doc["rows"]] == [2] * 4
    written = json.loads((tmp_path / "compression.json").read_text())
    assert written["rows"][0]["method"] == "ddp" and (tmp_path / "compression.png").stat().st_size > 0
    assert "| loopback |" in docs_section(written, "x.json")


def test_a_tiny_real_lm_run_warms_dgc_up(tmp_path):
    """The LM through the same suite: two loopback ranks, 2 steps of a 1-block LM: DDP logs exactly its byte model;
    dgc_warmup's values alone (fp32, 4 B each) fill the warm-up's first two stages' k (25.1 %, then 6.3 %), so its
    coded indices take between 0 and 4 B each; both ranks end with the same weights; loss and accuracy are evaluated."""
    config = SuiteConfig(networks=("loopback",), models=("lm",), methods=("ddp", "dgc_warmup"), samples=64,
                         batch_size=16, lm_width=16, lm_layers=1, lm_context=16, eval_every=1, timeout=300.0)  # fmt: skip
    doc = run_suite(config, tmp_path, "test", log=lambda _: None)
    by = {r["method"]: r for r in doc["rows"]}
    assert [r["model"] for r in doc["rows"]] == ["lm", "lm"] and all(r["replicas_agree"] for r in doc["rows"])
    assert by["ddp"]["logged_bytes_per_step"] == by["ddp"]["model_bytes_per_step"] == 4 * lm_params(16, 1, 16)
    assert "warmup_steps=4" in by["dgc_warmup"]["what"] and 0 < by["dgc_warmup"]["coded_index_ratio"] < 1
    assert by["dgc_warmup"]["logged_bytes_per_step"] < by["dgc_warmup"]["model_bytes_per_step"]
    assert all(len(e) == 4 and 0 < e[3] < 6 for r in doc["rows"] for e in r["evals"])
    assert by["ddp"]["time_to_ddp_acc_s"] == by["ddp"]["evals"][-1][1]  # DDP reaches its own final loss at the end
    assert "**Byte-level Transformer LM** (width 16, 1 blocks" in docs_section(doc, "x.json")


def _doc(command, launches, networks, config=None, not_run=()):
    """A compression.json of ``launches`` ``(model, network, world size, val_acc of ddp)``: a ddp and a dgc row each."""
    rows = [{"model": m, "network": net, "world_size": ws, "method": method, "val_acc": acc, "bytes_per_step": 1.0,
             "ms_per_step": 1.0, "val_loss": 0.1, "train_steps": 96, "compression": 1.0, "acc_vs_ddp": 0.0,
             "time_to_ddp_acc_s": None}
            for m, net, ws, acc in launches for method in ("ddp", "dgc")]  # fmt: skip
    return {"suite": "compression", "command": command, "created": f"{command} date", "suite_wall_s": 60.0,
            "host": {"cpus": 2, "loadavg_1m_at_start": 3.0}, "config": json.loads(json.dumps(asdict(config or SuiteConfig()))),
            "networks": {n: {"detail": f"{n} link", "rate": n} for n in networks}, "rows": rows, "not_run": list(not_run)}


def test_keep_from_keeps_the_launches_not_made_with_their_provenance_and_refuses_other_settings():
    """No launch: a run that makes one launch keeps the earlier run's other launches in suite order (network by rate,
    ranks, model, method), replaces the one it made again, drops the "not run" line of a launch now made, and names per
    earlier command its launches and networks, through a chain of two keeps; the long part is kept when this run made
    none; other settings or another suite are refused before anything runs, naming the setting."""
    skipped = ["cnn on 1gbit, 4 ranks: skipped, the suite had run 9 s", "lm on 1gbit, 4 ranks: skipped, the suite had run 9 s",
               "DeepSpeed 1-bit Adam: not run"]  # fmt: skip
    first = _doc("first", [("cnn", "100mbit", 2, 0.9), ("lm", "100mbit", 2, 0.3), ("cnn", "1gbit", 2, 0.9)],
                 ["100mbit", "1gbit"], not_run=skipped)  # fmt: skip
    first["long"] = {"command": "long", "error": None, "rows": []}
    now = _doc("second", [("cnn", "1gbit", 4, 0.8), ("cnn", "1gbit", 2, 0.95)], ["1gbit"])
    second = assemble(now, first, ["DeepSpeed 1-bit Adam: not run (now)"])
    launches = [(r["model"], r["network"], r["world_size"], r["val_acc"]) for r in second["rows"][::2]]
    assert launches == [("cnn", "100mbit", 2, 0.9), ("lm", "100mbit", 2, 0.3), ("cnn", "1gbit", 2, 0.95), ("cnn", "1gbit", 4, 0.8)]
    assert [r["method"] for r in second["rows"][:2]] == ["ddp", "dgc"] and list(second["networks"]) == ["100mbit", "1gbit"]
    assert second["kept"] == [{"rows": ["cnn on 100mbit, 2 ranks", "lm on 100mbit, 2 ranks"], "command": "first",
                               "created": "first date", "loadavg_1m_at_start": 3.0, "suite_wall_s": 60.0,
                               "networks": {"100mbit": first["networks"]["100mbit"]}}]  # fmt: skip
    assert second["not_run"] == ["DeepSpeed 1-bit Adam: not run (now)", skipped[1]] and second["long"] == first["long"]
    assert now["rows"] != second["rows"] and "kept" not in now  # assemble leaves this run's document as it was
    third = assemble(_doc("third", [("lm", "1gbit", 4, 0.2)], ["1gbit"]), {**second, "command": "second", "created": "then"}, [])
    assert [(e["command"], e["rows"], list(e["networks"])) for e in third["kept"]] == [
        ("first", ["cnn on 100mbit, 2 ranks", "lm on 100mbit, 2 ranks"], ["100mbit"]),
        ("second", ["cnn on 1gbit, 2 ranks", "cnn on 1gbit, 4 ranks"], ["1gbit"])]  # fmt: skip
    assert third["not_run"] == [] and len(third["rows"]) == 10
    assert "Launches kept from an earlier command (cnn on 1gbit, 2 ranks; cnn on 1gbit, 4 ranks): `second`" in \
        "\n".join(kept_lines(third))
    with pytest.raises(ValueError, match=r"compression\(--keep-from=x\): its rows ran with other settings \(width=64 "
                       r"\(now 32\), seed=0 \(now 1\)\); re-run those launches too"):  # fmt: skip
        check_keep(first, SuiteConfig(width=32, seed=1), "compression(--keep-from=x)")
    with pytest.raises(ValueError, match=r"--keep-from=x\): holds suite 'rl', not 'compression'"):
        check_keep({**first, "suite": "rl"}, SuiteConfig(), "compression(--keep-from=x)")
    check_keep(first, SuiteConfig(rates=("1gbit",), world_sizes=(4,), models=("lm",), parts=("long",)), "x")  # plan may differ


def test_the_long_part_scales_the_steps_and_judges_dgc_at_the_same_step():
    """No launch: the long spec trains the CNN on 2 ranks for --long-scale times the steps, warm-up scaled; each row's
    accuracy at the main run's length and its doublings against DDP's at that step, and the step from which it stayed
    within 0.5 points; the goal line says met or the measured gap; the docs section and the plot show the part."""
    config = SuiteConfig(long_scale=4, long_methods=("ddp", "dgc"))
    spec = check_spec(long_spec(config))
    assert (spec["model"], spec["world_size"], spec["steps"], spec["methods"], spec["dgc_warmup_steps"]) == ("cnn", 2, 384, ["ddp", "dgc"], 96)
    ddp = {"method": "ddp", "evals": [[s, 0.0, 0.95 + s / 10_000, 0.1] for s in range(8, 392, 8)]}
    late = {"method": "dgc", "evals": [[s, 0.0, 0.95 + s / 10_000 - (0.02 if s < 200 else 0.004), 0.1] for s in range(8, 392, 8)],
            "train_steps": 384}  # fmt: skip
    got = long_checkpoints(late, ddp, 96)
    assert got["within_from_step"] == 200 and [a[0] for a in got["acc_at"]] == [96, 192, 384]
    assert got["acc_at"][0] == [96, 0.9396, -0.02] and got["acc_at"][-1][2] == -0.004
    assert long_checkpoints({**late, "evals": late["evals"][:-1] + [[384, 0.0, 0.9, 0.1]]}, ddp, 96)["within_from_step"] is None
    rows = [{**ddp, "world_size": 2, "train_steps": 384, "val_acc": 0.9884, "acc_vs_ddp": 0.0, "compression": 1.0},
            {**late, **got, "world_size": 2, "val_acc": 0.9844, "acc_vs_ddp": -0.004, "compression": 663.0}]  # fmt: skip
    long = {"config": {"main_steps": 96}, "rows": rows}
    (goal,) = goals([], None, long)
    assert goal["met"] is True and goal["goal"].endswith("(CNN, 384 steps on 2 ranks, the long part)")
    assert "after 96 steps -2.00 points; within 0.5 points of DDP at every evaluation from step 200 on" in goal["measured"]
    rows[1] = {**rows[1], "acc_vs_ddp": -0.0056, "val_acc": 0.9828}
    assert goals([], None, long)[0]["met"] is False


def test_a_long_part_renders_in_the_docs_and_the_plot(tmp_path):
    """The long part's table (accuracy at each checkpoint with its points against DDP) follows the model tables, with
    its own command; the plot gets a row of panels for it."""
    rows = []
    for method, acc in (("ddp", 0.99), ("dgc", 0.98)):
        evals = [[s, 0.1 * s, acc - (0.01 if s == 8 else 0.0), 0.1] for s in (8, 16)]
        rows.append({"model": "cnn", "method": method, "network": "loopback", "world_size": 2, "train_steps": 16,
                     "bytes_per_step": 10.0, "compression": 1.0, "val_acc": acc, "acc_vs_ddp": acc - 0.99, "val_loss": 0.1,
                     "ms_per_step": 5.0, "other_load_cores": 0.5, "evals": evals, "acc_at": [[8, acc - 0.01, acc - 0.99], [16, acc, acc - 0.99]],
                     "within_from_step": None if method == "dgc" else 8, "what": "w"})  # fmt: skip
    host = {"cpus": 2, "loadavg_1m_at_start": 1.5, "torch": "t"}
    long = {"command": "python -m lightning_pdist.bench compression --parts long", "created": "c", "host": host, "wall_s": 9.0,
            "network": "loopback: lo", "error": None, "rows": rows,
            "config": {"scale": 2, "world_size": 2, "main_steps": 8, "steps": 16, "batch_size": 32, "lr": 0.05,
                       "momentum": 0.9, "width": 64, "seed": 0, "eval_every": 8}}  # fmt: skip
    doc = {**_doc("x", [], []), "rows": [], "suite_wall_s": 1.0, "long": long, "created": "c", "goals": goals([], None, long)}
    doc["host"]["torch"] = "t"
    section = docs_section(doc, "x.json")
    assert "Command: `python -m lightning_pdist.bench compression --parts long`" in section
    assert "| val_acc at 8 (vs DDP) | val_acc at 16 (vs DDP) |" in section and "0.9700 (-1.00)" in section
    assert "**not met**. dgc sends 1.0x fewer bytes" in section
    assert plot(doc, tmp_path / "c.png").stat().st_size > 0
