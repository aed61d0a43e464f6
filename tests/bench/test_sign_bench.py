"""The sign benchmark suite: config validation, rows, summaries, the simulator against real ranks, tiny runs."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from _ranks import run_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_pdist.sign.simulator import SignSGDSimulator
from lightning_pdist.bench import SUITES
from lightning_pdist.bench.__main__ import main
from lightning_pdist.bench.sign import COMM_ROW_KEYS, REPRO_ROW_KEYS, SuiteConfig, docs_section, verdict_lines
from lightning_pdist.bench.sign_comm import add_speedups, build_comm_row, check_failures, comm_plan
from lightning_pdist.bench.sign_repro import (
    BATCH_MODES,
    curve_rows,
    make_model,
    sign_round_,
    summarize,
    worker_batch_sizes,
)
from lightning_pdist.bench.sign_worker import check_spec, powersgd_bytes
from lightning_pdist.core.accounting import all_reduce_bytes
from lightning_pdist.sign.hooks import (
    ITSignSGDState,
    SignSGDState,
    it_signsgd_hook,
    sign_hook_bytes,
    signsgd_mv_hook,
)

ROUNDS, WORKERS, IN, HIDDEN, LR = 6, 3, 12, 10, 0.01


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"parts": ("train",)}, r"sign\(--parts=\('train',\)\): each value must be one of"),
        ({"batch_modes": (5,)}, r"sign\(--batch-modes=\(5,\)\): each value must be one of \(1, 2, 3, 4\)"),
        ({"seeds": (0, 0)}, r"sign\(--seeds=\(0, 0\)\): values must not repeat"),
        ({"rounds": 0}, r"sign\(--rounds=0\): must be an int >= 1"),
        ({"eval_every": 500}, r"sign\(--eval-every=500\): must be <= --rounds \(200\)"),
        ({"num_workers": 14}, r"sign\(--num-workers=14\): must be an int >= 15"),
        ({"lr": 0.0}, r"sign\(--lr=0.0\): must be > 0"),
        ({"estimator": "layer"}, r"sign\(--estimator='layer'\): must be one of"),
        ({"datasets": ("mnist",)}, r"sign\(--datasets=\('mnist',\)\): mnist and cifar10 are read from local files"),
        ({"rates": ("fast",)}, r"sign\(--rates='fast'\): each rate must look like '100mbit'"),
        ({"world_sizes": (1,)}, r"sign\(--world-size=1\): world_size must be an int in \[2, 16\]"),
        ({"hooks": ("topk",)}, r"sign\(--hooks=\('topk',\)\): each value must be one of"),
        ({"warmup_steps": 2}, r"sign\(--warmup-steps=2\): must be >= 3 with powersgd"),
        ({"timeout": 0}, r"sign\(--timeout=0\): must be > 0 seconds"),
    ],
)
def test_config_rejects_bad_values_naming_option_value_and_rule(kwargs, match):
    """Every bad option raises ValueError with the option, the value and the rule."""
    with pytest.raises(ValueError, match=match):
        SuiteConfig(**kwargs)


def test_cli_answers_bad_values_with_exit_status_2(tmp_path, capsys):
    """The suite is registered; a bad value exits 2 with its message and writes nothing."""
    assert SUITES["sign"] == "lightning_pdist.bench.sign"
    assert main(["sign", "--quick", "--out", str(tmp_path / "o"), "--rounds", "-3"]) == 2
    assert "sign(--rounds=-3): must be an int >= 1" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_batch_modes_and_rows_follow_the_paper():
    """Modes 1-4 put 0, 9, 12, 14 of 15 workers at B=4; curve rows carry the required keys."""
    assert [worker_batch_sizes(15, BATCH_MODES[m], 4, 64).count(4) for m in (1, 2, 3, 4)] == [0, 9, 12, 14]
    with pytest.raises(ValueError, match=r"worker_batch_sizes\(small_workers=16\): small_workers must be in \[0, 15\]"):
        worker_batch_sizes(15, 16, 4, 64)
    rows = curve_rows("digits", "it_signsgd", 3, 7, [(0, 0.1), (10, 0.51234)])
    assert rows[1] == {"dataset": "digits", "method": "it_signsgd", "batch_mode": 3, "small_batch_workers": 12,
                       "seed": 7, "round": 10, "val_acc": 0.5123}  # fmt: skip
    assert all(k in rows[0] for k in REPRO_ROW_KEYS)
    with pytest.raises(ValueError, match=r"curve_rows\(batch_mode=5\): batch_mode must be one of \[1, 2, 3, 4\]"):
        curve_rows("digits", "it_signsgd", 5, 0, [])


def test_summary_gives_mean_std_and_paired_gain_of_the_final_round():
    """The summary takes each run's last round, mean ± std over seeds, and IT-signSGD's paired gain over MV."""
    rows = []
    for seed, (mv, it) in enumerate([(0.80, 0.82), (0.90, 0.91)]):
        rows += curve_rows("digits", "signsgd_mv", 4, seed, [(0, 0.1), (50, 0.5), (100, mv)])
        rows += curve_rows("digits", "it_signsgd", 4, seed, [(0, 0.1), (50, 0.6), (100, it)])
    summary = summarize(rows)
    it = next(s for s in summary if s["method"] == "it_signsgd")
    mv = next(s for s in summary if s["method"] == "signsgd_mv")
    assert mv["final_val_acc_mean"] == pytest.approx(0.85)
    assert mv["final_val_acc_std"] == pytest.approx(0.0707, abs=1e-4)
    assert it["gain_by_seed"] == [0.02, 0.01] and it["gain_vs_majority"] == pytest.approx(0.015)
    assert it["final_round"] == 100 and it["seeds"] == 2
    assert verdict_lines(summary) == ["- digits mode 4: IT-signSGD better in every seed (+0.0150 on average)"]


def _rank_result(rank, hook="fp32_allreduce", logged=1000, tx=1100, ms=50.0):
    return {"rank": rank, "world_size": 2, "hook": hook, "params": 4_000_000, "steps": 5, "ms_per_step": ms,
            "loop_s": ms * 5 / 1000, "loop_cpu_s": 0.2, "compute_ms_per_step": 30.0, "logged_bytes": logged * 5,
            "logged_by_kind": {"all_reduce": logged * 5}, "bytes_source": "accounting model", "tx_bytes": tx * 5,
            "tx_packets": 50}  # fmt: skip


def test_comm_rows_carry_bytes_kernel_ratio_and_speedup():
    """A row holds per-step logged and kernel bytes, their ratio, and the speedup against fp32 on the same network."""
    config = SuiteConfig(hooks=("fp32_allreduce", "signsgd_mv"), world_sizes=(2, 4))
    specs = comm_plan(config)
    assert [(s["world_size"], s["hook"]) for s in specs] == [(2, "fp32_allreduce"), (2, "signsgd_mv"),
                                                             (4, "fp32_allreduce"), (4, "signsgd_mv")]  # fmt: skip
    ranks = [_rank_result(r) for r in range(2)]
    fast = [_rank_result(r, "signsgd_mv", logged=30, tx=40, ms=10.0) for r in range(2)]
    rows = [build_comm_row(specs[0], ranks, "emulated", "100mbit", "d"),
            build_comm_row(specs[1], fast, "emulated", "100mbit", "d"),
            build_comm_row(specs[0], ranks, "loopback", None, "lo")]  # fmt: skip
    add_speedups(rows)
    assert all(k in row for row in rows for k in COMM_ROW_KEYS)
    assert rows[0]["bytes_per_rank_per_step"] == 1000 and rows[0]["kernel_tx_bytes_per_rank_per_step"] == 1100
    assert rows[0]["kernel_tx_ratio"] == 1.1 and rows[1]["speedup_vs_fp32"] == 5.0
    assert rows[2]["kernel_tx_bytes_per_rank_per_step"] is None and rows[2]["speedup_vs_fp32"] == 1.0
    assert check_failures(rows) == ["emulated 100mbit signsgd_mv n=2: kernel/logged 1.3333"]
    with pytest.raises(ValueError, match=r"build_comm_row\(network='emulated'\): every rank must report tx_bytes"):
        build_comm_row(specs[0], [dict(r, tx_bytes=None) for r in ranks], "emulated", "100mbit", "d")
    with pytest.raises(ValueError, match=r"sign_worker spec\(hook='topk'\): hook must be one of"):
        check_spec(dict(specs[0], hook="topk"))


def test_powersgd_byte_model_compresses_only_worthwhile_matrices():
    """P and Q of the big matrices travel; biases and small matrices go uncompressed, all in fp32 all-reduces."""
    got = powersgd_bytes([(4096, 1024), (4096,), (10, 4096), (10,), (3, 3)], world_size=2, rank=4)
    assert got == {"powersgd_uncompressed": 4 * (4096 + 10 + 9), "powersgd_p": 4 * 4 * (4096 + 10),
                   "powersgd_q": 4 * 4 * (1024 + 4096)}  # fmt: skip


def _batches(seed=0):
    g = torch.Generator().manual_seed(seed)
    sizes = [2, 5, 9]  # heterogeneous batches, as in the batch modes
    return [[(torch.randn(b, IN, generator=g), torch.randint(0, 10, (b,), generator=g)) for b in sizes]
            for _ in range(ROUNDS)]  # fmt: skip


def _ddp_rank(rank, world_size, batches, out_dir):
    torch.set_num_threads(1)
    out = {}
    for name, state, hook in (("signsgd_mv", SignSGDState(), signsgd_mv_hook),
                              ("it_signsgd", ITSignSGDState(warmup_rounds=2), it_signsgd_hook)):  # fmt: skip
        model = DDP(make_model(IN, HIDDEN, seed=3))
        model.register_comm_hook(state, hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        for round_batches in batches:
            x, y = round_batches[rank]
            optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        # numpy travels by value; a tensor would travel as a shared-memory handle that dies with this process
        out[name] = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    dist.barrier()
    torch.save(out, f"{out_dir}/ddp{rank}.pt")


def test_simulated_rounds_equal_three_real_ddp_ranks_with_the_hooks(tmp_path):
    """sign_round_ with the simulator gives bit-identical parameters to 3 gloo ranks running DDP with each hook."""
    batches = _batches()
    run_ranks(_ddp_rank, WORKERS, tmp_path, batches, str(tmp_path))
    results = [torch.load(tmp_path / f"ddp{r}.pt", weights_only=False) for r in range(WORKERS)]
    torch.set_num_threads(1)
    for name, sim in (("signsgd_mv", SignSGDSimulator(WORKERS)),
                      ("it_signsgd", SignSGDSimulator(WORKERS, "llr", warmup_rounds=2))):  # fmt: skip
        model = make_model(IN, HIDDEN, seed=3)
        initial = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        for round_batches in batches:
            vote = sign_round_(model, optimizer, sim, round_batches)
            assert set(vote.unique().tolist()) <= {-1.0, 1.0}
        simulated = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        assert not torch.equal(simulated, initial)
        for rank in range(WORKERS):
            assert torch.equal(torch.from_numpy(results[rank][name]), simulated), (name, rank)


def _worker_rank(rank, world_size, specs, out_dir):
    from lightning_pdist.bench.sign_worker import run

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world_size), GLOO_SOCKET_IFNAME="lo")
    results = []
    for i, spec in enumerate(specs):
        # One file rendezvous per spec: no TCP port to pick (free_port() + i once collided under load).
        os.environ["PDIST_INIT_METHOD"] = f"file://{out_dir}/rendezvous{i}"
        results.append(run(spec, out_dir / spec["hook"]))
    torch.save(results, out_dir / f"results{rank}.pt")


def test_comm_worker_logs_the_byte_models_on_two_real_ranks(tmp_path):
    """Two gloo ranks run every hook on a tiny MLP; logged bytes per step equal each hook's byte model."""
    config = SuiteConfig(world_sizes=(2,), steps=2, in_features=16, comm_hidden=32, powersgd_rank=1)
    specs = comm_plan(config)
    run_ranks(_worker_rank, 2, tmp_path, specs, tmp_path, timeout=240, group=False)  # 8 s alone; generous under load
    results = {r: torch.load(tmp_path / f"results{r}.pt", weights_only=False) for r in range(2)}
    by_hook = {spec["hook"]: build_comm_row(spec, [results[0][i], results[1][i]], "loopback", None, "lo")
               for i, spec in enumerate(specs)}  # fmt: skip
    params = 16 * 32 + 32 + 32 * 10 + 10
    assert by_hook["fp32_allreduce"]["params"] == params
    assert by_hook["fp32_allreduce"]["bytes_per_rank_per_step"] == all_reduce_bytes(4 * params, 2)
    assert by_hook["fp16_compress"]["bytes_per_rank_per_step"] == all_reduce_bytes(2 * params, 2)
    shapes = [(32, 16), (32,), (10, 32), (10,)]
    assert by_hook["powersgd"]["bytes_per_rank_per_step"] == sum(powersgd_bytes(shapes, 2, 1).values())
    for hook, estimator in (("signsgd_mv", None), ("it_signsgd", "worker")):
        expected = sum(sign_hook_bytes(params, 2, 4, estimator=estimator).values())
        assert by_hook[hook]["bytes_per_rank_per_step"] == expected
    assert [r["rank"] for r in results[1]] == [1] * len(specs)  # (worker_main writes it to rank1.json: test_harness)


