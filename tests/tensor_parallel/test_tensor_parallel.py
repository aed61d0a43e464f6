"""TensorParallelStrategy on real ranks: gradients, losses and weights equal the unsharded model's, DP×TP, hybrid."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from _helpers import fit, rank_batches
from lightning_pdist.core.accounting import all_reduce_bytes
from lightning_pdist.tensor_parallel.cost import partial_params, sp_encoder_bytes
from lightning_pdist.tensor_parallel.plan import plan_for
from lightning_pdist.models.vgg import vgg16_scaled
from lightning_pdist import TensorParallelStrategy

pytest.importorskip("transformers")
from lightning_pdist.models import EncoderClassifier  # noqa: E402

BATCH, SEQ, HIDDEN, LAYERS = 4, 16, 32, 2


def _bert(family: str = "bert") -> nn.Module:
    torch.manual_seed(0)
    return EncoderClassifier(family, vocab_size=60, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=4,
                             intermediate_size=64, max_len=SEQ, dropout=0.0)  # fmt: skip


class Stacks(nn.Module):
    """A BERT-like and an ALBERT-like encoder and two causal decoders, LLaMA-style (RMSNorm, gated FFN, 2 key/value
    heads for 4 query heads, rotary positions) and Qwen3-style (the same with an RMSNorm over each head's query and
    key), side by side on the same tokens, their logits summed: one launch checks the four stacks under sequence
    parallelism."""

    def __init__(self):
        super().__init__()
        from transformers import LlamaConfig, LlamaForSequenceClassification, Qwen3Config, Qwen3ForSequenceClassification

        self.bert, self.albert = _bert("bert"), _bert("albert")
        common = dict(vocab_size=60, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=HIDDEN // 4, max_position_embeddings=SEQ,
                      pad_token_id=0, num_labels=2, use_cache=False)  # fmt: skip
        self.llama = LlamaForSequenceClassification(LlamaConfig(**common))
        self.qwen3 = Qwen3ForSequenceClassification(Qwen3Config(**common))

    def forward(self, x):
        mask = (x != 0).long()  # the decoders classify from the last non-padding token
        return self.bert(x) + self.albert(x) + self.llama(input_ids=x, attention_mask=mask).logits + \
            self.qwen3(input_ids=x, attention_mask=mask).logits  # fmt: skip


def _tokens(n: int = 16) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(1, 60, (n, SEQ), generator=g)
    x[::3, SEQ - 5 :] = 0  # some padding
    return TensorDataset(x, torch.randint(0, 2, (n,), generator=g))


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3))


def _features(n: int = 16, shape=(12,), classes: int = 3) -> TensorDataset:
    g = torch.Generator().manual_seed(2)
    return TensorDataset(torch.randn(n, *shape, generator=g), torch.randint(0, classes, (n,), generator=g))


def _vgg() -> nn.Module:
    torch.manual_seed(0)
    net = vgg16_scaled(width=0.0625)  # 62 classes, fc6 512->256, fc7 256->256
    for m in net.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0  # the unsharded reference must see the same function
    return net


class Net(LightningModule):
    """Cross-entropy and plain SGD; Lightning's distributed sampler picks the batches (the reference replays them)."""

    def __init__(self, net: nn.Module, data: TensorDataset, lr: float = 0.1, momentum: float = 0.0):
        super().__init__()
        self.net, self.data, self.lr, self.momentum = net, data, lr, momentum

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=BATCH)


class Record(Callback):
    """Rank 0 writes each step's loss and full gradients (gathered from the shards) to ``path``."""

    def __init__(self, path: Path):
        self.path, self.grads, self.losses = path, [], []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        full = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                for n, p in pl_module.named_parameters() if p.grad is not None}  # fmt: skip
        self.grads.append(full)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        if trainer.global_rank == 0:
            kinds = dict(trainer.strategy.comm_meter.by_kind)
            calls = dict(trainer.strategy._tp_comm.calls)  # the sharded layers' collectives, by kind
            torch.save({"grads": self.grads, "losses": self.losses, "kinds": kinds, "calls": calls}, self.path)


