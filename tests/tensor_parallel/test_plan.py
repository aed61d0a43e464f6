"""Tensor-parallel plans: derived for encoders, Linear stacks and the hybrid; checked against model and degree."""

from __future__ import annotations

import pytest
from torch import nn

from lightning.pytorch.demos import Transformer

from _helpers import FusedAttention

from lightning_pdist.tensor_parallel.plan import COLWISE, HEADS, QKV, REPLICATE, ROWWISE, TPPlan, check_plan
from lightning_pdist.tensor_parallel.plan import plan_for
from lightning_pdist.tensor_parallel.shard import sequence_parallel_encoders
from lightning_pdist.models import MLP, ClassifierModule
from lightning_pdist.models.vgg import vgg16_scaled

pytest.importorskip("transformers")
from lightning_pdist.models import EncoderClassifier  # noqa: E402


def _encoder(family: str, **kwargs) -> nn.Module:
    return EncoderClassifier(family, vocab_size=50, hidden_size=32, num_heads=4, intermediate_size=64, max_len=16,
                             **kwargs)  # fmt: skip


def test_bert_blocks_are_sharded_megatron_style():
    """BERT: q/k/v and the first FFN linear column-wise, the attention output and second FFN linear row-wise."""
    plan = plan_for(_encoder("bert", num_layers=2))
    expected = {}
    for i in range(2):
        p = f"encoder.bert.encoder.layer.{i}."
        expected.update({p + "attention.self.query": COLWISE, p + "attention.self.key": COLWISE,
                         p + "attention.self.value": COLWISE, p + "attention.output.dense": ROWWISE,
                         p + "intermediate.dense": COLWISE, p + "output.dense": ROWWISE})  # fmt: skip
    assert plan.as_dict() == expected  # embeddings, LayerNorm, pooler and classifier replicated
    assert plan.gather_batch_at is None


def test_albert_shared_block_is_sharded_once():
    """ALBERT's one shared block appears once in the plan, whatever the number of layers."""
    plan = plan_for(_encoder("albert", num_layers=3))
    p = "encoder.albert.encoder.albert_layer_groups.0.albert_layers.0."
    assert plan.as_dict() == {p + "attention.query": COLWISE, p + "attention.key": COLWISE,
                              p + "attention.value": COLWISE, p + "attention.dense": ROWWISE,
                              p + "ffn": COLWISE, p + "ffn_output": ROWWISE}  # fmt: skip


def test_linear_stack_pairs_and_leaves_the_odd_layer_replicated():
    """Linear/ReLU/Linear/ReLU/Linear: the first two pair up, the last one (the head) stays replicated."""
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    assert plan_for(net).as_dict() == {"0": COLWISE, "2": ROWWISE}
    assert plan_for(ClassifierModule(MLP(16, 3, 8))).as_dict() == {"model.net.1": COLWISE, "model.net.3": ROWWISE}


def test_a_norm_between_linears_breaks_the_pair():
    """A LayerNorm needs the full activation: Linear, LayerNorm, Linear, ReLU, Linear pairs only the last two."""
    net = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    assert plan_for(net).as_dict() == {"2": COLWISE, "4": ROWWISE}


def test_vgg_auto_and_hybrid_plans():
    """VGG: fc6 column-wise, fc7 row-wise, fc8 replicated; the hybrid gathers the batch at the classifier."""
    net = vgg16_scaled(width=0.0625)
    auto, hybrid = plan_for(net), plan_for(net, hybrid=True)
    assert auto.as_dict() == hybrid.as_dict() == {"classifier.fc6": COLWISE, "classifier.fc7": ROWWISE}
    assert auto.gather_batch_at is None and hybrid.gather_batch_at == "classifier"
    assert "batch all-gathered at the input of 'classifier'" in str(hybrid)


def test_hybrid_needs_convolutions():
    """plan='hybrid' on a network without convolutions is refused, pointing at plan='auto'."""
    with pytest.raises(ValueError, match=r"no convolution layers; use plan='auto'"):
        plan_for(MLP(16, 3, 8), hybrid=True)


