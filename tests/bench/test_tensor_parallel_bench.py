"""The tensor-parallel suite: option rules, its plan and byte model per run, row arithmetic, and tiny real runs."""

import json

import pytest

from lightning_pdist.tensor_parallel.cost import Crossover, StepBytes
from lightning_pdist.bench import SUITES
from lightning_pdist.bench.__main__ import main as bench_main
from lightning_pdist.bench.netns import EmulatedNetwork
from lightning_pdist.bench.report import check_rows, markdown_table
from lightning_pdist.bench.tensor_parallel import (
    FULL,
    PAPER,
    QUICK,
    ROW_KEYS,
    Runner,
    SuiteConfig,
    build_row,
    crossover,
    ROW_COLUMNS,
    kernel_check,
    model_facts,
    paper_scale,
    plan_runs,
    ratio_columns,
    ratios,
    step_bytes,
    where_wins,
)
from lightning_pdist.tensor_parallel.cost import sp_encoder_bytes
from lightning_pdist.tensor_parallel.cost import StepBytes
from lightning_pdist.bench.tp_worker import check_spec, loader_batch

_OK, _REASON = EmulatedNetwork.available()
TINY = ["--world-sizes", "2", "--models", "bert", "--hidden-size", "64", "--num-heads", "2", "--intermediate-size", "128",
        "--num-layers", "2", "--vocab-size", "300", "--seq-len", "32", "--reviews-per-class", "20", "--warmup-steps", "1",
        "--steps", "2", "--repeats", "1"]  # fmt: skip  (one run of the plan: repeats are tested without launches below)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"networks": ("wan",)}, r"tensor_parallel\(--network=\('wan',\)\): each value must be one of"),
        ({"models": ("gpt",)}, r"tensor_parallel\(--models=\('gpt',\)\): each value must be one of"),
        ({"configs": ("tp", "tp")}, r"--configs=\('tp', 'tp'\)\): give at least one value, none repeated"),
        ({"world_sizes": (3,)}, r"tensor_parallel\(--world-sizes=\(3,\)\): each value must be one of \(2, 4\)"),
        ({"rates": ("fast",)}, r"tensor_parallel\(--rates='fast'\): each rate must look like '100mbit'"),
        ({"hidden_size": 100, "num_heads": 8}, r"tensor_parallel\(--hidden-size=100\): must be a multiple of --num-heads \(8\)"),
        ({"hidden_size": 96, "num_heads": 3}, r"tensor_parallel\(--num-heads=3\): must be divisible by the tensor-parallel degree 2"),
        ({"intermediate_size": 1023}, r"--intermediate-size=1023\): must be divisible by the tensor-parallel degree 2"),
        ({"world_sizes": (2, 4), "global_batch": 6}, r"--global-batch=6\): must be a multiple of the largest world size \(4\)"),
        ({"vgg_width": 0.0001}, r"tensor_parallel\(--vgg-width=0.0001\): must be in \(0, 1\] with round\(4096 \* width\)"),
        ({"vgg_width": 0.00075}, r"--vgg-width=0.00075\): .* a positive multiple of 2"),
        ({"reviews_per_class": 2}, r"--reviews-per-class=2\): too few: the run needs 32 training reviews"),
        ({"steps": 0}, r"tensor_parallel\(--steps=0\): must be an int >= 1"),
        ({"repeats": 0}, r"tensor_parallel\(--repeats=0\): must be an int >= 1"),
        ({"lr": 0.0}, r"tensor_parallel\(--lr=0.0\): must be > 0"),
        ({"seed": -1}, r"tensor_parallel\(--seed=-1\): must be an int >= 0"),
        ({"seq_len": 63}, r"tensor_parallel\(--seq-len=63\): must be divisible by the tensor-parallel degree 2 under tp_sp"),
    ],
)
def test_config_rejects_bad_values_naming_option_value_and_rule(kwargs, match):
    """Every bad option raises ValueError with the option, the value and the rule."""
    with pytest.raises(ValueError, match=match):
        SuiteConfig(**kwargs)