class SaveAfterFit(Callback):
    """Every rank, after fit (after the strategy's teardown): its module's ``state_dict()``, as a user would save it,
    and whether its parameters are DTensors; then the model runs on that rank alone (no collective)."""

    def __init__(self, path: Path, probe: torch.Tensor | None = None):
        self.path, self.probe = path, probe

    def on_fit_end(self, trainer, pl_module):
        sharded = any(isinstance(p, DTensor) for p in pl_module.parameters())
        out = {"sharded": sharded}
        if not sharded:
            torch.save(pl_module.state_dict(), self.path / f"state_dict.rank{trainer.global_rank}.pt")
            if trainer.global_rank == 1 and self.probe is not None:
                with torch.no_grad():
                    out["probe"] = pl_module.net(self.probe)  # rank 1 alone: would wait forever on a collective
        torch.save(out, self.path / f"after_fit.rank{trainer.global_rank}.pt")


def reference(net: nn.Module, data: TensorDataset, steps: int, ranks: int = 1, lr: float = 0.1, clip=None) -> dict:
    """Plain torch, one process: SGD on the global batch (the ``ranks`` data-parallel batches side by side)."""
    net = copy.deepcopy(net)
    batches = [rank_batches(data, r, ranks, BATCH) for r in range(ranks)]  # what Lightning's sampler hands out
    out = {"grads": [], "losses": []}
    for step in range(steps):
        x = torch.cat([b[step][0] for b in batches])
        y = torch.cat([b[step][1] for b in batches])
        net.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        out["grads"].append({"net." + n: p.grad.clone() for n, p in net.named_parameters()})
        out["losses"].append(loss.item())
        if clip is not None:
            clip(net.parameters())
        with torch.no_grad():
            for p in net.parameters():
                p -= lr * p.grad
    out["weights"] = {"net." + n: p.detach().clone() for n, p in net.named_parameters()}
    return out


def _assert_close(got: dict, want: dict, atol: float = 1e-5) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=atol, rtol=0, msg=name)


def _run(tmp_path, net, data, strategy, devices=2, steps=3, callbacks=(), **kwargs):
    rec = Record(tmp_path / "record.pt")
    trainer = fit(strategy, Net(copy.deepcopy(net), data), devices=devices, max_steps=steps, callbacks=[rec, *callbacks],
                  **kwargs)  # fmt: skip
    return trainer, torch.load(tmp_path / "record.pt")


@pytest.mark.parametrize(("family", "sequence_parallel"), [("bert", False), ("albert", False), ("stacks", True)],
                         ids=["bert", "albert", "sp_bert_albert_llama_qwen3"])  # fmt: skip