def test_torch_transformer_layers_are_split_by_heads():
    """nn.MultiheadAttention (packed in_proj) is split by heads, the FFN linear1/linear2 column/row; the demo
    Transformer's decoder cross-attention too. The heads must divide by t, named with the value and the rule."""
    net = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2)
    want = {}
    for i in range(2):
        want.update({f"layers.{i}.self_attn": HEADS, f"layers.{i}.linear1": COLWISE, f"layers.{i}.linear2": ROWWISE})
    assert plan_for(net).as_dict() == want
    check_plan(plan_for(net), net, 2)
    with pytest.raises(ValueError, match=r"P: module 'layers.0.self_attn' \(nn.MultiheadAttention\): num_heads=2 must "
                                         r"be divisible by tensor_parallel_size=4 \(each rank computes whole heads\)"):
        check_plan(plan_for(net), net, 4, owner="P")
    demo = Transformer(vocab_size=20, ninp=16, nhead=2, nhid=32, nlayers=1)
    assert plan_for(demo).as_dict()["transformer.decoder.layers.0.multihead_attn"] == HEADS
    kdim = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    kdim.attn = nn.MultiheadAttention(8, 2, kdim=4, vdim=4)
    with pytest.raises(ValueError, match=r"'attn' \(nn.MultiheadAttention\): kdim/vdim different from embed_dim"):
        check_plan(plan_for(kdim), kdim, 2)


def test_fused_qkv_linear_is_split_by_heads_and_checked():
    """A fused qkv Linear is placed 'qkv', its projection row-wise; 3 x t must divide out_features, heads t."""
    net = nn.Sequential(FusedAttention())
    assert plan_for(net).as_dict() == {"0.qkv": QKV, "0.proj": ROWWISE}
    check_plan(plan_for(net), net, 2)
    with pytest.raises(ValueError, match=r"module '0': num_heads=4 must be divisible by tensor_parallel_size=8"):
        check_plan(TPPlan.from_dict({"0.qkv": QKV}), nn.Sequential(FusedAttention(48, 4)), 8)
    with pytest.raises(ValueError, match=r"module '0.qkv' \(Linear 16->48\): out_features=48 must be divisible by 3 x "
                                         r"tensor_parallel_size=96"):
        check_plan(TPPlan.from_dict({"0.qkv": QKV}), net, 32)


def _llama(num_key_value_heads: int = 2) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=num_key_value_heads,
                                        max_position_embeddings=16, use_cache=False))  # fmt: skip


def test_llama_blocks_are_sharded_with_the_gate_and_whole_key_value_heads():
    """LLaMA: q/k/v and the gated FFN's gate and up projections column-wise, o_proj and down_proj row-wise, the
    RMSNorms, embedding and lm_head replicated; grouped key/value heads (2 for 4 query heads) over 4 ranks would
    split a head: refused naming the module, the value and the rule."""
    net = _llama()
    p = "model.layers.0."
    assert plan_for(net).as_dict() == {p + "self_attn.q_proj": COLWISE, p + "self_attn.k_proj": COLWISE,
                                       p + "self_attn.v_proj": COLWISE, p + "self_attn.o_proj": ROWWISE,
                                       p + "mlp.gate_proj": COLWISE, p + "mlp.up_proj": COLWISE,
                                       p + "mlp.down_proj": ROWWISE}  # fmt: skip
    check_plan(plan_for(net), net, 2)
    with pytest.raises(ValueError, match=r"P: module 'model.layers.0.self_attn.k_proj' \(Linear 32->16\): "
                                         r"out_features=16 holds 2 heads of head_dim=8, which must be divisible by "
                                         r"tensor_parallel_size=4 \(each rank computes whole heads"):  # fmt: skip
        check_plan(plan_for(net), net, 4, owner="P")
    check_plan(plan_for(_llama(4)), _llama(4), 4)



def _phi3(num_key_value_heads: int, num_attention_heads: int = 4) -> nn.Module:
    from transformers import Phi3Config, Phi3Model

    return Phi3Model(Phi3Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
                                max_position_embeddings=16, use_cache=False, pad_token_id=0, bos_token_id=1,
                                eos_token_id=2))  # fmt: skip