def test_cli_answers_bad_values_with_exit_status_2(tmp_path, capsys):
    """The suite is registered; a bad value exits 2 with its message and writes nothing."""
    assert SUITES["tensor_parallel"] == "lightning_pdist.bench.tensor_parallel"
    assert bench_main(["tensor_parallel", "--quick", "--out", str(tmp_path / "o"), "--world-sizes", "2", "3"]) == 2
    assert "tensor_parallel(--world-sizes=(2, 3)): each value must be one of (2, 4)" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_plan_runs_quick_and_full():
    """Quick: 2 ranks, DP/TP/TP+SP/DeepSpeed per encoder, DP/hybrid on VGG; full adds DP and DP×TP (2 x 2) on 4
    ranks; the demo Transformer (asked for) runs the encoders' 2-rank configurations only; an odd sequence is fine
    without tp_sp."""
    quick = [(r["model"], r["config"], r["world_size"], r["tp_size"]) for r in plan_runs(SuiteConfig())]
    assert quick == [("bert", "dp", 2, 1), ("bert", "tp", 2, 2), ("bert", "tp_sp", 2, 2), ("bert", "deepspeed_tp", 2, 2),
                     ("albert", "dp", 2, 1), ("albert", "tp", 2, 2), ("albert", "tp_sp", 2, 2),
                     ("albert", "deepspeed_tp", 2, 2), ("vgg", "dp", 2, 1), ("vgg", "hybrid", 2, 2)]  # fmt: skip
    demo = plan_runs(SuiteConfig(models=("transformer",), world_sizes=(2, 4)))
    assert [(r["config"], r["world_size"]) for r in demo] == [("dp", 2), ("tp", 2), ("tp_sp", 2), ("deepspeed_tp", 2)]
    assert SuiteConfig(seq_len=63, configs=("dp", "tp")).seq_len == 63
    full = plan_runs(SuiteConfig(world_sizes=FULL["world_sizes"], configs=("dp", "dp_tp"), models=("bert",)))
    assert [(r["config"], r["world_size"], r["tp_size"]) for r in full] == [("dp", 2, 1), ("dp", 4, 1), ("dp_tp", 4, 2)]
    assert QUICK["world_sizes"] == (2,) and QUICK["rates"] == ("100mbit",) and len(FULL["rates"]) >= 2


def _spec(**over):
    spec = {"config": "tp", "model": "bert", "world_size": 2, "tp_size": 2, "global_batch": 8, "seq_len": 16, "model_kwargs": {},
            "vgg_width": 0.125, "warmup_steps": 1, "steps": 1, "seed": 0, "lr": 0.1, "data_dir": "d"}  # fmt: skip
    return {**spec, **over}


def test_worker_spec_is_checked_and_splits_the_global_batch():
    """Worker specs refuse wrong pairings and sizes; each rank's loader batch is the global batch over its replicas."""
    assert check_spec(_spec()) == _spec()
    assert loader_batch(_spec()) == 8  # the TP group shares one batch
    assert loader_batch(_spec(config="dp", tp_size=1)) == 4
    assert loader_batch(_spec(config="dp_tp", world_size=4, tp_size=2)) == 4  # two replicas of a 2-rank TP group
    assert loader_batch(_spec(config="hybrid", model="vgg", global_batch=16)) == 8
    assert check_spec(_spec(config="tp_sp", model="transformer"))["config"] == "tp_sp"
    with pytest.raises(ValueError, match=r"config='hybrid'\): model 'bert' runs one of \('dp', 'tp', 'tp_sp', 'dp_tp'\)"):
        check_spec(_spec(config="hybrid"))
    with pytest.raises(ValueError, match=r"tp_size=1\): config 'tp' on world_size=2 ranks has tp_size=2"):
        check_spec(_spec(tp_size=1))
    with pytest.raises(ValueError, match=r"tp_size=4\): dp_tp needs 1 < tp_size < world_size \(4\)"):
        check_spec(_spec(config="dp_tp", world_size=4, tp_size=4))
    with pytest.raises(ValueError, match=r"global_batch=6\): global_batch must be a multiple of world_size \(4\)"):
        check_spec(_spec(config="dp", world_size=4, tp_size=1, global_batch=6))
    with pytest.raises(ValueError, match=r"missing keys \['lr'\]"):
        check_spec({k: v for k, v in _spec().items() if k != "lr"})