def test_encoder_gradients_losses_and_weights_equal_the_unsharded_model(tmp_path, family, sequence_parallel):
    """BERT-like and ALBERT-like encoders on 2 ranks (t=2), and under sequence parallelism BERT, ALBERT (its one
    shared block applied twice), a LLaMA-style and a Qwen3-style causal decoder side by side: every step's loss and
    gradient and
    the final weights equal one process training the unsharded model on the same batches (1e-5). With
    gather_on_teardown=False (ALBERT here) the ranks keep their shards after fit; the main process still receives
    full weights."""
    net, data = (Stacks() if family == "stacks" else _bert(family)), _tokens()
    gather = family != "albert"
    strategy = TensorParallelStrategy(start_method="fork", gather_on_teardown=gather, sequence_parallel=sequence_parallel)
    trainer, got = _run(tmp_path, net, data, strategy, callbacks=[SaveAfterFit(tmp_path)])
    assert [torch.load(tmp_path / f"after_fit.rank{r}.pt")["sharded"] for r in range(2)] == [not gather] * 2
    want = reference(net, data, steps=3)
    assert got["losses"] == pytest.approx(want["losses"], abs=1e-5)
    for g, w in zip(got["grads"], want["grads"]):
        _assert_close(g, w)
    _assert_close(dict(trainer.lightning_module.named_parameters()), want["weights"])
    if sequence_parallel:
        # Per layer application, in each of the four stacks: one all-gather into q/k/v (shared; BERT and LLaMA at
        # the attention module's input, ALBERT at the projections inside its attention) and one into the FFN
        # (LLaMA's gate and up projections share it), one reduce-scatter out of each row-wise layer; the
        # transposes backward. Per step and stack, the input split (backward: all-gather) and output gather. The
        # norm weights (LayerNorm, RMSNorm) and row-wise biases saw this rank's positions, Qwen3's per-head query
        # and key norms this rank's heads: their gradients are summed over the group once per step, in one flat
        # all-reduce for the whole model.
        stacks = 4
        assert got["calls"] == {"all_gather": 3 * stacks * (LAYERS * 4 + 2), "reduce_scatter": 3 * stacks * LAYERS * 4,
                                "all_reduce": 3}  # fmt: skip
        # The byte model, stack by stack (its partial gradients: every LayerNorm and RMSNorm, LLaMA's and Qwen3's
        # final norms, BERT's row-wise biases, Qwen3's per-head norms; one all-reduce for all), equals the meter
        partial = partial_params(net, plan_for(net))
        stack = sp_encoder_bytes(BATCH, SEQ, HIDDEN, LAYERS, 2, partial_params=0)
        model = (stack * (stacks - 1) + sp_encoder_bytes(BATCH, SEQ, HIDDEN, LAYERS, 2, partial_params=partial)) * 3
        assert {k: v for k, v in got["kinds"].items() if k != "nonfinite_flag"} == model.by_kind()
        return
    # Each step: per layer, 2 forward all-reduces (attention output, FFN output) and 2 backward ones (the input
    # gradient of q, k and v, summed on the rank and all-reduced once; that of the first FFN linear), each of a
    # (B, L, H) float activation: 4 collectives per layer and step, where one per column-wise module would be 6.
    assert got["calls"] == {"all_reduce": 3 * LAYERS * 4}
    per_step = LAYERS * 4 * all_reduce_bytes(BATCH * SEQ * HIDDEN * 4, 2)
    flag = all_reduce_bytes(2 * 4, 2)  # nonfinite='raise': the ranks agree on 2 float flags before every step
    assert trainer.callback_metrics["pdist/comm_bytes"].item() == per_step + flag
    assert got["kinds"] == {"tp_all_reduce": 3 * per_step, "nonfinite_flag": 3 * flag}
    assert trainer.callback_metrics["pdist/comm_bytes_total"].item() == 3 * (per_step + flag)


def test_mlp_stack_equals_the_unsharded_model_and_every_rank_holds_a_plain_module_after_fit(tmp_path):
    """A Linear stack (column, row, replicated head) on 2 ranks equals the unsharded model. After fit every rank's
    module is plain again (gather_on_teardown, the default): the state_dict() each rank saves loads into the plain
    module in this process (no torch.distributed here) with the trained values, and rank 1 runs the model alone."""
    net, data = _mlp(), _features()
    probe = _features(4).tensors[0]
    trainer, got = _run(tmp_path, net, data, TensorParallelStrategy(start_method="fork"),
                        callbacks=[SaveAfterFit(tmp_path, probe)])  # fmt: skip
    want = reference(net, data, steps=3)
    for g, w in zip(got["grads"], want["grads"]):
        _assert_close(g, w)
    _assert_close(dict(trainer.lightning_module.named_parameters()), want["weights"])
    assert not torch.distributed.is_initialized()
    for rank in range(2):
        plain = Net(copy.deepcopy(net), data)
        plain.load_state_dict(torch.load(tmp_path / f"state_dict.rank{rank}.pt"))  # strict: same keys and shapes
        _assert_close(dict(plain.named_parameters()), want["weights"])
    after = torch.load(tmp_path / "after_fit.rank1.pt")
    assert not after["sharded"]
    with torch.no_grad():
        torch.testing.assert_close(after["probe"], plain.net(probe), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("algorithm", "clip"),
    [("norm", lambda ps: nn.utils.clip_grad_norm_(ps, 0.05)), ("value", lambda ps: nn.utils.clip_grad_value_(ps, 1e-3))],
)
def test_gradient_clipping_over_sharded_and_replicated_gradients_equals_torch_on_the_unsharded_model(
    tmp_path, algorithm, clip
):
    """gradient_clip_val by norm and by value: torch's own clipping of the unsharded model gives the same weights
    (torch's functions cannot take the mix of DTensor and plain gradients themselves)."""
    net, data = _bert(), _tokens()
    val = 0.05 if algorithm == "norm" else 1e-3
    trainer, _ = _run(tmp_path, net, data, TensorParallelStrategy(start_method="fork"), steps=2,
                      gradient_clip_val=val, gradient_clip_algorithm=algorithm)  # fmt: skip
    want = reference(net, data, steps=2, clip=clip)
    _assert_close(dict(trainer.lightning_module.named_parameters()), want["weights"])
    unclipped = reference(net, data, steps=2)["weights"]["net.encoder.classifier.weight"]
    assert not torch.allclose(unclipped, want["weights"]["net.encoder.classifier.weight"], atol=1e-5)  # it bites