def test_phi3_fused_qkv_is_split_by_heads_and_grouped_key_value_heads_are_refused():
    """Phi-3's fused qkv_proj is 'qkv', o_proj row-wise (its fused gate_up_proj stays replicated). With as many
    key/value heads as query heads (Phi-3-mini) the three blocks are equal: fine. With grouped key/value heads
    (Phi-3-medium: 2 for 4 here) the blocks differ (32, 16 and 16 rows) and one per-head split would hand a rank
    other heads' rows: refused naming the module, the head counts and the rule, as it would be at setup. Heads from
    the config that do not divide the degree are refused too."""
    p = "layers.0.self_attn."
    assert plan_for(_phi3(4)).as_dict() == {p + "qkv_proj": QKV, p + "o_proj": ROWWISE}
    check_plan(plan_for(_phi3(4)), _phi3(4), 2)
    with pytest.raises(ValueError, match=r"TensorParallelStrategy\(plan='auto'\): module 'layers.0.self_attn.qkv_proj' "
                                         r"\(Linear 32->64\): a fused query/key/value projection with grouped key/value "
                                         r"heads \(num_key_value_heads=2 < num_attention_heads=4\) holds query, key and "
                                         r"value blocks of 32, 16 and 16 rows; 'qkv' splits three equal blocks by heads, "
                                         r"so it cannot be sharded \(replicate the attention: plan dict "
                                         r"\{'layers.0.self_attn.qkv_proj': 'replicate', 'layers.0.self_attn.o_proj': "
                                         r"'replicate'\}, or project query, key and value with separate q_proj/k_proj/"
                                         r"v_proj Linear layers"):  # fmt: skip
        check_plan(plan_for(_phi3(2)), _phi3(2), 2, owner="TensorParallelStrategy(plan='auto')")
    with pytest.raises(ValueError, match=r"module 'layers.0.self_attn': config.num_attention_heads=4 must be divisible "
                                         r"by tensor_parallel_size=8 \(each rank computes whole heads\)"):  # fmt: skip
        check_plan(TPPlan.from_dict({p + "qkv_proj": QKV}), _phi3(4), 8)

class _PostNormAttention(nn.Module):
    """q/k/v, the output projection and a norm in one module: the residual is inside, as in ALBERT's attention."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(16, 16) for _ in range(4))
        self.norm = nn.LayerNorm(16)


def test_sequence_parallelism_covers_torch_and_transformers_stacks_with_every_layer_sharded():
    """sequence_parallel=True covers nn.TransformerEncoder stacks, transformers' BERT and ALBERT encoder stacks and
    LLaMA-style decoder stacks (RMSNorm allowed); torch's nn.TransformerDecoder stays plain TP. Refused, named: a
    model without a stack, a replicated Linear inside, a stack holding parameters beside its blocks, a parameterised
    module inside that is not a LayerNorm/RMSNorm, an attention module holding its output projection and a norm
    that is not ALBERT's, and cross-attention."""
    from transformers import BertConfig, BertModel

    bert, albert, llama = _encoder("bert", num_layers=1), _encoder("albert", num_layers=2), _llama()
    assert list(sequence_parallel_encoders(bert, plan_for(bert), "O")) == ["encoder.bert.encoder"]
    assert list(sequence_parallel_encoders(albert, plan_for(albert), "O")) == ["encoder.albert.encoder"]
    assert list(sequence_parallel_encoders(llama, plan_for(llama), "O")) == ["model"]
    demo = Transformer(vocab_size=20, ninp=16, nhead=2, nhid=32, nlayers=1)
    assert list(sequence_parallel_encoders(demo, plan_for(demo), "O")) == ["transformer.encoder"]
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    with pytest.raises(ValueError, match=r"O: sequence_parallel=True shards the LayerNorm/dropout regions of "
                                         r"nn.TransformerEncoder stacks, transformers' BERT/ALBERT encoders and "
                                         r"LLaMA-style decoders, and Sequential has none with sharded layers \(torch's "
                                         r"nn.TransformerDecoder and cross-attention are not covered\)"):
        sequence_parallel_encoders(mlp, plan_for(mlp), "O")
    net = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 1)
    assert list(sequence_parallel_encoders(net, plan_for(net), "O")) == [""]
    plan = TPPlan.from_dict({"layers.0.self_attn": HEADS})
    with pytest.raises(ValueError, match=r"O: sequence_parallel=True: module 'layers.0.linear1' \(Linear\) inside the "
                                         r"sequence-parallel '' is not sharded"):
        sequence_parallel_encoders(net, plan, "O")
    plan = {**plan_for(bert).as_dict(), "encoder.bert.encoder.layer.0.intermediate.dense": REPLICATE}
    with pytest.raises(ValueError, match=r"module 'encoder.bert.encoder.layer.0.intermediate.dense' \(Linear\) inside "
                                         r"the sequence-parallel 'encoder.bert.encoder' is not sharded"):
        sequence_parallel_encoders(bert, TPPlan.from_dict(plan), "O")
    stack = nn.Module()
    stack.layer, stack.norm = nn.ModuleList([nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)]), nn.LayerNorm(16)
    with pytest.raises(ValueError, match=r"O: sequence_parallel=True: '' \(Module\) holds 'norm' with parameters "
                                         r"beside its blocks"):
        sequence_parallel_encoders(stack, plan_for(stack), "O")
    net.layers[0].norm1 = nn.RMSNorm(16)  # per position: its weight's gradient is summed over the group
    assert list(sequence_parallel_encoders(net, plan_for(net), "O")) == [""]
    net.layers[0].norm1 = nn.BatchNorm1d(16)
    with pytest.raises(ValueError, match=r"module 'layers.0.norm1' \(BatchNorm1d\) inside the sequence-parallel '' "
                                         r"has parameters and is neither a sharded layer nor a LayerNorm/RMSNorm"):
        sequence_parallel_encoders(net, plan_for(net), "O")
    post = nn.Module()
    post.layer = nn.ModuleList([_PostNormAttention()])
    with pytest.raises(ValueError, match=r"O: sequence_parallel=True: 'layer.0' \(_PostNormAttention\) holds its "
                                         r"column-wise projections, the row-wise 'layer.0.o_proj' and the norm 'norm': "
                                         r"a residual and norm inside an attention module"):
        sequence_parallel_encoders(post, plan_for(post), "O")
    decoder = BertModel(BertConfig(vocab_size=20, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                   intermediate_size=32, is_decoder=True, add_cross_attention=True))  # fmt: skip
    with pytest.raises(ValueError, match=r"'encoder.layer.0.crossattention' \(cross-attention\) is not covered"):
        sequence_parallel_encoders(decoder, plan_for(decoder), "O")