def test_tiny_end_to_end_repro_run_writes_json_plot_and_docs(tmp_path, capsys):
    """A tiny Part A through the CLI writes sign.json (rows, summary, diagnosis), sign.png and docs_section.md."""
    out = tmp_path / "run"
    argv = ["sign", "--quick", "--out", str(out), "--parts", "repro", "--batch-modes", "1", "4", "--seeds", "0",
            "--rounds", "4", "--eval-every", "2", "--hidden", "16"]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads((out / "sign.json").read_text())
    repro = doc["repro"]
    assert {(r["method"], r["batch_mode"], r["round"]) for r in repro["rows"]} == {
        (m, mode, t) for m in ("signsgd_mv", "it_signsgd") for mode in (1, 4) for t in (0, 2, 4)
    }
    assert len(repro["summary"]) == 4 and repro["diagnosis"][0]["batch_mode"] == 4
    assert set(repro["diagnosis"][0]["by_batch_size"]) == {"B=4", "B=64"}
    assert (out / "sign.png").stat().st_size > 0
    section = (out / "docs_section.md").read_text()
    assert section == docs_section(doc, str(out / "sign.json")) + "\n"
    assert "Command: `python -m lightning_pdist.bench sign --quick" in section and "digits mode 4" in section


def test_repro_reads_mnist_from_a_data_dir(tmp_path):
    """--data-dir with MNIST files adds an mnist Part A: 784 features, 10 classes, rows for both methods."""
    from _helpers import write_mnist

    from lightning_pdist.bench.sign_repro import load_data

    write_mnist(tmp_path / "mnist", n_train=120, n_test=30)
    data = load_data("mnist", tmp_path / "mnist")
    assert data.train_x.shape[1] == 784 and len(data.train_x) + len(data.val_x) == 120
    out = tmp_path / "run"
    argv = ["sign", "--quick", "--out", str(out), "--parts", "repro", "--datasets", "mnist", "--data-dir",
            str(tmp_path / "mnist"), "--batch-modes", "4", "--seeds", "0", "--rounds", "2", "--eval-every", "2",
            "--hidden", "8", "--small-batch", "2", "--large-batch", "4"]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads((out / "sign.json").read_text())["repro"]["rows"]
    assert {(r["dataset"], r["method"], r["round"]) for r in rows} == {("mnist", m, t) for m in ("signsgd_mv", "it_signsgd") for t in (0, 2)}