def test_dp_by_tp_on_four_ranks_equals_the_unsharded_model_on_the_global_batch(tmp_path):
    """DP×TP 2×2: each TP pair shards the encoder, the two pairs average gradients; equals the unsharded model on
    both data-parallel batches side by side."""
    net, data = _bert(), _tokens()
    strategy = TensorParallelStrategy(tensor_parallel_size=2, data_parallel_size=2, start_method="fork")
    trainer, got = _run(tmp_path, net, data, strategy, devices=4, steps=2)
    want = reference(net, data, steps=2, ranks=2)
    for g, w in zip(got["grads"], want["grads"]):
        _assert_close(g, w)
    _assert_close(dict(trainer.lightning_module.named_parameters()), want["weights"])
    assert set(got["kinds"]) == {"tp_all_reduce", "dp_all_reduce", "nonfinite_flag"}


def test_hybrid_vgg_equals_the_unsharded_model_on_the_global_batch(tmp_path):
    """Conv-DP / FC-MP on vgg16_scaled, 2 ranks with their own images: equals the unsharded model on both batches."""
    net, data = _vgg(), _features(shape=(3, 32, 32), classes=62)
    trainer, got = _run(tmp_path, net, data, TensorParallelStrategy(plan="hybrid", start_method="fork"), steps=2)
    want = reference(net, data, steps=2, ranks=2)
    for g, w in zip(got["grads"], want["grads"]):
        _assert_close(g, w, atol=2e-5)
    _assert_close(dict(trainer.lightning_module.named_parameters()), want["weights"], atol=2e-5)
    assert {"tp_all_gather", "tp_all_reduce", "dp_all_reduce"} <= set(got["kinds"])


@pytest.mark.parametrize("sharded", [False, True], ids=["full_file", "distributed_checkpoint"])
def test_resume_from_a_checkpoint_is_exact_and_loads_in_a_plain_process(tmp_path, sharded):
    """Stopping after epoch 0 and resuming to the end of epoch 1 gives the uninterrupted weights bit for bit, from
    the full file and from a torch.distributed.checkpoint folder; the full file loads into the plain, unsharded
    module with load_from_checkpoint."""
    net, data = _bert(), _tokens()
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, filename="{epoch}")
    common = dict(max_steps=-1, max_epochs=2)
    strategy = lambda: TensorParallelStrategy(start_method="fork", save_distributed_checkpoint=sharded)  # noqa: E731
    full = fit(strategy(), Net(copy.deepcopy(net), data, momentum=0.9), callbacks=[ckpt], enable_checkpointing=True,
               **common)  # fmt: skip
    first = tmp_path / "epoch=0.ckpt"
    resumed = fit(strategy(), Net(copy.deepcopy(net), data, momentum=0.9), ckpt_path=str(first), **common)
    want = dict(full.lightning_module.named_parameters())
    _assert_close(dict(resumed.lightning_module.named_parameters()), want, atol=0)
    if sharded:
        assert first.is_dir() and {"__0_0.distcp", "__1_0.distcp", "meta.pt"} <= {p.name for p in first.iterdir()}
        return
    loaded = Net.load_from_checkpoint(tmp_path / "epoch=1.ckpt", net=copy.deepcopy(net), data=data)
    _assert_close(dict(loaded.named_parameters()), want, atol=0)
    saved = torch.load(first, weights_only=False)
    assert saved["pdist"]["plan"]["net.encoder.bert.encoder.layer.0.intermediate.dense"] == "colwise"
    assert saved["pdist"]["tensor_parallel_size"] == 2 and saved["pdist"]["comm_meter"]["total_bytes"] > 0
    assert saved["optimizer_states"][0]["state"]  # the momentum buffers, full


