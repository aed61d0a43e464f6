"""The shared harness: one launcher on loopback, the Launcher's files, timing and failures, worker_main, and the
command line generated from a suite's SuiteConfig (its fields, their docstrings, the quick and full plans)."""

import json
import sys
import textwrap

import pytest

from lightning_pdist.bench.__main__ import build_parser, load_suite
from lightning_pdist.bench.launch import Launcher, worker_main
from lightning_pdist.bench.netns import LOOPBACK, LaunchError, launch_ranks

# A worker module: worker_main reads --spec, checks it, runs, writes rank<RANK>.json. A rank told to fail exits
# before importing anything (importing lightning_pdist imports Lightning: seconds per process on these cores).
WORKER = textwrap.dedent(
    """
    import json, os, sys

    if json.loads(sys.argv[sys.argv.index("--spec") + 1])["fail_rank"] == int(os.environ["RANK"]):
        sys.exit("rank failed on purpose")

    from lightning_pdist.bench.launch import worker_main

    def run(spec, out_dir):
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME")
        return {"env": {k: os.environ[k] for k in keys}, "spec": spec}

    raise SystemExit(worker_main("fake_worker", __doc__, lambda spec: spec, run))
    """
)


def test_loopback_launch_gives_each_rank_the_per_rank_environment(tmp_path):
    """LOOPBACK answers the launcher like a network: every rank on 127.0.0.1 and lo, ranks numbered as nodes."""
    code = "import json, os; print(json.dumps({k: os.environ[k] for k in ('RANK', 'NODE_RANK', 'MASTER_ADDR', 'GLOO_SOCKET_IFNAME')}))"
    results = launch_ranks(LOOPBACK, [sys.executable, "-c", code], 2, 29999, timeout=60)
    assert [json.loads(r.stdout) for r in results] == [
        {"RANK": str(r), "NODE_RANK": str(r), "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"} for r in (0, 1)]
    with pytest.raises(LaunchError, match=r"launch_ranks: rank 1 \(on loopback\) exited with code 3"):
        launch_ranks(LOOPBACK, [sys.executable, "-c", "import os, sys; sys.exit(3 * int(os.environ['RANK']))"], 2, 29999)


def test_launcher_reads_every_ranks_file_and_turns_a_failure_into_its_reason(tmp_path, monkeypatch):
    """One launch per run in its own folder; the files worker_main wrote, in rank order; a failure raises, or with
    ``errors`` becomes the row's reason (first and last line of the message)."""
    (tmp_path / "fake_worker.py").write_text(WORKER)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{':'.join(sys.path)}")
    launcher = Launcher("test", tmp_path / "scratch", timeout=60)
    got = launcher.run("fake_worker", {"fail_rank": None}, 2)
    assert [r["env"]["RANK"] for r in got.results] == ["0", "1"] and got.error is None and got.kernel is None
    assert all(r["env"]["TP_SOCKET_IFNAME"] == "lo" and r["spec"] == {"fail_rank": None} for r in got.results)
    assert got.wall_s > 0 and (got.other_load_cores is None or got.other_load_cores >= 0)
    failed = launcher.run("fake_worker", {"fail_rank": 0}, 1, errors=300)
    assert failed.results == [] and failed.error.startswith("launch_ranks: rank 0 (on loopback) exited with code 1")
    assert failed.error.endswith("rank failed on purpose") and len(failed.error) <= 300
    with pytest.raises(LaunchError, match="rank 0"):
        launcher.run("fake_worker", {"fail_rank": 0}, 1)
    assert launcher.count == 3 and sorted(p.name for p in (tmp_path / "scratch" / "run1").iterdir()) == ["rank0.json", "rank1.json"]


def test_worker_main_refuses_a_spec_that_is_not_a_json_object(tmp_path, capsys):
    """--spec must be a JSON object; a bad one exits with status 2 and says so, before running anything."""
    for spec in ("[1, 2]", "{nope"):
        with pytest.raises(SystemExit) as exc:
            worker_main("w", None, lambda s: s, lambda s, o: pytest.fail("ran"), ["--spec", spec, "--out-dir", str(tmp_path)])
        assert exc.value.code == 2 and "must be a JSON object" in capsys.readouterr().err


