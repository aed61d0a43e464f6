"""The compression suite: options, byte models, rows and goals, and one tiny real loopback run whose logged bytes
equal the byte model exactly where it is exact."""

from __future__ import annotations

import json

import pytest

from lightning_pdist.bench.compression import (CLI, SuiteConfig, build_rows, compare, docs_section, goals, lm_params,
                                               model_bytes, run_suite, worker_spec)  # fmt: skip
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
