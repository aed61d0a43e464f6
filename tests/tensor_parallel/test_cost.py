"""Tier 1: the DP / TP / DP×TP / hybrid byte model and the time model, against sums worked out by hand here."""

import json

import pytest
import torch
from lightning.pytorch import Callback
from torch import nn

from lightning_pdist.tensor_parallel.cost import (
    Crossover,
    StepBytes,
    crossover_bandwidth,
    dp_bytes,
    dp_tp_bytes,
    encoder_flops,
    find_crossovers,
    hybrid_vgg_bytes,
    partial_params,
    ring_all_gather_bytes,
    ring_all_reduce_bytes,
    sp_encoder_bytes,
    step_time,
    tp_encoder_bytes,
    tp_local_numel,
)
from lightning_pdist.core.accounting import all_gather_bytes, all_reduce_bytes


@pytest.mark.parametrize("nbytes", [0, 4, 1000, 4 * 12345])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 6])
def test_ring_formulas_equal_the_meters(nbytes, world):
    """The algorithms layer's copies of the ring formulas give exactly what comm.accounting counts."""
    assert ring_all_reduce_bytes(nbytes, world) == all_reduce_bytes(nbytes, world)
    assert ring_all_gather_bytes(nbytes, world) == all_gather_bytes(nbytes, world)


def test_dp_bytes_by_hand():
    """DP: 1,000 fp32 parameters on 2 ranks send 4,000 bytes; on 4 ranks 1.5 x 4,000; on one rank nothing."""
    assert dp_bytes(1000, 2) == StepBytes(dp_all_reduce=4000)
    assert dp_bytes(1000, 4).dp_all_reduce == 6000
    assert dp_bytes(1000, 1).total == 0
    assert dp_bytes(1000, 6, bytes_per_element=2).dp_all_reduce == 2 * 5 * 2000 // 6


def test_tp_encoder_bytes_by_hand():
    """TP: 2 layers x (2 forward + 2 backward: q/k/v's shared input, FFN in) all-reduces of B*L*H floats; t=2 sends
    each tensor once. With q, k and v reducing their input gradients separately (DeepSpeed): 4 backward."""
    # B=2, L=4, H=8: one activation is 64 floats = 256 bytes; a 2-rank ring all-reduce sends 256 bytes.
    got = tp_encoder_bytes(batch_size=2, seq_len=4, hidden_size=8, num_layers=2, tp_size=2)
    assert got == StepBytes(tp_all_reduce=8 * 256)
    assert got.by_kind() == {"tp_all_reduce": 2048}
    assert tp_encoder_bytes(2, 4, 8, 2, 2, fused_qkv=False) == StepBytes(tp_all_reduce=12 * 256)
    # t=4: each all-reduce sends 2*3/4 of 256 = 384 bytes
    assert tp_encoder_bytes(2, 4, 8, 2, 4).tp_all_reduce == 8 * 384
    assert tp_encoder_bytes(2, 4, 8, 2, 1).total == 0
    # Qwen3's per-head norms (2 layers x q_norm, k_norm of head_dim 4): 16 floats summed once per step, t=2
    assert tp_encoder_bytes(2, 4, 8, 2, 2, partial_params=16) == StepBytes(tp_all_reduce=8 * 256 + 64)
    with pytest.raises(ValueError, match=r"partial_params=-1\): partial_params must be an int >= 0"):
        tp_encoder_bytes(2, 4, 8, 2, 2, partial_params=-1)


def test_dp_tp_adds_the_shard_all_reduce():
    """DP×TP on 2x2: the shard's 2-rank all-reduce (4 bytes per parameter) plus the TP traffic of one replica."""
    got = dp_tp_bytes(local_params=500, batch_size=2, seq_len=4, hidden_size=8, num_layers=2, dp_size=2, tp_size=2)
    assert got == StepBytes(dp_all_reduce=2000, tp_all_reduce=2048)
    assert got.total == 4048


def test_hybrid_vgg_bytes_by_hand():
    """Hybrid on 2 ranks, b=3, F=10, H=6, C=5, 100 conv parameters: every term summed by hand."""
    got = hybrid_vgg_bytes(conv_params=100, batch_size=3, fc_in=10, fc_hidden=6, num_classes=5, world_size=2)
    conv = 400  # 2-rank all-reduce of 400 bytes
    gather = 3 * 10 * 4 + 3 * 5 * 4  # the other rank's features, then its logits' gradients
    reduce = 6 * 6 * 4 + 6 * 10 * 4  # fc7's output (6 samples x 6), fc6's input gradient (6 x 10)
    assert got == StepBytes(dp_all_reduce=conv, tp_all_gather=gather, tp_all_reduce=reduce)
    assert got.total == 400 + 180 + 384