FACTS = {"params": 1000, "params_local_tp2": 600, "seq_len": 4, "hidden_size": 8, "num_layers": 2, "global_batch": 8}
VGG = {"params": 5000, "conv_params": 100, "fc_in": 10, "fc_hidden": 6, "num_classes": 5, "global_batch": 6}


def test_step_bytes_of_every_configuration_by_hand():
    """DP all-reduces the model; TP 8 activations of B*L*H floats (DeepSpeed 12: q, k, v one backward all-reduce
    each); DP×TP adds the shard's; hybrid as the cost model."""
    assert step_bytes({"config": "dp", "world_size": 2, "tp_size": 1}, FACTS) == StepBytes(dp_all_reduce=4000)
    one = 8 * 4 * 8 * 4  # B*L*H fp32 = 1024 bytes, sent once by a 2-rank ring all-reduce
    assert step_bytes({"config": "tp", "world_size": 2, "tp_size": 2}, FACTS) == StepBytes(tp_all_reduce=8 * one)
    assert step_bytes({"config": "deepspeed_tp", "world_size": 2, "tp_size": 2}, FACTS).total == 12 * one
    # 2 x 2: each replica runs half the global batch; the 600-parameter shard is all-reduced over 2 replicas
    assert step_bytes({"config": "dp_tp", "world_size": 4, "tp_size": 2}, FACTS) == StepBytes(dp_all_reduce=2400,
                                                                                                tp_all_reduce=4 * one)  # fmt: skip
    got = step_bytes({"config": "hybrid", "world_size": 2, "tp_size": 2}, VGG)
    assert got == StepBytes(dp_all_reduce=400, tp_all_gather=3 * 10 * 4 + 3 * 5 * 4, tp_all_reduce=6 * 6 * 4 + 6 * 10 * 4)


def test_sequence_parallel_bytes_by_hand_and_where_there_is_no_model():
    """tp_sp on 2 ranks (gloo): per layer 4 all-gathers of half an activation and 4 reduce-scatters (gloo: all-reduces
    of the whole one), 2 more all-gathers at the stack's edges, one all-reduce of the partial gradients; no model
    (None) for the demo Transformer's TP rows or a model the strategy refuses, DP's for its DP row."""
    one = 8 * 4 * 8 * 4  # B*L*H fp32
    sp = step_bytes({"model": "bert", "config": "tp_sp", "world_size": 2, "tp_size": 2}, {**FACTS, "sp_partial": 48})
    assert sp == StepBytes(tp_all_gather=(4 * 2 + 2) * one // 2, tp_reduce_scatter=4 * 2 * one, tp_all_reduce=48 * 4)
    assert sp.by_kind() == {"tp_all_gather": 5120, "tp_reduce_scatter": 8192, "tp_all_reduce": 192}
    nccl = sp_encoder_bytes(8, 4, 8, 2, 2, 48, gloo=False)  # a real reduce-scatter sends half of the all-reduce
    assert nccl.tp_reduce_scatter == sp.tp_reduce_scatter // 2 and nccl.tp_all_gather == sp.tp_all_gather
    four = sp_encoder_bytes(8, 4, 8, 1, 4, 0)  # t=4: AG sends 3 chunks of n/4, RS (gloo) 2*3/4 n
    assert (four.tp_all_gather, four.tp_reduce_scatter, four.tp_all_reduce) == (6 * 3 * one // 4, 4 * 6 * one // 4, 0)
    with pytest.raises(ValueError, match=r"sp_encoder_bytes\(seq_len=5\): seq_len must be divisible by tp_size=2"):
        sp_encoder_bytes(8, 5, 8, 2, 2, 0)
    refused = {**FACTS, "sp_partial": None}
    assert step_bytes({"model": "albert", "config": "tp_sp", "world_size": 2, "tp_size": 2}, refused) is None
    assert step_bytes({"model": "transformer", "config": "tp", "world_size": 2, "tp_size": 2}, FACTS) is None
    assert step_bytes({"model": "transformer", "config": "dp", "world_size": 2, "tp_size": 1}, FACTS).total == 4000


def test_model_facts_name_the_partial_gradients_or_the_strategys_refusal():
    """BERT: 2 LayerNorms (2H each) and 2 row-wise biases (H) per layer are summed per step; ALBERT: the same for its
    one shared block, counted once; a module the strategy refuses gives its refusal (a tp_sp row fails with it); the
    demo Transformer: parameters, its keywords."""
    import torch
    from torch import nn

    from lightning_pdist.tensor_parallel.cost import partial_params
    from lightning_pdist.tensor_parallel.plan import plan_for

    config = SuiteConfig(models=("bert", "albert", "transformer"), hidden_size=64, num_heads=2, intermediate_size=128,
                         num_layers=2, vocab_size=300, seq_len=32, reviews_per_class=20)  # fmt: skip
    facts = model_facts(config)
    assert facts["bert"]["sp_partial"] == 6 * 64 * 2 and facts["bert"]["sp_refusal"] is None
    assert facts["albert"]["sp_partial"] == 6 * 64 and facts["albert"]["sp_refusal"] is None
    assert facts["transformer"]["nlayers"] == 1 and facts["transformer"]["params"] > 0
    with torch.device("meta"):
        mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))  # sharded, but no encoder stack to cover
    assert "sequence_parallel=True" in partial_params(mlp, plan_for(mlp))


