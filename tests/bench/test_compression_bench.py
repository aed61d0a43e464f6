"""The compression suite: options, byte models, rows and goals, and one tiny real loopback run whose logged bytes
equal the byte model exactly where it is exact."""

from __future__ import annotations

import json

import pytest

from lightning_pdist.bench.compression import (SuiteConfig, build_rows, compare, docs_section, goals, model_bytes,
                                               run_suite, worker_spec)  # fmt: skip
from lightning_pdist.bench.compression_worker import check_spec
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
    ],
)  # fmt: skip
def test_bad_options_are_refused_naming_option_value_and_rule(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SuiteConfig(**kwargs)


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


def _rank(rank, method_fits):
    return {"rank": rank, "world_size": 2, "fits": [
        {"method": m, "train_steps": 4, "loop_comm_bytes": b, "comm_by_kind": {}, "train_s": t, "step_ms": [],
         "evals": ev, "val_acc": ev[-1][2], "tx": None, "tx_packets": None, "param_digest": "d", "shapes": SHAPES}
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
    slower = [("ddp", *fits[0][1:]), ("dgc", 4 * 40, 1.0, [[2, 1.5, 0.8], [4, 3.0, 0.9]])]
    late = goals(compare(build_rows([_rank(0, slower), _rank(1, slower)], "100mbit", "x")), "100mbit")
    assert [g["met"] for g in late] == [True, False] and "1.33x sooner" in late[1]["measured"]


def test_a_tiny_real_run_logs_exactly_the_exact_byte_models(tmp_path):
    """Two loopback ranks, 2 steps per method: DDP and TernGrad log exactly their byte model, DGC less than its
    uncoded payload; every rank ends with the same weights; the JSON, plot and docs section are written."""
    config = SuiteConfig(networks=("loopback",), methods=("ddp", "terngrad", "dgc", "local_only"), samples=128,
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