def test_step_bytes_arithmetic():
    """StepBytes add per kind, scale by a step count and list only the kinds that carry bytes."""
    a, b = StepBytes(dp_all_reduce=1, tp_all_reduce=2), StepBytes(tp_all_gather=3)
    assert a + b == StepBytes(1, 2, 3)
    assert (a * 10).total == 30
    assert b.by_kind() == {"tp_all_gather": 3}


def _encoder(family):
    pytest.importorskip("transformers")
    from lightning_pdist.models.encoder import EncoderClassifier

    torch.manual_seed(0)
    return EncoderClassifier(family, vocab_size=50, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2,
                             max_len=16, embedding_size=4)  # fmt: skip


def _decoder(family, hidden=8, layers=2, heads=4, **extra):
    """A LLaMA-style or Qwen3-style (per-head query/key RMSNorms) decoder classifier, random weights."""
    pytest.importorskip("transformers")
    import transformers

    config, model = {"llama": ("LlamaConfig", "LlamaForSequenceClassification"),
                     "qwen3": ("Qwen3Config", "Qwen3ForSequenceClassification")}[family]  # fmt: skip
    torch.manual_seed(0)
    return getattr(transformers, model)(getattr(transformers, config)(
        vocab_size=50, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=2, head_dim=hidden // heads, max_position_embeddings=16,
        pad_token_id=0, num_labels=2, use_cache=False, **extra))  # fmt: skip