def _rank(rank, window=1.0, meter=16384, tx=None):
    return {"rank": rank, "window_s": window, "cpu_s": window / 2, "step_s": [window / 2] * 2, "meter_bytes": meter, "meter_by_kind":
            {"tp_all_reduce": meter}, "tx_bytes": tx, "params_local": 600, "losses": [0.7, 0.6]}  # fmt: skip


def test_rows_ratios_and_kernel_check_come_from_the_ranks():
    """A row takes the slowest rank's window per step and the mean bytes; errors give no figure; ratios use DP's row."""
    ranks = [_rank(0, 1.0, tx=25000 * 2), _rank(1, 1.2, tx=26000 * 2)]
    tp = build_row({"model": "bert", "config": "tp", "world_size": 2, "tp_size": 2}, ranks, FACTS, 2, "emulated 100mbit", None)
    assert tp["cpu_per_step_s"] == 0.3  # the busiest rank's CPU time over the 2 steps
    assert tp["step_s"] == 0.6 and tp["meter_bytes_per_step"] == 8192 == tp["model_bytes_per_step"] and tp["meter_over_model"] == 1.0
    assert tp["kernel_tx_bytes_per_step"] == 25500 and tp["kernel_over_model"] == round(25500 / 8192, 4) and tp["rate"] == "100mbit"
    dp = build_row({"model": "bert", "config": "dp", "world_size": 2, "tp_size": 1}, [_rank(0, 0.6, 8000), _rank(1, 0.6, 8000)],
                   FACTS, 2, "emulated 100mbit", None)  # fmt: skip
    failed = build_row({"model": "bert", "config": "deepspeed_tp", "world_size": 2, "tp_size": 2}, [], FACTS, 2, "emulated 100mbit",
                       "launch_ranks: rank 1 exited with code 1")  # fmt: skip
    assert failed["step_s"] is None and failed["error"].startswith("launch_ranks")
    check_rows([tp, dp, failed], ROW_KEYS, "test")
    (ratio,) = ratios([tp, dp, failed])
    assert (ratio["config"], ratio["ratio"], ratio["paper_ratio"]) == ("tp", 2.0, PAPER["bert"]["ratio"])
    assert ratio["bytes_ratio"] == round(8192 / 4000, 3)
    check = kernel_check([tp, dp, failed])
    assert check["rows"] == 1 and check["within"] == 0 and check["worst"]["config"] == "tp"


