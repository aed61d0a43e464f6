"""The diloco suite: config rules, the byte model, and one tiny real run (ours and torchft's DiLoCo, loopback)."""

import json
from dataclasses import asdict

import pytest

from lightning_pdist.bench.__main__ import main as bench_main
from lightning_pdist.bench.diloco import (TABLE_COLUMNS, SuiteConfig, byte_model, docs_section, goals, keep_rows,
                                          plan_runs, run_suite, step_bytes)  # fmt: skip
from lightning_pdist.bench.diloco_curves import add_reach, curve_fields
from lightning_pdist.bench.report import markdown_table


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"sync_every": (3,)}, r"diloco\(--sync-every=3\): each H must be an int >= 1 dividing --steps=8"),
        ({"fragments": (3,)}, r"diloco\(--fragments=3\): each P must be an int >= 1 dividing the largest H=4"),
        ({"overlap": 2}, r"diloco\(--overlap=2\): must be < H/P = 2 for P=2"),
        ({"runs": ("ddp", "ddp")}, r"diloco\(--runs=\('ddp', 'ddp'\)\): give at least one value, none repeated"),
        ({"quantize": "int2"}, r"diloco\(--quantize='int2'\): must be int4 or int8"),
        ({"world_size": 1}, r"diloco\(--world-size=1\): must be an int >= 2"),
        ({"balance": "bytes"}, r"diloco\(--balance='bytes'\): must be layers or params"),
        ({"rates": ("100mbit", "100mbit")}, r"diloco\(--rate=\('100mbit', '100mbit'\)\): give at least one value"),
    ],
)
def test_config_rejects_bad_values_naming_option_value_and_rule(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SuiteConfig(**kwargs)


def test_cli_answers_a_bad_value_with_exit_status_2(tmp_path, capsys):
    assert bench_main(["diloco", "--quick", "--out", str(tmp_path), "--overlap", "5"]) == 2
    assert "diloco(--overlap=5)" in capsys.readouterr().err


def test_byte_model_by_hand():
    """d = 1000 on 2 ranks: AR(4000 B) = 4000 B; int4 codes of 1024 padded values = 512 B + 16 scales × 4 B."""
    common = {"world_size": 2, "sync_every": 10, "quantize": None}
    assert byte_model({**common, "strategy": "ddp"}, 1000, None) == (4000, 4000)
    assert byte_model({**common, "strategy": "diloco"}, 1000, [1000]) == (400, 4000)
    assert byte_model({**common, "strategy": "streaming_diloco"}, 1000, [600, 400]) == (400, 2400)
    assert byte_model({**common, "strategy": "streaming_diloco", "quantize": "int4"}, 1000, [1000]) == (57.6, 576)
    labels = [s["strategy"] for s in plan_runs(SuiteConfig())]
    assert labels == ["ddp", "local_sgd", "bmuf", "diloco", "streaming_diloco", "streaming_diloco", "torchft_diloco"]
    # per step (H=4, 8 steps): fragment 0 after steps 4 and 8, fragment 1 (offset 2) after steps 2 and 6
    spec = {**common, "strategy": "streaming_diloco", "sync_every": 4, "steps": 8}
    assert step_bytes(spec, 1000, [600, 400]) == [0, 1600, 0, 2400, 0, 1600, 0, 2400]
    assert step_bytes({**spec, "strategy": "bmuf"}, 1000, None) == [0, 0, 0, 4000] * 2


def test_curves_peak_rate_and_reach_by_hand():
    """Two ranks, 3 steps: the rank-mean loss, its trailing mean, the slowest rank's clock, cumulative bytes, the
    peak bytes per second of one step, and the first step within 2% of DDP's final loss."""
    ranks = [{"losses": [4.0, 2.0, 1.0], "step_end_s": [1.0, 2.0, 4.0], "step_tx_bytes": [10, 300, 0]},
             {"losses": [2.0, 2.0, 1.0], "step_end_s": [1.5, 2.0, 3.0], "step_tx_bytes": [100, 0, 50]}]  # fmt: skip
    got = curve_fields(ranks, [0, 500, 0])
    assert got["curve"] == {"step": [1, 2, 3], "seconds": [1.5, 2.0, 4.0], "model_bytes": [0, 500, 500],
                            "loss": [3.0, 2.5, 2.0]}  # fmt: skip
    assert (got["peak_kernel_bytes"], got["peak_kernel_bytes_per_s"]) == (300, 300)  # rank 0, step 2: 300 B in 1 s
    ddp = {"network": "n", "strategy": "ddp", **curve_fields(ranks, [7, 7, 7])}
    ours = {"network": "n", "strategy": "diloco", **got}
    add_reach([ddp, ours])
    assert ours["target_loss"] == 2.04 and (ours["reach_step"], ours["reach_s"], ours["reach_model_bytes"]) == (3, 4.0, 500)
    assert "_curve_full" not in ours and ddp["reach_model_bytes"] == 21


def test_a_tiny_real_run_of_ours_and_torchfts_diloco(tmp_path):
    """Two loopback launches: our bytes as logged equal the byte model, every replica ends on the same model, the
    torchft goal row is computed, and the docs section renders the rows."""
    config = SuiteConfig(networks=("loopback",), runs=("diloco", "torchft_diloco"), steps=4, sync_every=(2,), overlap=0,
                         width=32, layers=1, text_bytes=1 << 17, batch_size=4, context=32)  # fmt: skip
    doc = run_suite(config, tmp_path, "test", log=lambda s: None)
    ours, theirs = doc["rows"]
    assert not ours["error"] and not theirs["error"], (ours["error"], theirs["error"])
    assert ours["logged_bytes_per_step"] == ours["model_bytes_per_step"] == round(2 * 4 * ours["model_params"] / 2 / 2)
    assert ours["peak_logged_bytes"] == ours["peak_model_bytes"]
    assert ours["replicas_agree"] and theirs["replicas_agree"]
    assert ours["curve"]["step"] == theirs["curve"]["step"] == [1, 2, 3, 4] and ours["reach_step"] is None  # no DDP row
    assert ours["val_loss"] == pytest.approx(theirs["val_loss"], rel=0.05)  # same rule, same data, same start
    assert [g["goal"] for g in doc["goals"]] == ["ours >= torchft's DiLoCo in steps/s at H=2"]
    assert json.loads((tmp_path / "diloco.json").read_text())["rows"] == doc["rows"]
    section = docs_section(doc, "x.json")
    assert markdown_table(doc["rows"], TABLE_COLUMNS) in section


def test_keep_from_adds_the_rows_this_run_did_not_make_again(tmp_path):
    """--keep-from: an earlier run's rows of other (network, ranks, run) are kept, its same ones replaced; goals and the
    reach are per network and world size; another model's file is refused by setting."""
    row = lambda net, n, lab, loss: {"network": net, "world_size": n, "label": lab, "strategy": lab.split()[0],  # noqa: E731
                                     "error": None, "val_loss": loss, "sync_every": 4, "steps_per_s": 1.0,
                                     "model_bytes_per_step": 8.0, "peak_model_bytes": 32.0}  # fmt: skip
    old = {"suite": "diloco", "command": "old", "created": "then", "host": {"cpus": 2, "loadavg_1m_at_start": 3.0},
           "suite_wall_s": 9.0, "networks": {"emulated 1gbit": {"detail": "4 hosts"}},
           "config": json.loads(json.dumps(asdict(SuiteConfig()))),
           "rows": [row("emulated 1gbit", 4, "ddp", 2.0), row("emulated 1gbit", 4, "diloco H=4", 2.2),
                    row("loopback", 2, "ddp", 9.9)]}  # fmt: skip
    (tmp_path / "old.json").write_text(json.dumps(old))
    config = SuiteConfig(keep_from=str(tmp_path / "old.json"))
    doc = {"config": asdict(config), "networks": {"loopback": {"detail": "lo"}},
           "rows": [row("loopback", 2, "ddp", 1.0), row("loopback", 2, "diloco H=4", 1.01)]}
    keep_rows(doc, old, config)
    assert [(r["network"], r["world_size"], r["label"], r["val_loss"]) for r in doc["rows"]] == [
        ("loopback", 2, "ddp", 1.0), ("loopback", 2, "diloco H=4", 1.01),
        ("emulated 1gbit", 4, "ddp", 2.0), ("emulated 1gbit", 4, "diloco H=4", 2.2)]  # fmt: skip
    assert doc["kept"]["rows"] == 2 and list(doc["networks"]) == ["loopback"]
    assert [(g["network"], g["world_size"], g["met"]) for g in goals(doc["rows"])] == [
        ("loopback", 2, False), ("emulated 1gbit", 4, False)]  # fmt: skip
    with pytest.raises(ValueError, match=r"diloco\(--keep-from=.*\): its rows ran with other settings \(width=64 \(now 32\)\)"):
        keep_rows(dict(doc, config=asdict(SuiteConfig(width=32))), old, config)
    with pytest.raises(ValueError, match=r"--keep-from=.*must be an existing diloco.json"):
        SuiteConfig(keep_from=str(tmp_path / "missing.json"))


def test_rounds_pool_into_medians_and_the_steps_goal_compares_round_by_round():
    """--rounds: a row's timings are the medians of its rounds (each kept); the steps/s goal is the median of the
    per-round ratios ours/torchft's, not the ratio of the medians; rows without rounds compare their one figure."""
    from lightning_pdist.bench.diloco import pooled_row, steps_goal
    from lightning_pdist.bench.launch import Launched

    def launch(loop_s, cpu_s, other):
        rank = {"model_params": 100, "fragment_numels": [100], "comm_bytes": 80, "step_bytes": [0, 0, 0, 80],
                "loop_tx_bytes": None, "loop_s": loop_s, "loop_cpu_s": cpu_s, "val_loss": 2.0, "val_acc": 0.5,
                "train_loss_last": 2.1, "param_digest": "a", "text_bytes": 1, "text_sha": "s",
                "losses": [3.0, 2.5, 2.2, 2.1], "step_end_s": [1.0, 2.0, 3.0, loop_s], "step_tx_bytes": None}  # fmt: skip
        return Launched(results=[rank, dict(rank, loop_s=loop_s / 2)], wall_s=10.0, ours_cpu_s=1.0, other_cpu_s=other)

    spec = {"strategy": "diloco", "world_size": 2, "steps": 4, "sync_every": 4, "num_fragments": 1, "overlap_steps": 0,
            "quantize": None, "balance": "params"}  # fmt: skip
    row = pooled_row(spec, [launch(4.0, 1.0, 5.0), launch(2.0, 3.0, 10.0), launch(8.0, 2.0, 0.0)], "loopback", None)
    assert (row["rounds"], row["loop_s"], row["steps_per_s"], row["step_ms"], row["loop_cpu_s"]) == (3, 4.0, 1.0, 1000.0, 2.0)
    assert row["round_steps_per_s"] == [1.0, 2.0, 0.5] and row["other_load_cores"] == 0.5
    assert pooled_row(spec, [launch(4.0, 1.0, 5.0)], "loopback", None).get("rounds") is None
    theirs = {"steps_per_s": 1.0, "loop_cpu_s": 1.0, "round_steps_per_s": [2.0, 1.0, 0.25]}
    got = steps_goal(row, theirs)  # ratios 0.5, 2.0, 2.0: median 2.0 (the medians alone say 1.0 vs 1.0)
    assert got["met"] and "per round 0.50, 2.00, 2.00: median 2.00" in got["measured"]
    assert not steps_goal({"steps_per_s": 1.0}, {"steps_per_s": 1.5})["met"]