def test_nothing_to_shard_is_refused():
    """A model with no attention and no Linear pair gets a refusal asking for a plan dict."""
    with pytest.raises(ValueError, match=r"plan_for\(Sequential\): found nothing to shard.*pass a plan dict"):
        plan_for(nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 2)))


def test_plan_values_print_and_compare():
    """Plans are values: equal when built from equal dicts, printable one module per line; bad placements refused."""
    a = TPPlan.from_dict({"b": ROWWISE, "a": COLWISE})
    assert a == TPPlan.from_dict({"a": COLWISE, "b": ROWWISE}) and hash(a) == hash(TPPlan.from_dict(a.as_dict()))
    assert str(a).splitlines() == ["a  colwise", "b  rowwise"]
    assert a.named(COLWISE) == ["a"] and a.named(REPLICATE) == []
    with pytest.raises(ValueError, match=r"TPPlan\(layers\['a'\]='diagonal'\): placement must be one of"):
        TPPlan.from_dict({"a": "diagonal"})
    with pytest.raises(TypeError, match=r"names and placements must be strings"):
        TPPlan.from_dict({"a": 1})


def test_check_plan_names_the_missing_module_with_a_suggestion():
    """A plan naming a module that does not exist is refused with the closest real name."""
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(ValueError, match=r"P: module '3' is not in Sequential; its modules are '0', '1', '2'"):
        check_plan(TPPlan.from_dict({"3": COLWISE}), net, 2, owner="P")
    model = ClassifierModule(MLP(16, 3, 8))
    with pytest.raises(ValueError, match=r"module 'model.net.11' is not in ClassifierModule; did you mean 'model.net.1'"):
        check_plan(TPPlan.from_dict({"model.net.11": COLWISE}), model, 2)


@pytest.mark.parametrize(
    ("layers", "tp", "message"),
    [
        ({"0": COLWISE}, 3, r"module '0' \(Linear 4->8\): out_features=8 must be divisible by tensor_parallel_size=3 "
                            r"to shard it colwise"),
        ({"2": ROWWISE}, 3, r"module '2' \(Linear 8->2\): in_features=8 must be divisible by tensor_parallel_size=3"),
        ({"1": COLWISE}, 2, r"module '1' is ReLU; colwise sharding applies to nn.Linear and nn.Embedding only"),
    ],
)
def test_check_plan_refuses_what_cannot_be_sharded(layers, tp, message):
    """Indivisible dimensions and non-Linear modules are refused, naming the module, the value and the rule."""
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(ValueError, match=message):
        check_plan(TPPlan.from_dict(layers), net, tp)


def test_check_plan_refuses_heads_that_do_not_divide():
    """Two heads over four ranks would split a head: refused naming the attention module."""
    net = EncoderClassifier("bert", vocab_size=50, hidden_size=32, num_heads=2, intermediate_size=64, max_len=16)
    with pytest.raises(ValueError, match=r"'encoder.bert.encoder.layer.0.attention.self': num_attention_heads=2 "
                                         r"must be divisible by tensor_parallel_size=4"):  # fmt: skip
        check_plan(plan_for(net), net, 4)
    check_plan(plan_for(net), net, 2)  # whole heads per rank: fine