def test_ratios_over_deepspeed_and_the_column_only_where_the_document_has_it():
    """Each TP-like row's time over DeepSpeed AutoTP's on the same network, model and ranks; None for DeepSpeed's own
    row and where DeepSpeed has no timed row; a row without a byte model has no bytes ratio; the table shows the
    column when the document's ratios carry it (older documents render as before)."""
    def row(config, step_s, nbytes=1000, model="bert", network="loopback"):
        return {"network": network, "model": model, "config": config, "world_size": 2, "step_s": step_s,
                "model_bytes_per_step": nbytes}  # fmt: skip

    rows = [row("dp", 0.1, 4000), row("tp", 0.12), row("tp_sp", 0.15), row("deepspeed_tp", 0.2),
            row("dp", 0.1, 4000, "transformer"), row("tp", 0.3, None, "transformer"), row("deepspeed_tp", None, None, "transformer")]  # fmt: skip
    got = {(r["model"], r["config"]): r for r in ratios(rows)}
    assert got["bert", "tp"]["deepspeed_ratio"] == 0.6 and got["bert", "tp_sp"]["deepspeed_ratio"] == 0.75
    assert got["bert", "deepspeed_tp"]["deepspeed_ratio"] is None and got["bert", "tp"]["bytes_ratio"] == 0.25
    assert got["transformer", "tp"]["deepspeed_ratio"] is None and got["transformer", "tp"]["bytes_ratio"] is None
    headers = [c[0] for c in ratio_columns(list(got.values()))]
    assert headers[headers.index("time ÷ DP") + 1] == "time ÷ DeepSpeed"
    old = [{k: v for k, v in r.items() if k != "deepspeed_ratio"} for r in got.values()]
    assert "time ÷ DeepSpeed" not in [c[0] for c in ratio_columns(old)]
    failed = {**row("tp_sp", None, None, "albert"), "error": "rank 0 failed: | ValueError: refused"}  # a stderr tail
    assert "rank 0 failed: \\| ValueError: refused" in markdown_table([failed], ROW_COLUMNS)  # one cell, not two


def test_crossover_from_loopback_compute_and_modelled_bytes():
    """TP computes more and sends less: it wins below (b_dp - b_tp) / (c_tp - c_dp), and the batch crossover follows."""
    def row(config, network, step_s, nbytes):
        return {"model": "bert", "config": config, "world_size": 2, "network": network, "step_s": step_s,
                "model_bytes_per_step": nbytes}  # fmt: skip

    rows = [row("dp", "loopback", 0.1, 20_000_000), row("tp", "loopback", 0.2, 10_000_000),
            row("dp", "emulated 100mbit", 1.7, 20_000_000), row("tp", "emulated 100mbit", 1.1, 10_000_000)]  # fmt: skip
    config = SuiteConfig(models=("bert",), global_batch=8, seq_len=64, hidden_size=256, num_layers=4)
    nets = {"loopback": {}, "emulated 100mbit": {"measured_tcp_goodput_bytes_per_s": 12_000_000}}
    (c,) = crossover(rows, nets, config)
    assert c["bandwidth_bytes_per_s"] == pytest.approx(1e8) and c["tp_wins"] == "at bandwidth < 800.0 Mbit/s"
    assert c["compute_source"] == "loopback step_s"  # no CPU time in these rows
    rows[0]["cpu_per_step_s"], rows[1]["cpu_per_step_s"] = 0.05, 0.15  # where both have it, CPU time is the compute
    (cpu,) = crossover(rows, nets, config)
    assert cpu["compute_source"] == "loopback cpu_per_step_s" and cpu["bandwidth_bytes_per_s"] == pytest.approx(1e8)
    (rate,) = c["rates"]
    assert rate["predicted_dp_s"] == pytest.approx(0.1 + 20 / 12, abs=1e-4)
    assert rate["measured_ratio"] == round(1.1 / 1.7, 3)
    assert rate["tp_wins_batch"].startswith("at global batch < ")  # TP's bytes grow with the batch, DP's do not


def test_repeats_run_the_whole_plan_again_and_keep_each_runs_fastest(tmp_path):
    """With repeats=2 the plan runs twice in order (not each run twice back to back); a row keeps its fastest repeat."""
    runner = Runner(SuiteConfig(repeats=2, reviews_per_class=20, global_batch=4, steps=1), tmp_path, {}, lambda line: None)
    order, times = [], iter([0.5, None, 0.3, 0.2])
    runner.launch = lambda run, network, net: order.append(run["config"]) or {"config": run["config"], "step_s": next(times)}
    rows = runner.launch_all([{"config": "dp"}, {"config": "tp"}], "loopback", None)
    assert order == ["dp", "tp", "dp", "tp"]
    assert [(r["config"], r["step_s"], r["step_s_repeats"], r["repeats"]) for r in rows] == [
        ("dp", 0.3, [0.5, 0.3], 2), ("tp", 0.2, [None, 0.2], 2)]  # a failed repeat never wins