def test_partial_params_count_every_norm_and_per_head_norm_once():
    """Plain TP sums only Qwen3's per-head norms (2 x head_dim per layer); sequence parallelism adds every norm of the
    stack (LayerNorm weight and bias, RMSNorm weight: 2 per block and LLaMA's final one) and the row-wise biases
    (BERT's, and nn.MultiheadAttention's out_proj and linear2 in torch's encoder), a shared ALBERT block once."""
    from lightning_pdist.tensor_parallel.plan import plan_for

    H = 8
    llama, qwen3 = _decoder("llama"), _decoder("qwen3")
    assert partial_params(llama, plan_for(llama), sequence_parallel=False) == 0
    assert partial_params(qwen3, plan_for(qwen3), sequence_parallel=False) == 2 * 2 * (H // 4)
    assert partial_params(llama, plan_for(llama)) == 2 * 2 * H + H
    assert partial_params(qwen3, plan_for(qwen3)) == 2 * 2 * H + H + 2 * 2 * (H // 4)
    bert, albert = _encoder("bert"), _encoder("albert")
    assert partial_params(bert, plan_for(bert)) == 2 * (2 * 2 * H + 2 * H)
    assert partial_params(albert, plan_for(albert)) == 2 * 2 * H + 2 * H
    layer = nn.TransformerEncoderLayer(H, 2, 16, dropout=0.0, batch_first=True)
    torch_encoder = nn.Sequential(nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(H), enable_nested_tensor=False))
    assert partial_params(torch_encoder, plan_for(torch_encoder)) == 2 * (2 * 2 * H + 2 * H) + 2 * H
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    assert partial_params(mlp, plan_for(mlp), sequence_parallel=False) == 0
    assert "sequence_parallel=True" in partial_params(mlp, plan_for(mlp))


def test_sequence_parallel_bytes_by_hand():
    """B=2, L=4, H=8 (one activation 256 bytes), 2 layers, t=2: 10 all-gathers of half of it, 8 reduce-scatters
    (gloo: the whole all-reduce, 256; NCCL: half), one all-reduce of the 40 partial parameters; L=5 is refused."""
    assert sp_encoder_bytes(2, 4, 8, 2, 2, 40) == StepBytes(tp_all_gather=10 * 128, tp_reduce_scatter=8 * 256,
                                                            tp_all_reduce=160)  # fmt: skip
    assert sp_encoder_bytes(2, 4, 8, 2, 2, 40, gloo=False).tp_reduce_scatter == 8 * 128
    with pytest.raises(ValueError, match=r"sp_encoder_bytes\(seq_len=5\): seq_len must be divisible by tp_size=2"):
        sp_encoder_bytes(2, 5, 8, 2, 2, 0)


def _styles(prefix, names):
    return {f"{prefix}.{name}": style for name, style in names}


BERT_BLOCK = (("attention.self.query", "colwise"), ("attention.self.key", "colwise"), ("attention.self.value", "colwise"),
              ("attention.output.dense", "rowwise"), ("intermediate.dense", "colwise"), ("output.dense", "rowwise"))  # fmt: skip
ALBERT_BLOCK = (("attention.query", "colwise"), ("attention.key", "colwise"), ("attention.value", "colwise"),
                ("attention.dense", "rowwise"), ("ffn", "colwise"), ("ffn_output", "rowwise"))  # fmt: skip


def test_tp_local_numel_bert_by_hand():
    """BERT block, H=8, I=16, t=2: q,k,v (72 each), o's weight (64), FFN in (144), FFN out's weight (128) halve."""
    model = _encoder("bert")
    total = sum(p.numel() for p in model.parameters())
    styles = {}
    for layer in (0, 1):
        styles.update(_styles(f"encoder.bert.encoder.layer.{layer}", BERT_BLOCK))
    sharded_per_block = 3 * (8 * 8 + 8) + 8 * 8 + (16 * 8 + 16) + 8 * 16  # 552; o's and FFN out's biases stay whole
    assert tp_local_numel(model, styles, 2) == total - 2 * sharded_per_block // 2
    assert tp_local_numel(model, styles, 1) == total


def test_tp_local_numel_counts_albert_shared_block_once():
    """ALBERT's one shared block is sharded once, however many times it runs."""
    model = _encoder("albert")
    total = sum(p.numel() for p in model.parameters())
    styles = _styles("encoder.albert.encoder.albert_layer_groups.0.albert_layers.0", ALBERT_BLOCK)
    assert tp_local_numel(model, styles, 2) == total - 552 // 2


def test_tp_local_numel_refusals():
    """Unknown styles, missing modules and indivisible dimensions are refused naming the entry and the rule."""
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    assert tp_local_numel(model, {"0": "colwise", "1": "rowwise"}, 2) == (24 + 6) // 2 + 18 // 2 + 3
    with pytest.raises(ValueError, match=r"styles\['0'\]='diagonal'\): style must be one of"):
        tp_local_numel(model, {"0": "diagonal"}, 2)
    with pytest.raises(ValueError, match=r"has no submodule '7'"):
        tp_local_numel(model, {"7": "colwise"}, 2)
    with pytest.raises(ValueError, match=r"1.weight \(3, 6\) is not divisible by tp_size=4 along dim 1"):
        tp_local_numel(model, {"1": "rowwise"}, 4)
    with pytest.raises(ValueError, match=r"tp_size=0\): tp_size must be an int >= 1"):
        tp_local_numel(model, {}, 0)


def test_step_time_and_bandwidth_crossover_by_hand():
    """t = c/ways + bytes/bw; DP (0.1 s, 10 MB) and TP (0.3 s, 2 MB) cross at 8 MB / 0.2 s = 40 MB/s."""
    assert step_time(1.0, 2_000_000, 1e6, ways=2) == pytest.approx(0.5 + 2.0)
    got = crossover_bandwidth(0.1, 10_000_000, 0.3, 2_000_000)
    assert got.value == pytest.approx(40e6)
    assert (got.below, got.above) == ("tp", "dp")  # slow links favour the fewer bytes
    slow, fast = 10e6, 100e6
    assert step_time(0.3, 2_000_000, slow) < step_time(0.1, 10_000_000, slow)
    assert step_time(0.3, 2_000_000, fast) > step_time(0.1, 10_000_000, fast)


def test_crossover_bandwidth_when_one_side_dominates():
    """A configuration with no more compute and no more bytes wins at every bandwidth (no crossover)."""
    assert crossover_bandwidth(0.1, 1, 0.2, 5) == Crossover(None, "dp", "dp")
    assert crossover_bandwidth(0.3, 9, 0.2, 5) == Crossover(None, "tp", "tp")
    assert crossover_bandwidth(0.2, 5, 0.2, 5) == Crossover(None, "dp", "dp")


def test_find_crossovers_batch_by_hand():
    """t_dp(B) = 0.01 B + 10 and t_tp(B) = 0.02 B + 5.005 cross at B = 499.5; TP wins below, DP from 500 on."""
    diff = lambda b: (0.01 * b + 10) - (0.02 * b + 5.005)  # noqa: E731
    assert find_crossovers(diff, 1, 4096) == [Crossover(500.0, "tp", "dp")]
    assert find_crossovers(lambda b: 1.0, 1, 10) == [Crossover(None, "tp", "tp")]
    assert find_crossovers(lambda b: -1.0, 1, 10) == [Crossover(None, "dp", "dp")]
    with pytest.raises(ValueError, match=r"high must be > low"):
        find_crossovers(diff, 8, 8)


def test_find_crossovers_finds_both_ends_of_a_losing_band():
    """(H - 40)(H - 950) > 0 outside [40, 950]: the second configuration wins below 40 and from 950, loses between."""
    got = find_crossovers(lambda h: (h - 40.5) * (h - 950.5), 2, 8192)
    assert got == [Crossover(41.0, "tp", "dp"), Crossover(951.0, "dp", "tp")]


def test_encoder_flops_by_hand():
    """One layer, B=1, L=2, H=4, I=8: 3 x (2*2*(64+64) + 4*4*4) = 3 x 576."""
    assert encoder_flops(1, 2, 4, 8, 1) == 3 * (2 * 2 * (4 * 16 + 2 * 4 * 8) + 4 * 1 * 4 * 4)
    assert encoder_flops(2, 2, 4, 8, 3) == 6 * encoder_flops(1, 2, 4, 8, 1)


@pytest.mark.parametrize("bad", [dict(world_size=0), dict(world_size=True)])
def test_ring_formulas_refuse_bad_world_sizes(bad):
    """A world size that is not an int >= 1 is refused naming the value."""
    with pytest.raises(ValueError, match=r"world_size=.*must be an int >= 1"):
        ring_all_reduce_bytes(8, **bad)


# -- tier 3: the model against what TensorParallelStrategy's meter counts in a real 2-rank fit -----------------


class DumpMeter(Callback):
    """Each rank writes its meter's bytes per kind to ``folder/rank<r>.json`` at the end of fit."""

    def __init__(self, folder):
        self.folder = folder

    def on_train_end(self, trainer, pl_module):
        meter = trainer.strategy.comm_meter
        (self.folder / f"rank{trainer.global_rank}.json").write_text(json.dumps({"by_kind": meter.by_kind}))


def _measured(tmp_path, model, x, batch_size, devices=2, **strategy_kwargs):
    """One optimizer step of ``model`` under TensorParallelStrategy (fork, 2 ranks); every rank's meter."""
    from _helpers import fit
    from lightning.pytorch import seed_everything
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pdist.models.classifier import ClassifierModule
    from lightning_pdist.tensor_parallel.strategy import TensorParallelStrategy

    seed_everything(0)
    y = torch.randint(0, 2, (len(x),))
    module = ClassifierModule(model=model, num_classes=2, optimizer="sgd", lr=0.01)
    module.train_dataloader = lambda: DataLoader(TensorDataset(x, y), batch_size=batch_size)
    # nonfinite="propagate": no finiteness flag, so the meter holds the algorithm's traffic alone
    strategy = TensorParallelStrategy(start_method="fork", nonfinite="propagate", **strategy_kwargs)
    fit(strategy, module, devices=devices, max_steps=1, callbacks=[DumpMeter(tmp_path)])
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(devices)]


