"""The parameter_server suite: options and worker specs refused with their rule, rows, goal and findings judged from
the rows, and one tiny real run in which Sandblaster on two workers ends where one-process L-BFGS does."""

from __future__ import annotations

import json

import pytest

from lightning_pdist.bench.parameter_server import SuiteConfig, build_row, compare, docs_section, findings, goals, run_suite, worker_spec
from lightning_pdist.bench.ps_family_worker import check_spec, text_data


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"parts": ("easgd", "easgd")}, r"parameter_server\(--parts=\('easgd', 'easgd'\)\): give at least one value"),
        ({"methods": ("hogwild",)}, r"--methods=\('hogwild',\)\): each value must be one of"),
        ({"easgd_workers": 1}, r"--easgd-workers=1\): must be an int >= 2"),
        ({"parallax_steps": 2}, r"--parallax-steps=2\): must exceed --warmup-steps=2"),
        ({"lbfgs_batch": 255}, r"--lbfgs-batch=255\): must divide by --sandblaster-workers=2"),
        ({"slow_factor": 0.5}, r"--slow-factor=0.5\): must be >= 1"),
        ({"target_acc": 1.5}, r"--target-acc=1.5\): must be in \(0, 1\]"),
        ({"rate": "fast"}, r"rate"),
    ],
)  # fmt: skip
def test_bad_options_are_refused_naming_option_value_and_rule(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SuiteConfig(**kwargs)


def test_specs_follow_the_parts():
    """The straggler is the last EASGD rank; LBFGS runs alone on the whole batch, sgd_ddp splits it; the text rows
    take the text settings; a spec mixing a method with the wrong task is refused."""
    config = SuiteConfig(easgd_workers=4)
    easgd = worker_spec(config, "ps_easgd", "cnn")
    assert (easgd["world_size"], easgd["slow_rank"], easgd["slow_factor"]) == (4, 3, 3.0)
    assert worker_spec(config, "lbfgs", "logreg")["world_size"] == 1
    sgd = worker_spec(config, "sgd_ddp", "mlp")
    assert (sgd["batch_size"], sgd["momentum"]) == (256, 0.9)
    text = worker_spec(config, "parallax", "text")
    assert (text["lr"], text["vocab"], text["slow_rank"]) == (1.0, 200_000, None)
    with pytest.raises(ValueError, match=r"ps_family_worker spec\(task='cnn'\): method 'ddp' runs task 'text'"):
        check_spec({**text, "method": "ddp", "task": "cnn"})
    with pytest.raises(ValueError, match=r"spec\(world_size=2\): lbfgs is the one-process reference"):
        check_spec({**worker_spec(config, "lbfgs", "mlp"), "world_size": 2})


def test_text_data_plants_each_class_markers_in_a_large_vocabulary():
    x, y = text_data(200_000, 64, 256, seed=0).tensors
    assert x.shape == (256, 64) and int(x.min()) >= 2 and int(x.max()) < 200_000 and int(x.max()) > 100_000
    shared = set(x[y == 0].flatten().tolist()) & set(x[y == 1].flatten().tolist())
    assert len(shared) < 0.2 * len(set(x.flatten().tolist()))  # the long tail: few ids common to both classes


def _rank(method, ms, acc, loss, slow=0.0, evals=()):
    return {"rank": 0, "method": method, "task": "text" if method in ("parallax", "ddp", "ps") else "cnn",
            "world_size": 4, "params": 100, "train_steps": 10, "timed_steps": 8, "ms_per_step": ms, "loop_s": 1.0,
            "bytes_per_step": 1000.0, "kernel_tx_per_step": None, "rows_per_step": None, "val_acc": acc,
            "train_loss": loss, "evals": list(evals), "slow_sleep_s": slow}  # fmt: skip


def test_rows_goal_and_findings_are_judged_from_the_measurements():
    rows = compare([build_row([_rank("parallax", 100.0, 0.70, 0.5)] * 4, "emulated", None, 0.9),
                    build_row([_rank("ddp", 400.0, 0.705, 0.5)] * 4, "emulated", None, 0.9)])  # fmt: skip
    assert rows[0]["step_rate_x"] == 4.0 and rows[0]["acc_vs"] == pytest.approx(-0.005)
    (goal,) = goals(rows)
    assert goal["met"] is True and "4.00x the step rate" in goal["measured"]
    slower = compare([build_row([_rank("parallax", 200.0, 0.70, 0.5)], "e", None, 0.9), rows[1]])
    assert goals(slower)[0]["met"] is False
    easgd = build_row([_rank("ps_easgd", 10.0, 0.95, 0.1, evals=[[10, 0.5, 0.8, 1.0], [20, 1.1, 0.93, 0.3]]),
                       _rank("ps_easgd", 30.0, 0.95, 0.1, slow=0.02)], "loopback", 0.1, 0.9)  # fmt: skip
    assert (easgd["time_to_target_s"], easgd["fast_ms_per_step"], easgd["straggler_ms_per_step"]) == (1.1, 10.0, 30.0)
    assert "ps_easgd 1.10 s" in findings([easgd], 0.9)[0]
    assert goals([easgd])[0]["met"] is None


def test_a_tiny_real_run_writes_rows_json_plot_and_docs(tmp_path):
    """Sandblaster on 2 loopback workers and torch's LBFGS in one process, 3 steps of logistic regression: both rows,
    every step evaluated on rank 0, Sandblaster's bytes counted and the reference's none, losses finite and below
    the start, and Sandblaster's training loss equal to one-process LBFGS's at every step (both read the same
    batches: Lightning's shuffling sampler is off for this part); the JSON, plot and docs section are written and the
    section renders from the JSON."""
    import math

    config = SuiteConfig(parts=("sandblaster",), methods=("sandblaster", "lbfgs"), sandblaster_tasks=("logreg",),
                         sandblaster_steps=3, warmup_steps=1, eval_every=1, timeout=120.0)  # fmt: skip
    doc = run_suite(config, tmp_path, "test", log=lambda _: None)
    by = {r["method"]: r for r in doc["rows"]}
    assert set(by) == {"sandblaster", "lbfgs"} and by["sandblaster"]["steps"] == by["lbfgs"]["steps"] == 3
    assert by["sandblaster"]["bytes_per_step"] > 0 and by["lbfgs"]["bytes_per_step"] == 0
    for row in by.values():
        assert [e[0] for e in row["evals"]] == [1, 2, 3] and math.isfinite(row["train_loss"])
        assert row["train_loss"] < math.log(10)  # below a uniform guess over the 10 digits
    for (_, _, _, mine), (_, _, _, ref) in zip(by["sandblaster"]["evals"], by["lbfgs"]["evals"]):
        assert abs(mine - ref) <= 2e-5, (by["sandblaster"]["evals"], by["lbfgs"]["evals"])  # losses kept to 5 decimals
    saved = json.loads((tmp_path / "parameter_server.json").read_text())
    assert (tmp_path / "parameter_server.png").stat().st_size > 0
    assert "| sandblaster |" in docs_section(saved, "x.json") and saved["goals"][0]["met"] is None


def test_the_command_line_builds_the_config_and_refuses_a_bad_value(tmp_path, capsys):
    """The suite is registered; --quick picks the small plan; a bad value exits 2 naming it, running nothing."""
    from lightning_pdist.bench.__main__ import build_parser, main
    from lightning_pdist.bench.parameter_server import CLI

    args = build_parser().parse_args(["parameter_server", "--quick", "--out", str(tmp_path), "--parts", "parallax"])
    config = CLI.config_of(args["parameter_server"])
    assert (config.parts, config.parallax_workers, config.parallax_steps, config.vocab) == (("parallax",), 2, 4, 200_000)
    assert main(["parameter_server", "--out", str(tmp_path), "--slow-factor", "0.5"]) == 2
    assert "parameter_server(--slow-factor=0.5): must be >= 1" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_keep_from_adds_the_parts_not_run_and_names_their_run(tmp_path):
    from lightning_pdist.bench.parameter_server import keep

    old = {"suite": "parameter_server", "created": "T0", "command": "python ... parameter_server --out D",
           "host": {"loadavg_1m_at_start": 1.5}, "networks": {"emulated 100mbit": {"detail": "d"}},
           "rows": [{"part": "parallax", "network": "emulated 100mbit"}, {"part": "sandblaster", "network": "loopback"}]}  # fmt: skip
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    doc = {"networks": {"loopback": {}}, "rows": [{"part": "sandblaster", "network": "loopback", "new": True}]}
    keep(doc, SuiteConfig(parts=("sandblaster",), keep_from=str(path)))
    assert [r["part"] for r in doc["rows"]] == ["sandblaster", "parallax"] and doc["rows"][0]["new"]
    assert doc["kept"]["parts"] == ["parallax"] and doc["kept"]["created"] == "T0" and "emulated 100mbit" in doc["networks"]
    with pytest.raises(ValueError, match=r"--keep-from='nowhere.json'\): must be a parameter_server.json"):
        SuiteConfig(keep_from="nowhere.json")