def test_where_wins_names_every_span():
    """Crossings become spans in words: below the first, between two, from the last; none means everywhere or nowhere."""
    band = [Crossover(44.0, "tp", "dp"), Crossover(1280.0, "dp", "tp")]
    assert where_wins(band, "tp", "hidden size") == "at hidden size < 44 or >= 1280"
    assert where_wins(band, "dp", "hidden size") == "at hidden size 44 to 1280"
    assert where_wins([Crossover(1e8, "tp", "dp")], "tp", "bandwidth") == "at bandwidth < 800.0 Mbit/s"
    assert where_wins([Crossover(None, "dp", "dp")], "tp", "global batch") == "nowhere"
    assert where_wins([Crossover(None, "tp", "tp")], "tp", "global batch") == "everywhere"


def test_paper_scale_by_hand():
    """BERT-base (109,483,778 parameters) on 6 ranks: DP sends 2*5/6 of its 4-byte gradients; TP 72 all-reduces a token."""
    got = paper_scale()
    bert, albert = got["bert"], got["albert"]
    assert bert["params"] == 109_483_778 and bert["dp_bytes_per_step"] == 2 * 5 * 4 * 109_483_778 // 6
    assert bert["tp_bytes_per_token"] == albert["tp_bytes_per_token"] == 12 * 6 * (2 * 5 * 4 * 768 // 6)
    assert bert["equal_bytes_tokens_per_step"] == round(bert["dp_bytes_per_step"] / bert["tp_bytes_per_token"])
    assert albert["tp_over_dp_bytes"]["8x128"] > 1 > bert["tp_over_dp_bytes"]["8x128"]  # ALBERT's DP sends 1/9 of BERT's


@pytest.mark.standalone
def test_tiny_real_run_on_loopback(tmp_path):
    """DP and TP on 2 real ranks: the meters equal the byte model exactly; JSON, plot and docs section written."""
    out = tmp_path / "out"
    assert bench_main(["tensor_parallel", "--out", str(out), "--network", "loopback", "--configs", "dp", "tp", "tp_sp",
                       *TINY]) == 0  # fmt: skip
    doc = json.loads((out / "tensor_parallel.json").read_text())
    check_rows(doc["rows"], ROW_KEYS, "test")
    assert [(r["config"], r["error"]) for r in doc["rows"]] == [("dp", None), ("tp", None), ("tp_sp", None)]
    for row in doc["rows"]:
        assert row["meter_bytes_per_step"] == row["model_bytes_per_step"] and row["step_s"] > 0
    assert doc["rows"][1]["model_by_kind"] == {"tp_all_reduce": 8 * 8 * 32 * 64 * 4}  # 4 all-reduces x 2 layers
    one = 8 * 32 * 64 * 4  # tp_sp: the sequence-parallel model, kind by kind, equals the strategy's meter
    assert doc["rows"][2]["model_by_kind"] == doc["rows"][2]["meter_by_kind_per_step"] == {
        "tp_all_gather": 10 * one // 2, "tp_reduce_scatter": 8 * one, "tp_all_reduce": 6 * 64 * 2 * 4}
    assert [r["config"] for r in doc["ratios"]] == ["tp", "tp_sp"] and "time ÷ DeepSpeed" in (out / "docs_section.md").read_text()
    assert doc["ratios"][0]["paper_ratio"] == 0.705 and doc["crossover"][0]["engine"] == "tp"
    assert (out / "tensor_parallel.png").stat().st_size > 10_000 and "Crossover" in (out / "docs_section.md").read_text()


@pytest.mark.standalone
@pytest.mark.skipif(not _OK, reason=_REASON)
def test_tiny_real_tp_run_on_emulated_links_matches_the_kernel(tmp_path):
    """On an emulated 1gbit link the veths' tx_bytes over the timed steps agree with the byte model within 10%."""
    out = tmp_path / "out"
    assert bench_main(["tensor_parallel", "--out", str(out), "--network", "emulated", "--rates", "1gbit", "--configs", "tp", *TINY]) == 0
    (row,) = json.loads((out / "tensor_parallel.json").read_text())["rows"]
    assert row["network"] == "emulated 1gbit" and row["error"] is None
    assert abs(row["kernel_over_model"] - 1) <= 0.10
