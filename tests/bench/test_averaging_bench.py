"""The averaging benchmark suite: plan, rows, JSON schema, comm check, plot, CLI validation, one real run."""

from __future__ import annotations

import json

import pytest

from lightning_pdist.bench import SUITES
from lightning_pdist.bench.__main__ import build_parser, load_suite, main
from lightning_pdist.bench.averaging import (
    ROW_KEYS,
    SuiteConfig,
    build_row,
    comm_check,
    merge_repeats,
    plan_runs,
    plot,
    results_table,
    run_suite,
)
from lightning_pdist.bench.launch import Launched
from lightning_pdist.bench.report import check_rows, markdown_table
from lightning_pdist.bench.worker import check_spec

SPEC = {"strategy": "local_sgd", "period": 8, "world_size": 2, "steps": 96, "batch_size": 32,
        "lr": 0.05, "momentum": 0.9, "width": 64, "seed": 0}  # fmt: skip


def _rank(rank, comm=1000, loop_s=2.0, digest="d", tx=None, loop_comm=None, steps=96, packets=None):
    return {"rank": rank, "train_steps": steps, "val_acc": 0.98, "val_samples": 359, "comm_bytes": comm,
            "comm_by_kind": {"param_all_reduce": comm}, "logged_comm_bytes_total": float(comm),
            "loop_comm_bytes": comm if loop_comm is None else loop_comm, "loop_s": loop_s, "loop_cpu_s": 1.5,
            "fit_s": loop_s + 1, "param_digest": digest, "model_params": 100, "tx": tx,
            "tx_packets": packets or ({k: v // 1000 for k, v in tx.items()} if tx else None)}  # fmt: skip


TIMING = Launched(results=[], wall_s=9.0, ours_cpu_s=12.0, other_cpu_s=0.9)


def test_plan_runs_gives_every_strategy_the_same_samples():
    """DDP, each periodic strategy per period, and one-shot, per world size; steps * batch * ranks is constant."""
    specs = plan_runs(SuiteConfig(world_sizes=(2, 4), periods=(2, 8)))
    assert [(s["strategy"], s["period"]) for s in specs if s["world_size"] == 2] == [
        ("pdist_ddp", 1), ("local_sgd", 2), ("local_sgd", 8), ("bmuf", 2), ("bmuf", 8),
        ("easgd", 2), ("easgd", 8), ("simuparallel_sgd", None),
    ]  # fmt: skip
    assert {s["steps"] * s["batch_size"] * s["world_size"] for s in specs} == {6144}
    for spec in specs:
        check_spec(spec)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"world_sizes": (1,)}, r"--world-size=1\): world_size must be an int in \[2, 16\]"),
        ({"world_sizes": (2, 2)}, r"--world-size=\(2, 2\)\): world sizes must not repeat"),
        ({"periods": (0,)}, r"--periods=0\): a period must be an int >= 1"),
        ({"strategies": ("ddp",)}, r"--strategies=\('ddp',\)\): each strategy must be one of"),
        ({"networks": ("wan",)}, r"--network=\('wan',\)\): each network must be one of"),
        ({"rate": "fast"}, r"rate='fast'"),
        ({"samples": 10}, r"--samples=10\): must be an int >= world_size \* batch_size = 64"),
        ({"momentum": 1.0}, r"--momentum=1.0\): must be in \[0, 1\)"),
        ({"repeats": 0}, r"--repeats=0\): must be an int >= 1"),
        ({"overhead": "maybe"}, r"--overhead='maybe'\): must be one of \('yes', 'no', 'only'\)"),
    ],
)
def test_config_rejects_bad_values_naming_option_value_and_rule(kwargs, match):
    """Every bad option raises ValueError with the option, the value and the rule."""
    with pytest.raises(ValueError, match=match):
        SuiteConfig(**kwargs)


def test_cli_lists_suites_and_answers_bad_values_with_exit_status_2(tmp_path, capsys):
    """--help lists the suites of the dispatch table; a bad value exits 2 with its message, running nothing."""
    assert "averaging" in build_parser().format_help()
    for name in SUITES:
        module = load_suite(name)
        assert callable(module.CLI.add_arguments) and callable(module.run)
    with pytest.raises(ValueError, match=r"suite='nope'\): suite must be one of"):
        load_suite("nope")
    assert main(["averaging", "--quick", "--out", str(tmp_path), "--world-size", "1"]) == 2
    assert "averaging(--world-size=1)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["averaging", "--out", str(tmp_path), "--network", "wan"])
    assert exc.value.code == 2
    assert list(tmp_path.iterdir()) == []


