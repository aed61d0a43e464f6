"""torch's Transformer layers (nn.MultiheadAttention split by heads), a fused qkv Linear and sequence parallelism
under TensorParallelStrategy on real ranks: losses, gradients and weights equal the unsharded model's (1e-5)."""

from __future__ import annotations

import copy

import pytest
import torch
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.demos import Transformer
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from _helpers import FusedAttention, fit, rank_batches
from _ranks import run_ranks
from lightning_pdist import TensorParallelStrategy
from lightning_pdist.tensor_parallel.comm import TPComm
from lightning_pdist.tensor_parallel.layers import unshard
from lightning_pdist.tensor_parallel.plan import TPPlan, plan_for
from lightning_pdist.tensor_parallel.shard import apply_plan

VOCAB, SEQ, BATCH, DIM = 24, 8, 4, 16


class EncoderNet(nn.Module):
    """torch's nn.TransformerEncoder, pre-norm, sequence-first, GELU, final LayerNorm, a padding mask; then a
    fused-qkv attention outside it and a replicated classifier."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        layer = nn.TransformerEncoderLayer(DIM, 4, 32, dropout=0.0, activation="gelu", norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(DIM), enable_nested_tensor=False)
        self.fused = FusedAttention()
        self.head = nn.Linear(DIM, 3)

    def forward(self, x):
        h = self.encoder(self.emb(x).transpose(0, 1), src_key_padding_mask=x == 0).transpose(0, 1)
        h = h + self.fused(h)
        return self.head(h.mean(1))


def _demo() -> nn.Module:
    torch.manual_seed(0)
    return Transformer(vocab_size=VOCAB, ninp=DIM, nhead=4, nhid=32, nlayers=1, dropout=0.0)


def _encoder() -> nn.Module:
    torch.manual_seed(0)
    return EncoderNet()


def _data(kind: str, n: int = 16) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, VOCAB, (n, SEQ + 1), generator=g)
    if kind == "demo":
        return TensorDataset(tokens[:, :-1], tokens[:, 1:])
    tokens[::3, SEQ - 3 :] = 0  # padding
    return TensorDataset(tokens[:, :-1], torch.randint(0, 3, (n,), generator=g))


def _loss(net: nn.Module, batch, kind: str) -> torch.Tensor:
    x, y = batch
    if kind == "demo":
        return F.nll_loss(net(x, y).view(-1, VOCAB), y.reshape(-1))
    return F.cross_entropy(net(x), y)


class LM(LightningModule):
    def __init__(self, net, data, kind):
        super().__init__()
        self.net, self.data, self.kind = net, data, kind

    def training_step(self, batch, batch_idx):
        return _loss(self.net, batch, self.kind)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=BATCH)


class Record(Callback):
    """Rank 0: each step's loss and full gradients, gathered from the shards."""

    def __init__(self, path):
        self.path, self.out = path, {"grads": [], "losses": []}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.out["grads"].append({n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                                  for n, p in pl_module.named_parameters()})  # fmt: skip

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.out["losses"].append(float(outputs["loss"]))
        self.out["kinds"] = sorted(trainer.strategy.comm_meter.by_kind)
        if trainer.global_rank == 0:
            torch.save(self.out, self.path)


def _reference(net, data, kind, steps, ranks=1):
    net = copy.deepcopy(net)
    batches = [rank_batches(data, r, ranks, BATCH) for r in range(ranks)]
    out = {"grads": [], "losses": []}
    for step in range(steps):
        batch = [torch.cat([b[step][i] for b in batches]) for i in range(2)]
        net.zero_grad()
        loss = _loss(net, batch, kind)
        loss.backward()
        out["grads"].append({"net." + n: p.grad.clone() for n, p in net.named_parameters()})
        out["losses"].append(loss.item())
        with torch.no_grad():
            for p in net.parameters():
                p -= 0.1 * p.grad
    out["weights"] = {"net." + n: p.detach().clone() for n, p in net.named_parameters()}
    return out


