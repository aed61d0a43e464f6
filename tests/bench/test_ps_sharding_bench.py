"""The ps_sharding suite: config rules, the communication bound, the report, and one real emulated run."""

import json

import pytest

from lightning_pdist.bench import ps_sharding
from lightning_pdist.bench.__main__ import main as bench_main
from lightning_pdist.bench.netns import EmulatedNetwork
from lightning_pdist.bench.ps_sharding import SuiteConfig, add_speedups, bound_samples_per_s, plan_shares
from lightning_pdist.bench.ps_worker import check_spec

_OK, _REASON = EmulatedNetwork.available()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"workers": (0, 2)}, r"--workers=\(0, 2\)\): each worker count must be an int in \[1, 16\]"),
        ({"workers": (2, 2)}, r"--workers=\(2, 2\)\): give at least one value, none repeated"),
        ({"shardings": ("rows",)}, r"--shardings=\('rows',\)\): each value must be one of \('layer', 'memory', 'chunked', 'paced'\)"),
        ({"chunk_bytes": 100}, r"--chunk-bytes=100\): must be a multiple of 8 bytes, at least 8"),
        ({"rate": "fast"}, r"--rate='fast'\): must look like '100mbit'"),
        ({"width": 1.5}, r"--width=1.5\): must be in \(0, 1\]"),
        ({"steps": 0}, r"--steps=0\): must be an int >= 1"),
        ({"straggler_workers": 1}, r"--straggler-workers=1\): must be an int in \[2, 16\]"),
        ({"slow_delay_s": 0.0}, r"--slow-delay=0.0\): must be > 0 seconds"),
        ({"reply_buffer_bytes": 100}, r"--reply-buffer-bytes=100\): must be 0 \(kernel autotuning\) or an int in \[4096, 67108864\]"),
        ({"nonfinite": "ignore"}, r"--nonfinite='ignore'\): must be one of raise, skip_step, propagate"),
    ],
)
def test_config_rejects_bad_values_naming_option_value_and_rule(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SuiteConfig(**kwargs)


def test_cli_answers_bad_values_with_exit_status_2(tmp_path, capsys):
    assert bench_main(["ps_sharding", "--out", str(tmp_path), "--workers", "0"]) == 2
    assert "ps_sharding(--workers=(0,)): each worker count" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_without_namespaces_the_suite_stops_and_writes_nothing(tmp_path, monkeypatch, capsys):
    """Never loopback figures under a network's name: no namespaces, no run, exit status 1."""
    monkeypatch.setattr(EmulatedNetwork, "available", staticmethod(lambda: (False, "not root")))
    assert bench_main(["ps_sharding", "--quick", "--out", str(tmp_path / "out")]) == 1
    assert "cannot build emulated links here (not root)" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


def test_worker_spec_is_checked():
    spec = ps_sharding.worker_spec(SuiteConfig(), 8, "layer")
    assert spec["servers"] == 4 and spec["slow_worker"] is None
    with pytest.raises(ValueError, match=r"slow_worker=8\): slow_worker must be None or in \[0, 8\)"):
        check_spec({**spec, "slow_worker": 8})
    with pytest.raises(ValueError, match=r"warmup_steps=0\): warmup_steps must be an int >= 1"):
        check_spec({**spec, "warmup_steps": 0})
    with pytest.raises(ValueError, match="unknown"):
        check_spec({**spec, "extra": 1})
    assert spec["reply_buffer_bytes"] is None and spec["nonfinite"] == "raise"  # the strategy's defaults
    tuned = ps_sharding.worker_spec(SuiteConfig(reply_buffer_bytes=16384, nonfinite="propagate"), 4, "memory")
    assert tuned["reply_buffer_bytes"] == 16384 and tuned["nonfinite"] == "propagate"
    with pytest.raises(ValueError, match=r"nonfinite='nan'\): nonfinite must be one of"):
        check_spec({**spec, "nonfinite": "nan"})


def test_chunked_runs_use_the_memory_plan_with_at_most_64_chunks_per_server():
    """A chunked row is the memory plan with chunk_bytes, raised where one server would hold more than 64 chunks."""
    from lightning_pdist.parameter_server.sharding import param_specs, plan_sharding
    from lightning_pdist.models.vgg import vgg16_scaled

    config = SuiteConfig(width=0.125, chunk_bytes=131072)
    for workers in (1, 2, 4, 8):
        spec = ps_sharding.worker_spec(config, workers, "chunked")
        assert spec["sharding"] == "memory" and spec["chunk_bytes"] % 8 == 0
        plan = plan_sharding(param_specs(vgg16_scaled(width=0.125, device="meta")), spec["servers"], "memory",
                             partition_bytes=spec["chunk_bytes"])  # fmt: skip
        per_server = [len({piece.part for piece in plan.param_slices(server)}) for server in range(plan.num_servers)]
        assert max(per_server) <= 64, (workers, spec["chunk_bytes"], per_server)
        assert (spec["chunk_bytes"] == 131072) == (spec["servers"] >= 2)  # one server: 8.7 MB needs > 128 KiB chunks
    assert ps_sharding.worker_spec(config, 4, "memory")["chunk_bytes"] is None


def test_repeated_runs_keep_the_median_run_and_every_runs_figure():
    runs = [{"samples_per_s": v, "run": i} for i, v in enumerate([60.0, 70.0, 65.0])]
    row = ps_sharding.median_run(runs)
    assert row["run"] == 2 and row["samples_per_s_runs"] == [60.0, 70.0, 65.0]
    assert ps_sharding.median_run(runs[:2])["run"] == 0  # even count: the lower middle run
    assert ps_sharding.spread([60.0, 70.0, 65.0]) == "60.0–70.0 (3 runs)" and ps_sharding.spread([60.0]) == "–"
    with pytest.raises(ValueError, match=r"--repeats=0\): must be an int >= 1"):
        SuiteConfig(repeats=0)


def test_the_table_leaves_out_the_columns_no_row_fills():
    """A file from an older run (no CPU or loss figures, one run per row) renders without those columns."""
    row = {"workers": 1, "servers": 1, "sharding": "memory", "samples_per_s": 20.0, "bound_samples_per_s": 40.0,
           "samples_per_s_runs": [20.0]}  # fmt: skip
    keys = [c[1] for c in ps_sharding.shown_columns([row])]
    assert keys == ["workers", "servers", "sharding", "samples_per_s", "bound_samples_per_s", "of_bound"]
    keys = [c[1] for c in ps_sharding.shown_columns([row, {**row, "samples_per_s_runs": [20.0, 21.0], "chunk_bytes": 8}])]
    assert "samples_per_s_runs" in keys and "chunk_bytes" in keys


def test_plan_shares_of_the_scaled_model_are_the_real_vgg16s():
    """vgg16_scaled keeps the full VGG-16's plan shares: fc6 (74%) and a few convs on one server under layer."""
    from lightning_pdist.parameter_server.sharding import param_specs, plan_sharding
    from lightning_pdist.models.vgg import vgg16

    full = param_specs(vgg16(device="meta"))
    for servers in (2, 4):
        shares = plan_shares(0.0625, servers)
        plan = plan_sharding(full, servers, "layer")
        assert shares["layer"]["max_share"] == pytest.approx(plan.max_bytes / plan.nbytes, abs=2e-3)
        assert shares["memory"]["max_share"] == pytest.approx(1 / servers, abs=1e-4)
    assert plan_shares(0.0625, 4)["layer"]["max_share"] == pytest.approx(105_751_360 / 138_357_544, abs=2e-3)  # A6
    assert plan_shares(0.0625, 1)["layer"]["max_share"] == 1.0


def test_bound_is_the_busiest_links_bytes_at_line_rate():
    """8 workers, 4 MB of parameters, 100 Mbit/s: memory on 4 servers moves 8 MB each way on a server link."""
    p, rate = 4_000_000, 100_000_000
    memory = bound_samples_per_s(8, 32, p, 1 / 4, rate)
    assert memory == pytest.approx(8 * 32 / (2 * p * 8 / rate))
    layer = bound_samples_per_s(8, 32, p, 0.75, rate)
    assert memory / layer == pytest.approx(3.0)
    # one worker, one server: the worker's own link is as busy as the server's
    assert bound_samples_per_s(1, 32, p, 1.0, rate) == pytest.approx(32 / (p * 8 / rate))


def test_speedups_and_ratios_are_computed_from_the_rows():
    rows = [
        {"workers": w, "sharding": s, "samples_per_s": v, "bound_samples_per_s": b}
        for w, s, v, b in [(1, "layer", 10.0, 12.0), (1, "memory", 10.0, 12.0), (4, "layer", 20.0, 30.0),
                           (4, "memory", 30.0, 48.0)]  # fmt: skip
    ]
    rows.append({"workers": 4, "sharding": "chunked", "samples_per_s": 45.0, "bound_samples_per_s": 48.0})
    ratios = add_speedups(rows)
    assert [r["speedup_vs_1_worker"] for r in rows] == [1.0, 1.0, 2.0, 3.0, None]  # no 1-worker chunked row
    assert ratios["4"] == {"measured": 1.5, "bound": 1.6, "paper": 1.20, "chunked_vs_memory": 1.5}
    assert ratios["1"]["paper"] is None
    assert ps_sharding.ratio_lines(ratios)[1] == ("- 4 workers: memory / layer = 1.50 measured, 1.60 by the "
                                                  "communication bounds, 1.20 in the paper; chunked / memory = 1.50 measured")


@pytest.mark.skipif(not _OK, reason=_REASON)
def test_real_run_on_emulated_links_writes_rows_plot_and_docs(tmp_path, capsys):
    """Two workers (one server), both plans and the chunked steps, one timed step each on 1 Gbit/s links; the report."""
    out = tmp_path / "out"
    argv = ["ps_sharding", "--out", str(out), "--parts", "sharding", "--workers", "2", "--steps", "1",
            "--warmup-steps", "1", "--width", "0.03125", "--rate", "1gbit", "--batch-size", "8"]  # fmt: skip
    assert bench_main(argv) == 0
    doc = json.loads((out / "ps_sharding.json").read_text())
    assert (out / "ps_sharding.png").stat().st_size > 10_000
    assert [(r["workers"], r["sharding"]) for r in doc["rows"]] == [(2, "layer"), (2, "memory"), (2, "chunked")]
    assert [r["chunk_bytes"] for r in doc["rows"]] == [None, None, ps_sharding.worker_spec(SuiteConfig(width=0.03125), 2, "chunked")["chunk_bytes"]]
    for row in doc["rows"]:
        assert set(ps_sharding.ROW_KEYS) <= set(row)
        assert row["network"] == "emulated 1gbit" and row["servers"] == 1 and row["samples_per_s"] > 0
        # push + pull of the whole model per worker, as the server counts it (framing adds a little)
        full = 2 * row["workers"] * 4 * row["params"]
        if row["sharding"] == "chunked":
            # a worker reads the server's running totals from its last chunk's reply, which may already count the
            # other workers' next pushes (pushes and pulls overlap): each window edge is off by up to (W - 1) pushes
            slack = (row["workers"] - 1) * 4 * row["params"]
            assert full - slack <= row["max_server_bytes_per_step"] < 1.05 * (full + slack)
        else:
            assert full <= row["max_server_bytes_per_step"] < 1.025 * full
        assert row["max_server_bytes_per_step"] == row["mean_server_bytes_per_step"]
        assert 1.0 < row["kernel_server_ratio"] < 1.15
        # (one timed step: /proc/stat's 10 ms ticks are too coarse to order the two shares here)
        assert 0 < row["workers_cpu_share"] <= 1 and 0 < row["machine_cpu_busy"] <= 1
        assert row["tcp_retransmits_per_step"] >= 0 and row["shaper_drops_per_step"] >= 0
        assert 0 <= row["drops_into_servers_per_step"] <= row["shaper_drops_per_step"]
        for key in ("server_in_utilization", "server_in_idle_share", "server_out_utilization", "server_out_idle_share"):
            assert row[key] is None or 0 <= row[key] <= 1.3, (key, row[key])  # None: the window held < 2 samples
        assert row["samples_per_s_runs"] == [row["samples_per_s"]]  # one run of the plan
    assert doc["ratios"]["2"]["bound"] == 1.0 and doc["ratios"]["2"]["chunked_vs_memory"] > 0
    section = (out / "docs_section.md").read_text()
    assert "layer-wise vs memory-balanced" in section and "emulated" in section and "chunk_bytes" in section
    assert "samples/s" in capsys.readouterr().out


def test_link_activity_splits_a_window_into_idle_full_and_partial_bins():
    """link_activity: a host that sends at line rate for 0.1 s, idles 0.1 s and sends at half rate 0.1 s uses the link
    50% of the window, idle a third of the bins and full a third; the received direction, never used, is idle."""
    from lightning_pdist.bench.linkload import link_activity

    rate_bits = 8_000_000  # 1 MB/s
    samples, sent = [], 0.0
    for i in range(301):  # every ms for 0.3 s
        t = i / 1000
        samples.append((10 + t, [(int(sent), 0)]))
        sent += 1000 if t < 0.1 else 0 if t < 0.2 else 500
    (host,) = link_activity(samples, 10.0, 10.3, rate_bits, bin_s=0.01)
    assert host["up"]["utilization"] == pytest.approx(0.5, abs=0.01)
    assert host["up"]["idle_share"] == pytest.approx(1 / 3, abs=0.04)
    assert host["up"]["full_share"] == pytest.approx(1 / 3, abs=0.04)
    assert host["down"] == {"utilization": 0.0, "idle_share": 1.0, "full_share": 0.0}
    assert link_activity(samples, 11.0, 12.0, rate_bits) == []  # no samples in the window
    assert ps_sharding.server_links([host])["server_out_utilization"] == pytest.approx(0.5, abs=0.01)
    assert ps_sharding.server_links([]) == dict.fromkeys(("server_in_utilization", "server_in_idle_share",
                                                         "server_out_utilization", "server_out_idle_share"))  # fmt: skip