@pytest.mark.parametrize("suite", ["averaging", "sign", "ps_sharding", "pipeline", "tensor_parallel", "compression", "rl"])
def test_every_config_field_is_an_option_with_its_docstring_and_plan(suite):
    """The CLI is the config: one option per SuiteConfig field, helped by the field's docstring; --quick and its
    absence pick the plans' values for the fields they name and the dataclass defaults for the others."""
    from dataclasses import fields

    from lightning_pdist.bench.cli import field_help, suite_parser

    module = load_suite(suite)
    cli, config = module.CLI, module.SuiteConfig
    sub = suite_parser(suite, None)
    cli.add_arguments(sub)
    helps = {opt: action.help for action in sub._actions for opt in action.option_strings}
    docs = field_help(config)
    for f in fields(config):
        if f.name != "quick":
            assert docs.get(f.name), f"{suite}: SuiteConfig.{f.name} has no docstring (it is the option's help)"
            assert helps[cli.flag(f.name)].startswith(docs[f.name].replace("%", "%%"))
    parser = build_parser()
    quick = cli.config_of(parser.parse_args([suite, "--quick", "--out", "x"])[suite])
    full = cli.config_of(parser.parse_args([suite, "--out", "x"])[suite])
    assert quick.quick and not full.quick
    for f in fields(config):
        if f.name in cli.quick:
            assert (getattr(quick, f.name), getattr(full, f.name)) == (cli.quick[f.name], cli.full[f.name])
        elif f.name != "quick":
            assert getattr(quick, f.name) == getattr(full, f.name) == f.default



# A worker for Launcher.run_each: spec i answers its process, port and rank, drops RANK (as Lightning's teardown drops
# the launcher's variables), and rank 1 fails at the spec that says so.
EACH_WORKER = textwrap.dedent(
    """
    import os, sys, time

    from lightning_pdist.bench.launch import worker_main

    def run(spec, out_dir):
        # a real spec rendezvouses (init_process_group), so no rank runs ahead of the others: wait for both results of
        # the spec before (without this, rank 1 could reach the failing spec before rank 0 wrote spec 0)
        before, deadline = out_dir.parent / str(spec["i"] - 1), time.monotonic() + 30
        while spec["i"] and not all((before / f"rank{r}.json").exists() for r in range(2)):
            assert time.monotonic() < deadline, f"spec {spec['i'] - 1} never finished on both ranks"
            time.sleep(0.01)
        if spec["fail"] and os.environ["RANK"] == "1":
            sys.exit("spec failed on purpose")
        return {"i": spec["i"], "pid": os.getpid(), "port": os.environ["MASTER_PORT"], "rank": os.environ.pop("RANK")}

    raise SystemExit(worker_main("each_worker", __doc__, lambda spec: spec, run))
    """
)


def test_run_each_runs_every_spec_in_one_launch_each_on_its_own_port(tmp_path, monkeypatch):
    """Launcher.run_each: the same processes run the specs in turn (one launch), spec i on its own MASTER_PORT with
    the environment the process started with; a failing spec keeps the results before it, the rest get the reason."""
    (tmp_path / "each_worker.py").write_text(EACH_WORKER)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{':'.join(sys.path)}")
    launcher = Launcher("test", tmp_path / "scratch", timeout=60)
    got = launcher.run_each("each_worker", [{"i": i, "fail": i == 2} for i in range(4)], 2, errors=300)
    assert launcher.count == 1 and [g.error for g in got[:2]] == [None, None] and [len(g.results) for g in got] == [2, 2, 0, 0]
    assert [[(r["i"], r["rank"]) for r in g.results] for g in got[:2]] == [[(i, "0"), (i, "1")] for i in range(2)]
    assert len({r["pid"] for g in got for r in g.results}) == 2 and len({g.results[0]["port"] for g in got[:2]}) == 2
    assert all(g.results[0]["port"] == g.results[1]["port"] for g in got[:2]) and launcher.run_each("each_worker", [], 2) == []
    assert got[2].error == got[3].error and got[2].error.endswith("spec failed on purpose")
    with pytest.raises(SystemExit) as exc:  # a list needs one port per spec
        worker_main("w", None, lambda s: s, lambda s, o: None, ["--spec", "[{}]", "--out-dir", str(tmp_path), "--ports", "1,2"])
    assert exc.value.code == 2


def test_every_run_records_the_cpu_it_ran_on_and_its_docs_line_names_it():
    """host_info()["cpu"]: the model name and widest vector extension from /proc/cpuinfo (the same seed can give other
    floats on another CPU); the docs' Run line names it, and an older file without it renders as before."""
    from pathlib import Path

    from lightning_pdist.bench.report import host_info, run_lines

    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = next(line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name"))
    host = host_info()
    assert host["cpu"].startswith(model)
    doc = {"command": "c", "created": "t", "suite_wall_s": 1.0, "host": host}
    assert f"on 2 CPUs ({host['cpu']}) (1-min" in run_lines(doc, "x.json")[1].replace(f"on {host['cpus']} CPUs", "on 2 CPUs")
    del host["cpu"]
    assert f"on {host['cpus']} CPUs (1-min" in run_lines(doc, "x.json")[1]