@pytest.mark.parametrize(
    ("kwargs", "devices", "error", "message"),
    [
        ({"tensor_parallel_size": 3}, 2, ValueError,
         r"TensorParallelStrategy\(tensor_parallel_size=3, data_parallel_size=None\): tensor_parallel_size must "
         r"divide the world size 2 \(devices=2 x num_nodes=1\)"),
        ({"tensor_parallel_size": 2, "data_parallel_size": 2}, 2, ValueError,
         r"tensor_parallel_size x data_parallel_size = 4 must equal the world size 2"),
        ({"data_parallel_size": 3}, 2, ValueError, r"data_parallel_size must divide the world size 2"),
    ],
)
def test_sizes_that_do_not_multiply_to_the_world_size_are_refused_before_any_process_starts(kwargs, devices, error,
                                                                                            message):  # fmt: skip
    """Sizes are checked when the Trainer is built, naming both sizes and the world size."""
    with pytest.raises(error, match=message):
        Trainer(accelerator="cpu", devices=devices, strategy=TensorParallelStrategy(**kwargs), logger=False)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"tensor_parallel_size": 0}, ValueError, r"TensorParallelStrategy\(tensor_parallel_size=0\): "
                                                  r"tensor_parallel_size must be >= 1 or None"),
        ({"data_parallel_size": 2.0}, TypeError, r"data_parallel_size=2.0\): data_parallel_size must be an int"),
        ({"plan": "megatron"}, ValueError, r"plan='megatron'\): plan must be one of \('auto', 'hybrid'\) or a dict"),
        ({"plan": {"net.1": "diagonal"}}, ValueError, r"placement must be one of"),
        ({"plan": {"net.1": "replicate"}}, ValueError, r"the plan shards nothing"),
        ({"plan": ["net.1"]}, TypeError, r"plan must be 'auto', 'hybrid' or a dict of placements"),
        ({"gather_on_teardown": "yes"}, TypeError, r"gather_on_teardown='yes'\): gather_on_teardown must be a bool"),
        ({"sequence_parallel": 1}, TypeError, r"sequence_parallel=1\): sequence_parallel must be a bool"),
        ({"start_method": "thread"}, ValueError, r"start_method must be 'popen', 'spawn', 'fork' or 'forkserver'"),
    ],
)
def test_bad_arguments_are_refused_at_construction(kwargs, error, message):
    """Every bad value names the argument, the value and the rule."""
    with pytest.raises(error, match=message):
        TensorParallelStrategy(**kwargs)


@pytest.mark.parametrize(
    ("net", "data", "plan", "message"),
    [
        (_mlp, lambda: _features(), {"net.7": "colwise"}, r"module 'net.7' is not in Net; did you mean 'net.5'"),
        (lambda: nn.Sequential(nn.Linear(12, 15), nn.ReLU(), nn.Linear(15, 3)), lambda: _features(), "auto",
         r"module 'net.0' \(Linear 12->15\): out_features=15 must be divisible by tensor_parallel_size=2"),
    ],
)
def test_plans_that_do_not_fit_the_module_are_refused_at_setup(net, data, plan, message):
    """A plan naming a missing module, or a dimension not divisible by t, stops every rank at setup, named."""
    with pytest.raises(Exception, match=message):
        fit(TensorParallelStrategy(plan=plan, start_method="fork"), Net(net(), data()), max_steps=1)
