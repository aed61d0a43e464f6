"""DeepSpeed AutoTP baseline: argument rules, and two real gloo ranks that shard BERT and match one process."""

import json
import sys

import pytest
import torch.distributed as dist

from lightning_pdist.bench.launch import read_results, worker_env
from lightning_pdist.bench.netns import LOOPBACK, launch_ranks
from lightning_pdist.bench.tp_deepspeed import reference_losses, run_rank

TINY = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "intermediate_size": 64, "max_len": 16, "vocab_size": 100,
        "dropout": 0.0}  # fmt: skip
ARGS = dict(family="bert", model_kwargs=TINY, batch_size=4, seq_len=16, steps=3, warmup_steps=0, tp_size=2, seed=0)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"steps": 0}, r"run_rank\(steps=0\): steps must be an int >= 1"),
        ({"warmup_steps": -1}, r"run_rank\(warmup_steps=-1\): warmup_steps must be an int >= 0"),
        ({"seq_len": 17}, r"run_rank\(seq_len=17\): seq_len must be <= the model's max_len \(16\)"),
        ({"tp_size": 3}, r"run_rank\(tp_size=3\): tp_size must divide the model's num_heads \(4\)"),
        ({"tp_size": 4}, r"run_rank\(tp_size=4\): tp_size must divide WORLD_SIZE \(2\)"),
        ({"family": "gpt"}, r"run_rank\(family='gpt'\): family must be one of \('bert', 'albert', 'transformer'\)"),
        ({"zero_stage": 3}, r"run_rank\(zero_stage=3\): zero_stage must be one of \(0, 1, 2\)"),
        ({"optimizer": "lamb"}, r"run_rank\(optimizer='lamb'\): optimizer must be one of \('sgd', 'adam'\)"),
        ({"lr": 0.0}, r"run_rank\(lr=0.0\): lr must be > 0"),
        ({"gradient_clipping": -1.0}, r"run_rank\(gradient_clipping=-1.0\): gradient_clipping must be >= 0"),
    ],
)
def test_bad_arguments_raise_naming_argument_value_and_rule(monkeypatch, change, match):
    """Every bad argument raises ValueError with the argument, the value and the rule, before any process group."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=match):
        run_rank(**{**ARGS, **change})
    assert not dist.is_initialized()


def test_refuses_to_run_beside_an_existing_process_group(monkeypatch, tmp_path):
    """run_rank makes its own process group once per process: an existing one is a RuntimeError."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    with pytest.raises(RuntimeError, match=r"run_rank: a process group already exists"):
        run_rank(**ARGS)


def test_two_gloo_ranks_shard_bert_and_reproduce_the_one_process_losses(tmp_path, master_port):
    """AutoTP on 2 gloo ranks halves BERT's attention/FFN weights per rank and gives the one-process losses."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    spec = {"family": "bert", "model_kwargs": TINY, "batch_size": 4, "seq_len": 16, "steps": 3, "warmup_steps": 0,
            "tp_size": None, "seed": 0}  # fmt: skip
    argv = [sys.executable, "-m", "lightning_pdist.bench.tp_deepspeed", "--spec", json.dumps(spec), "--out-dir", str(tmp_path)]
    # A file rendezvous: no port is listened on, so none can collide (MASTER_PORT is set but unused).
    env = {**worker_env(), "PDIST_INIT_METHOD": f"file://{tmp_path}/rendezvous"}
    launch_ranks(LOOPBACK, argv, 2, master_port, env=env, timeout=120)
    ranks = read_results(tmp_path, "rank", 2, "test_tp_deepspeed")
    expected = reference_losses("bert", TINY, 4, 16, 3, 0, 0)
    query = "encoder.bert.encoder.layer.0.attention.self.query.weight"
    for r, result in enumerate(ranks):
        assert (result["rank"], result["tp_rank"], result["tp_size"], result["dp_size"]) == (r, r, 2, 1)
        assert result["sharded"][query] == [[16, 32], [32, 32]]
        assert result["params_local"] < result["params_full"] == 22050
        assert result["losses"] == pytest.approx(expected, abs=1e-4)
        assert len(result["step_s"]) == 3 and result["tx_bytes"] is None  # loopback: no link counters
        assert result["config"]["tensor_parallel"] == {"autotp_size": 2}
    assert ranks[0]["losses"] == ranks[1]["losses"]