def test_worker_spec_is_checked():
    """A spec with a bad value or a missing key is refused before any training."""
    with pytest.raises(ValueError, match=r"spec\(period=1\): simuparallel_sgd averages once"):
        check_spec({**SPEC, "strategy": "simuparallel_sgd", "period": 1})
    with pytest.raises(ValueError, match=r"spec\(period=8\): pdist_ddp communicates every step"):
        check_spec({**SPEC, "strategy": "pdist_ddp"})
    with pytest.raises(ValueError, match=r"missing keys \['seed'\]"):
        check_spec({k: v for k, v in SPEC.items() if k != "seed"})


def test_build_row_schema_and_kernel_fields():
    """A row carries the required keys, the per-rank mean of bytes, the slowest loop, and the kernel split."""
    tx0 = {"start": 0, "train_start": 900, "train_end": 9900, "after_fit": 9950}
    tx1 = {"start": 0, "train_start": 100, "train_end": 9100, "after_fit": 9150}
    ranks = [_rank(0, 8000, 2.0, "a", tx0), _rank(1, 8000, 2.5, "b", tx1)]
    row = build_row(SPEC, ranks, "emulated", "emulated links", TIMING, rate="100mbit", kernel_tx=[10_000, 9_200])
    check_rows([row], ROW_KEYS, "test")
    assert (row["comm_bytes_per_rank"], row["wall_s"], row["samples"]) == (8000, 2.5, 6144)
    assert row["replicas_agree"] is False
    assert row["other_load_cores"] == 0.1
    assert row["kernel_tx_ratio"] == round(19_200 / 16_000, 4)
    assert row["kernel_tx_phases_by_rank"][0] == {
        "setup": 900, "loop": 9000, "wind_down": 100, "loop_packets": 9, "loop_logged": 8000, "logged": 8000,
    }  # fmt: skip
    json.dumps(row, allow_nan=False)
    with pytest.raises(ValueError, match=r"need one result per rank 0..1"):
        build_row(SPEC, ranks[:1], "loopback", "lo", TIMING)
    with pytest.raises(ValueError, match=r"network='wan'\): network must be one of"):
        build_row(SPEC, ranks, "wan", "?", TIMING)


def test_comm_check_subtracts_the_one_shot_baseline_per_step():
    """loop_net_ratio = (loop tx - baseline/step * steps) / logged; overhead per packet likewise, per frame."""

    def tx(loop):
        return {"start": 0, "train_start": 1000, "train_end": 1000 + loop, "after_fit": 1000 + loop}

    base_ranks = [_rank(r, 0, tx=tx(960), packets=tx(192)) for r in range(2)]
    base = build_row({**SPEC, "strategy": "simuparallel_sgd", "period": None}, base_ranks, "emulated", "e", TIMING,
                     kernel_tx=[2000, 2000])  # fmt: skip
    ranks = [_rank(r, 10_000, tx=tx(960 + 10_500), packets=tx(192 + 10)) for r in range(2)]
    row = build_row(SPEC, ranks, "emulated", "e", TIMING, kernel_tx=[12_000, 12_000])
    (check_base, check_row) = comm_check([base, row])
    assert check_base["loop_net_ratio"] is None  # nothing logged in its loop
    assert check_row["lightning_loop_bytes_per_step"] == 10.0
    assert check_row["loop_net_ratio"] == 1.05
    assert check_row["loop_overhead_bytes_per_packet"] == 50.0
    assert check_row["ratio"] == 1.2


def test_merge_repeats_keeps_the_fastest_and_every_time():
    """With repeats, the row is the fastest run's, and lists every run's wall time."""
    rows = [build_row(SPEC, [_rank(0, loop_s=s), _rank(1, loop_s=s)], "loopback", "lo", TIMING) for s in (3.0, 2.0)]
    merged = merge_repeats(rows)
    assert (merged["wall_s"], merged["wall_s_repeats"], merged["repeats_agree"]) == (2.0, [3.0, 2.0], True)