def _close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize(
    ("kind", "sequence_parallel", "devices"),
    [("demo", False, 2), ("demo", True, 4), ("encoder", True, 2)],
    ids=["demo_transformer", "demo_transformer_sp_dp2xtp2", "torch_encoder_sp_fused_qkv"],
)
def test_torch_transformers_equal_the_unsharded_model(tmp_path, kind, sequence_parallel, devices):
    """Lightning's demo Transformer (encoder-decoder: self-, causal and cross-attention split by heads) and a
    pre-norm, sequence-first nn.TransformerEncoder with a padding mask plus a fused-qkv attention, on t=2 ranks
    (DP×TP 2×2 for the demo under sequence parallelism): every step's loss and gradient, the final weights,
    equal one process training the unsharded model on the same (global) batches; after fit the module is plain."""
    net, data = (_demo if kind == "demo" else _encoder)(), _data(kind)
    strategy = TensorParallelStrategy(tensor_parallel_size=2, sequence_parallel=sequence_parallel, start_method="fork")
    rec = Record(tmp_path / "record.pt")
    trainer = fit(strategy, LM(copy.deepcopy(net), data, kind), devices=devices, max_steps=2, callbacks=[rec])
    got, want = torch.load(tmp_path / "record.pt"), _reference(net, data, kind, steps=2, ranks=devices // 2)
    if devices == 2:  # under DP×TP rank 0's loss is its own group's batch; the gradients are the global ones
        assert got["losses"] == pytest.approx(want["losses"], abs=1e-5)
    for g, w in zip(got["grads"], want["grads"]):
        _close(g, w)
    _close(dict(trainer.lightning_module.named_parameters()), want["weights"])
    expected = {"tp_all_gather", "tp_reduce_scatter"} if sequence_parallel else set()
    assert expected | {"tp_all_reduce", "nonfinite_flag"} | ({"dp_all_reduce"} if devices == 4 else set()) == set(
        got["kinds"])


def test_attention_masks_and_weights_match_torch_and_an_odd_sequence_is_refused(tmp_path):
    """The sharded nn.MultiheadAttention (t=2, forward) returns torch's output and weights for need_weights averaged
    and per head, boolean/float/per-head masks, batch- and sequence-first and unbatched inputs. Under sequence
    parallelism a length-7 sequence over 2 ranks is refused at the forward, before any collective, on every rank,
    naming the argument, the length and the rule (at a LLaMA decoder stack, then at torch's encoder). Plain TP of a
    Qwen3 decoder: its per-head query/key norms' gradients, summed over the group, equal the unsharded model's; of a
    Phi-3 decoder (fused qkv_proj): output and gradients equal the unsharded model's."""
    with pytest.raises(ValueError, match=r"sequence_parallel=True: the sequence length 7 of the input of 'encoder' must "
                                         r"be divisible by tensor_parallel_size=2"):  # fmt: skip
        run_ranks(_attention_cases, 2, tmp_path)


def _attention_cases(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    for batch_first in (True, False):
        mha = nn.MultiheadAttention(DIM, 4, batch_first=batch_first)
        ref = copy.deepcopy(mha)
        apply_plan(mha, TPPlan.from_dict({"": "heads"}), mesh, TPComm(mesh.get_group()), False, "T")
        x, mem = torch.randn(2, 5, DIM), torch.randn(2, 6, DIM)
        if not batch_first:
            x, mem = x.transpose(0, 1), mem.transpose(0, 1)
        pad = torch.tensor([[False] * 4 + [True] * 2, [False] * 6])
        causal = torch.triu(torch.ones(5, 6, dtype=torch.bool), 1)
        per_head = torch.randn(2 * 4, 5, 6)
        cases = [dict(), dict(key_padding_mask=pad), dict(attn_mask=causal, key_padding_mask=pad.float() * -1e4),
                 dict(attn_mask=per_head), dict(average_attn_weights=False, attn_mask=causal)]  # fmt: skip
        for kwargs in cases:
            got, got_w = mha(x, mem, mem, **kwargs)
            want, want_w = ref(x, mem, mem, **kwargs)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=str(kwargs))
            torch.testing.assert_close(got_w, want_w, atol=1e-5, rtol=0, msg=str(kwargs))
        one, one_mem = (x[0], mem[0]) if batch_first else (x[:, 0], mem[:, 0])  # unbatched (L, E)
        got, want = mha(one, one_mem, one_mem)[0], ref(one, one_mem, one_mem)[0]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    try:
        from transformers import LlamaConfig, LlamaModel, Phi3Config, Phi3Model, Qwen3Config, Qwen3Model
    except ImportError:  # transformers is optional: these cases are skipped without it
        LlamaModel = None
    if LlamaModel is not None:
        # plain TP: Qwen3's per-head query/key RMSNorms see this rank's heads only; their gradients, summed over the
        # group as the strategy does once per step, equal the unsharded model's
        qwen = Qwen3Model(Qwen3Config(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=4, use_cache=False))  # fmt: skip
        ref, comm = copy.deepcopy(qwen), TPComm(mesh.get_group())
        partial = apply_plan(qwen, plan_for(qwen), mesh, comm, False, "T").partial
        assert {id(p) for p in partial} == {id(qwen.layers[0].self_attn.q_norm.weight),
                                            id(qwen.layers[0].self_attn.k_norm.weight)}  # fmt: skip
        tokens = torch.randint(1, VOCAB, (2, 6))
        for net in (qwen, ref):
            net(tokens).last_hidden_state.square().mean().backward()
        comm.sum_flat_([p.grad for p in partial])
        for (name, p), q in zip(qwen.named_parameters(), ref.parameters()):
            got = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            torch.testing.assert_close(got, q.grad, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
        # plain TP: Phi-3's fused qkv_proj (as many key/value heads as query heads, as in Phi-3-mini) split by heads;
        # its forward slices the fused output by head counts, which the attention module sees divided by t: the
        # output and every gradient equal the unsharded model's, and after unshard the module is Phi-3's own again
        phi = Phi3Model(Phi3Config(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=4, use_cache=False, pad_token_id=0,
                                   bos_token_id=1, eos_token_id=2))  # fmt: skip
        ref, attn = copy.deepcopy(phi), phi.layers[0].self_attn
        sharding = apply_plan(phi, plan_for(phi), mesh, TPComm(mesh.get_group()), False, "T")
        assert (attn.config.num_attention_heads, attn.num_key_value_heads, phi.config.num_attention_heads) == (2, 2, 4)
        outs = [net(tokens).last_hidden_state for net in (phi, ref)]
        torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)
        for out in outs:
            out.square().mean().backward()
        for (name, p), q in zip(phi.named_parameters(), ref.parameters()):
            got = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            torch.testing.assert_close(got, q.grad, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
        unshard(phi, sharding)
        assert attn.config is phi.config and attn.num_key_value_heads == 4
        torch.testing.assert_close(phi(tokens).last_hidden_state, ref(tokens).last_hidden_state, atol=1e-5, rtol=0)
        # the sequence length rule at a transformers stack's first block
        llama = LlamaModel(LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, use_cache=False))  # fmt: skip
        apply_plan(llama, plan_for(llama), mesh, TPComm(mesh.get_group()), True, "TensorParallelStrategy(...)")
        with pytest.raises(ValueError, match=r"the sequence length 7 of the input of '' must be divisible by "
                                             r"tensor_parallel_size=2 \(each rank holds length / "
                                             r"tensor_parallel_size positions\)"):  # fmt: skip
            llama(torch.randint(1, VOCAB, (2, 7)))
    net = _encoder()
    apply_plan(net, plan_for(net), mesh, TPComm(mesh.get_group()), True, "TensorParallelStrategy(...)")
    net(torch.randint(1, VOCAB, (2, 7)))


def test_a_distributed_checkpoint_of_modules_split_by_heads_is_refused_at_setup():
    """torch.distributed.checkpoint does not place the rows of per-head shards: refused, naming the modules."""
    with pytest.raises(Exception, match=r"TensorParallelStrategy\(save_distributed_checkpoint=True\): modules split by "
                                        r"heads \('net.transformer.decoder.layers.0.multihead_attn', .*use "
                                        r"save_distributed_checkpoint=False"):  # fmt: skip
        fit(TensorParallelStrategy(start_method="fork", save_distributed_checkpoint=True), LM(_demo(), _data("demo"),
                                                                                              "demo"), max_steps=1)  # fmt: skip