class Families(nn.Module):
    """A BERT-like and an ALBERT-like encoder, a LLaMA-style and a Qwen3-style decoder side by side, logits summed."""

    def __init__(self):
        super().__init__()
        self.bert, self.albert, self.llama, self.qwen3 = _encoder("bert"), _encoder("albert"), _decoder("llama"), \
            _decoder("qwen3")  # fmt: skip

    def forward(self, x):
        return self.bert(x) + self.albert(x) + self.llama(input_ids=x).logits + self.qwen3(input_ids=x).logits


def test_model_equals_the_strategys_meter_for_each_tiny_family(tmp_path):
    """TP on 2 ranks, one launch: for BERT, ALBERT (its shared block run twice), LLaMA and Qwen3 side by side, the
    byte model's 4 all-reduces per layer application, plus one all-reduce of Qwen3's per-head norm gradients,
    equal the meter of a real step, per kind."""
    from lightning_pdist.tensor_parallel.plan import plan_for

    model = Families()
    B, L = 4, 16
    partial = partial_params(model, plan_for(model), sequence_parallel=False)
    assert partial == 2 * 2 * 2  # Qwen3: 2 layers x (q_norm, k_norm) x head_dim 2
    ranks = _measured(tmp_path, model, torch.randint(1, 50, (16, L)), B)
    one = tp_encoder_bytes(B, L, hidden_size=8, num_layers=2, tp_size=2)  # each family's stack
    expected = (one * 3 + tp_encoder_bytes(B, L, 8, 2, 2, partial_params=partial)).by_kind()
    assert [r["by_kind"] for r in ranks] == [expected, expected]


def test_model_equals_the_strategys_meter_for_hybrid_vgg(tmp_path):
    """Hybrid conv-DP / FC-MP on vgg16_scaled, 2 ranks: conv all-reduce, both all-gathers and both FC all-reduces."""
    from lightning_pdist.models.vgg import vgg16_scaled

    torch.manual_seed(0)
    model = vgg16_scaled(width=0.0625)
    conv = sum(p.numel() for p in model.features.parameters())
    fc6, fc8 = model.classifier.fc6, model.classifier.fc8
    b = 4
    ranks = _measured(tmp_path, model, torch.randn(16, 3, 32, 32), b, plan="hybrid")
    expected = hybrid_vgg_bytes(conv, b, fc6.in_features, fc6.out_features, fc8.out_features, world_size=2).by_kind()
    assert [r["by_kind"] for r in ranks] == [expected, expected]