def test_plot_and_table_from_given_rows(tmp_path):
    """The figure is a PNG written from rows alone; the table has a line per row; no rows is refused."""
    rows = [
        build_row({**SPEC, "strategy": s, "period": p}, [_rank(0, c), _rank(1, c)], net, net, TIMING)
        for s, p, c in (("pdist_ddp", 1, 8000), ("local_sgd", 8, 1000), ("simuparallel_sgd", None, 0))
        for net in ("loopback", "emulated")
    ]
    path = plot(rows, tmp_path / "a.png", title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(results_table(rows).splitlines()) == 2 + len(rows)
    with pytest.raises(ValueError, match=r"rows must hold at least one run"):
        plot([], tmp_path / "b.png")
    assert markdown_table([{"a": None}], [("A", "a", ".2f")]).splitlines()[-1] == "| – |"


@pytest.mark.standalone
def test_real_loopback_run_writes_rows_and_local_sgd_sends_period_times_less(tmp_path):
    """Two real 2-rank runs on loopback: JSON rows exist, local SGD (period 4) logs 1/4 of DDP's bytes, plus its
    non-finite flag (nonfinite='raise': 2 floats all-reduced on 2 ranks, 8 bytes, per local step)."""
    config = SuiteConfig(networks=("loopback",), strategies=("pdist_ddp", "local_sgd"), periods=(4,),
                         samples=8 * 2 * 32, width=16, overhead="no")  # fmt: skip
    run_suite(config, tmp_path, "test", log=lambda line: None)
    doc = json.loads((tmp_path / "averaging.json").read_text())
    check_rows(doc["rows"], ROW_KEYS, "test")
    ddp, local = doc["rows"]
    assert (ddp["strategy"], local["strategy"]) == ("pdist_ddp", "local_sgd")
    assert ddp["train_steps"] == local["train_steps"] == 8
    assert 0 < local["comm_bytes_per_rank"] < ddp["comm_bytes_per_rank"]
    flag = local["comm_by_kind"]["nonfinite_flag"]
    assert flag == 8 * 8 and "nonfinite_flag" not in ddp["comm_by_kind"]  # DDP agrees through its gradient average
    assert ddp["comm_bytes_per_rank"] == 4 * (local["comm_bytes_per_rank"] - flag)
    assert ddp["replicas_agree"] and local["replicas_agree"]
    assert (tmp_path / "averaging.png").stat().st_size > 0


def _overhead_rank(rank, ddp_ms, ours_ms, repeats=2, width=16):
    fits = [{"strategy": name, "width": width, "repeat": r, "model_params": 100, "cpu_ms_per_step": ms,
             "step_ms": [ms, ms, ms * 3]} for r in range(repeats)
            for name, ms in (("ddp", ddp_ms), ("pdist_ddp", ours_ms), ("ddp_again", ddp_ms))]
    return {"rank": rank, "fits": fits}


def test_overhead_rows_pair_each_repeat_and_take_medians():
    """One row per width: per-fit medians (an outlier step does not count), averaged over ranks; ratio = median of
    the repeats' paired ratios."""
    from lightning_pdist.bench.overhead import ROW_KEYS as OVERHEAD_KEYS, overhead_rows

    (row,) = overhead_rows([_overhead_rank(0, 2.0, 2.1), _overhead_rank(1, 2.0, 2.1)])
    check_rows([row], OVERHEAD_KEYS, "test")
    assert row["ddp_ms_per_step"] == 2.0 and row["pdist_ddp_ms_per_step"] == 2.1
    assert row["ratio"] == pytest.approx(1.05) and row["ratio_by_repeat"] == [1.05, 1.05] and row["repeats"] == 2
    assert row["ratio_cpu"] == pytest.approx(1.05) and row["control_ratio"] == 1.0
    with pytest.raises(ValueError, match=r"ranks=\[\]"):
        overhead_rows([])
    empty = _overhead_rank(0, 2.0, 2.1)
    empty["fits"][0]["step_ms"] = []
    with pytest.raises(ValueError, match="timed no step"):
        overhead_rows([empty])


@pytest.mark.standalone
def test_real_overhead_row_times_ddp_and_pdist_ddp_in_the_same_processes(tmp_path):
    """--overhead only: one 2-rank loopback launch trains both strategies in turn and writes one row per width."""
    config = SuiteConfig(networks=("loopback",), overhead="only")
    from lightning_pdist.bench.averaging import run_overhead

    result = run_overhead(config, tmp_path / "overhead", log=lambda line: None, steps=6, repeats=2, warmup_steps=2)
    assert [r["width"] for r in result["rows"]] == [16, 64]
    for row in result["rows"]:
        assert row["ddp_ms_per_step"] > 0 and row["pdist_ddp_ms_per_step"] > 0 and len(row["ratio_by_repeat"]) == 2
