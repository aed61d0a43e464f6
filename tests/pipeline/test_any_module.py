"""Any module pipelines (no nn.Sequential): the cut at named submodules, its refusals, and a reference run.

``Blocks`` keeps its blocks in an ``nn.ModuleList`` called in a loop with a residual connection, its
parameters directly on the LightningModule (the network is the module itself, called as ``self(x)``).
Split at ``"blocks.2"`` on 2 real ranks, GPipe and 1F1B equal one-process SGD with the gradients
accumulated over the micro-batches, written below in plain torch.
"""

import pytest
import torch
from _dni_reference import dni_reference
from _helpers import TinyRegression, fit, rank_batches, regression_data
from lightning.pytorch import Callback
from torch import nn

from lightning_pdist import PipelineStrategy
from lightning_pdist.pipeline.stages import OwnedSplit

LR, BS, STEPS = 0.1, 4, 6


class Blocks(TinyRegression):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        del self.net
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.out(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train/loss", loss)
        return loss


class Skip(Blocks):
    """The input layer's output joins again after the last block: a connection around any cut between them."""

    def forward(self, x):
        h0 = h = self.inp(x)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.out(h + h0)


def reference(steps, m):
    """Plain torch: the same weights, forward written out, mean loss over m micro-batches, one SGD step per batch."""
    torch.manual_seed(0)
    inp, blocks, out = nn.Linear(4, 8), [nn.Linear(8, 8) for _ in range(4)], nn.Linear(8, 2)
    params = [p for layer in (inp, *blocks, out) for p in layer.parameters()]
    for x, y in steps:
        grads = [torch.zeros_like(p) for p in params]
        for xm, ym in zip(x.tensor_split(m), y.tensor_split(m)):
            h = inp(xm)
            for block in blocks:
                h = h + torch.tanh(block(h))
            loss = nn.functional.mse_loss(out(h), ym) / m
            for g, d in zip(grads, torch.autograd.grad(loss, params)):
                g += d
        with torch.no_grad():
            for p, g in zip(params, grads):
                p -= LR * g
    return torch.cat([p.detach().reshape(-1) for p in params])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_blocks_in_a_module_list_split_at_blocks_2_equal_one_process_sgd(schedule):
    module = Blocks(lr=LR)
    trainer = fit(PipelineStrategy(schedule=schedule, num_microbatches=2, split_points=["blocks.2"], start_method="fork"), module,
        max_steps=STEPS)  # fmt: skip
    data = regression_data(64)
    steps = [rank_batches(data, 0, 1, BS)[t] for t in range(STEPS)]
    got = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    torch.testing.assert_close(got, reference(steps, 2), atol=1e-6, rtol=0)
    assert trainer.callback_metrics["pdist/pipeline/stage1/comm_bytes"] > 0  # two stages exchanged activations


def _plan(module, points, stages=2):
    split = OwnedSplit(module, stages, 0, points)
    split.plan(((torch.randn(4, 4),), {}))
    return split


def test_split_points_are_checked_against_the_forward():
    """Not a submodule, out of execution order, called twice, a connection around the cut: refused, named."""
    with pytest.raises(ValueError, match=r"split_points=\[..., 'blocks.9', ...\]\): 'blocks.9' is not a submodule"):
        _plan(Blocks(), ["blocks.9"])
    with pytest.raises(ValueError, match=r"'blocks.1' runs before 'blocks.3' in the forward; list split points in execution order"):
        _plan(Blocks(), ["blocks.3", "blocks.1"], stages=3)
    with pytest.raises(ValueError, match=r"'blocks' is called 0 times|'blocks' is never called"):
        _plan(Blocks(), ["blocks"])
    with pytest.raises(ValueError, match=r"after split point 'blocks.2' uses a value computed before it that is not among"):
        _plan(Skip(), ["blocks.2"])


def test_auto_balances_parameters_and_skips_cuts_the_forward_cannot_carry():
    split = _plan(Blocks(), None, stages=3)
    assert split.partition.names == ("blocks.1", "blocks.3")  # 40 + 72 | 144 | 72 + 18 parameters
    assert split.partition.weights == (112.0, 144.0, 90.0)
    # h0 crosses blocks.1..3 around them (refused, tried first); at blocks.0 it is that block's own input
    skip = _plan(Skip(), None)
    assert skip.partition.names == ("blocks.0",) and skip.partition.weights == (40.0, 306.0)


def _every_schedule(rank, world_size, out):
    import os
    import warnings

    from lightning.pytorch import Trainer, seed_everything

    from tests.conformance.modules import MODULES

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import torch.distributed as dist

    results = {}
    for name in ("blocks", "transformer_lm", "hf_bert"):  # DNI on a packed (split_points) boundary
        seed_everything(0, verbose=False)
        module = Blocks(lr=LR) if name == "blocks" else MODULES[name].make()
        before = {id(p): p.detach().clone() for p in module.parameters()}
        probe = _DniProbe(before)
        strategy = PipelineStrategy(schedule="pipedream", synthetic_gradients=True, num_microbatches=2,
                                    split_points=["blocks.2"] if name == "blocks" else None)  # fmt: skip
        Trainer(accelerator="cpu", devices=world_size, max_steps=4, logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                limit_val_batches=0, callbacks=[probe], strategy=strategy).fit(module)  # fmt: skip
        after = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
        gathered = [None] * world_size
        dist.all_gather_object(gathered, after)
        results[f"dni-{name}"] = {**probe.out, "same": bool(torch.equal(gathered[0], gathered[1])), "params": after}
    for schedule in ("gpipe", "pipedream", "2bw"):
        for name in ("boring", "transformer_lm", "hf_bert"):
            seed_everything(0, verbose=False)
            module = MODULES[name].make()
            before = torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])
            trainer = Trainer(accelerator="cpu", devices=world_size, max_steps=4, logger=False, enable_checkpointing=False,
                              enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                              limit_val_batches=1, strategy=PipelineStrategy(schedule=schedule, num_microbatches=2))  # fmt: skip
            trainer.fit(module)
            after = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
            gathered = [None] * world_size
            dist.all_gather_object(gathered, after)
            loss = trainer.callback_metrics.get("train_loss", trainer.callback_metrics.get("pdist/comm_bytes"))
            results[f"{schedule}-{name}"] = (bool(torch.equal(gathered[0], gathered[1])), bool((after - before).abs().max() > 0),
                                             bool(torch.isfinite(after).all()), float(trainer.callback_metrics["pdist/pipeline/stage0/comm_bytes"]))  # fmt: skip
    if rank == 0:
        torch.save(results, out)


class _DniProbe(Callback):
    """Stage 0 at the end of training (drained): whether its weights moved, and its synthetic modules."""

    def __init__(self, before):
        self.before, self.out = before, {}

    def on_train_end(self, trainer, pl_module):
        strategy = trainer.strategy
        strategy.drain()
        if strategy.stage == 0:
            synthetic = strategy.executor.synthetic
            own = list(strategy.split.stage_module.parameters())
            self.out = {"stage0_moved": all(bool((p - self.before[id(p)]).abs().max() > 0) for p in own if p.ndim > 1),
                        "modules": [type(m).__name__ for m in synthetic.module], "steps": synthetic.steps,
                        "synth": [p.detach().clone() for p in synthetic.module.parameters()]}  # fmt: skip


def test_boring_demo_transformer_and_bert_train_under_gpipe_pipedream_and_2bw(tmp_path):
    """One launch, nine fits (1f1b: the conformance matrix): both ranks end equal, weights moved and finite, the stages
    exchanged. The same launch runs DNI (``synthetic_gradients=True``) on three ``split_points`` cuts, whose boundary is
    one packed vector: ``Blocks`` at ``"blocks.2"`` ends where the plain-torch DNI reference ends (weights and stage 0's
    synthetic module); the demo Transformer (an ``-inf`` causal mask crosses its cut) and BERT (an additive mask)
    train, finite, with one synthetic module on stage 0 per value that carries a gradient (masks carry none), which
    moved stage 0's weights."""
    from _ranks import run_ranks

    run_ranks(_every_schedule, 2, tmp_path, tmp_path / "results.pt", timeout=300)
    results = torch.load(tmp_path / "results.pt", weights_only=False)
    assert len(results) == 12
    for cell, result in results.items():
        if cell.startswith("dni-"):
            assert result["same"] and bool(torch.isfinite(result["params"]).all()), cell
            # one zero linear map per value with a gradient (the demo Transformer's decoder cut carries tgt and memory)
            assert set(result["modules"]) == {"Linear"} and result["steps"] == 8 and result["stage0_moved"], (cell, result)
            assert len(result["modules"]) == {"dni-blocks": 1, "dni-transformer_lm": 2}.get(cell, len(result["modules"]))
            continue
        same, moved, finite, sent = result
        assert same and moved and finite and sent > 0, (cell, same, moved, finite, sent)
    data = regression_data(64)
    mbs = [mb for t in range(4) for mb in zip(*(v.tensor_split(2) for v in rank_batches(data, 0, 1, BS)[t]))]
    torch.manual_seed(0)
    inp, blocks, out = nn.Linear(4, 8), [nn.Linear(8, 8) for _ in range(4)], nn.Linear(8, 2)
    stages = [_Residual(inp, blocks[:2]), _Residual(None, blocks[2:], out)]
    weights, synth = dni_reference(None, mbs, LR, 0.0, lambda p: torch.optim.Adam(p, lr=1e-4), stages=stages)
    dni = results["dni-blocks"]
    torch.testing.assert_close(dni["params"], torch.cat([t.reshape(-1) for st in weights for t in st]), atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.cat([t.reshape(-1) for t in dni["synth"]]), torch.cat([t.reshape(-1) for t in synth[0]]),
                               atol=1e-6, rtol=0)  # fmt: skip


class _Residual(nn.Module):
    """``Blocks``' forward from its input layer (or a received ``h``) through some blocks (and its output layer)."""

    def __init__(self, inp, blocks, out=None):
        super().__init__()
        self.inp, self.blocks, self.out = inp, nn.ModuleList(blocks), out

    def forward(self, h):
        h = self.inp(h) if self.inp is not None else h
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.out(h) if self.out is not None else h


def test_split_points_auto_and_bad_types_at_construction():
    assert PipelineStrategy(split_points="auto").config.split_points is None  # balanced by parameters
    with pytest.raises(TypeError, match=r"PipelineStrategy\(split_points='blocks.2'\): split_points must be a list"):
        PipelineStrategy(split_points="blocks.2")
    with pytest.raises(ValueError, match=r"split_points=\[..., 'blocks.9', ...\]\): 'blocks.9' is not a submodule of Blocks"):
        OwnedSplit(Blocks(), 2, 0, ["blocks.9"])  # at setup, before any batch


def _stages(net, point, x):
    """Stage 0 and stage 1 of copies of ``net`` cut at ``point``, planned on the call ``net(x)``."""
    import copy

    stages = []
    for s in range(2):
        split = OwnedSplit(copy.deepcopy(net), 2, s, [point])
        split.plan(((x,), {}))
        stages.append(split.stage_module)
    return stages


def _last_stage(first, last, x, key):
    """Stage 1's output on ``x`` (stage 0's boundary as its input) and the gradients of its sum (boundary, weights)."""
    from torch.utils._pytree import tree_flatten

    from lightning_pdist.pipeline.ownership import pack

    boundary = first(pack(key, [x])).detach().requires_grad_()
    last.calls[key] = ((x,), {})
    out = [t for t in tree_flatten(last(boundary))[0] if isinstance(t, torch.Tensor)][0]
    return out, torch.autograd.grad(out.sum(), [boundary, *last.parameters()])


def test_a_later_stage_runs_the_earlier_stages_on_meta_once_per_input_shape():
    """BERT cut at its second block: the last stage's first forward of an input shape runs the embeddings and the
    first block on meta (recording their outputs' layout); the next forward of that shape runs neither (no op on
    meta) and gives the same output and gradients, bit for bit; a new sequence length is recorded anew and equals
    the whole network; the first shape still replays."""
    pytest.importorskip("transformers")
    from lightning_pdist.models.encoder import EncoderClassifier

    torch.manual_seed(0)
    net = EncoderClassifier(vocab_size=50, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32, max_len=32,
                            dropout=0.0).eval()  # fmt: skip
    x, short = torch.randint(1, 50, (4, 16)), torch.randint(1, 50, (4, 8))
    first, last = _stages(net, "encoder.bert.encoder.layer.1", x)
    ran = {"embeddings": 0, "layer.0": 0}
    for name, module in (("embeddings", last.net.bert.embeddings), ("layer.0", last.net.bert.encoder.layer[0])):
        module.forward = lambda *a, _f=module.forward, _n=name, **k: (ran.__setitem__(_n, ran[_n] + 1), _f(*a, **k))[1]
    out, grads = _last_stage(first, last, x, 0)
    assert last.meta_ops > 0 and ran == {"embeddings": 1, "layer.0": 1}
    torch.testing.assert_close(out, net.encoder(x).logits, atol=1e-5, rtol=1e-5)
    again, again_grads = _last_stage(first, last, x, 1)
    assert last.meta_ops == 0 and ran == {"embeddings": 1, "layer.0": 1}, (last.meta_ops, ran)
    assert torch.equal(again, out) and all(torch.equal(a, b) for a, b in zip(again_grads, grads))
    sig = last.signatures
    assert (sig.recorded, sig.replayed, sig.failed) == (1, 1, 0)
    got, _ = _last_stage(first, last, short, 2)  # another sequence length: recorded, not replayed
    assert last.meta_ops > 0 and ran == {"embeddings": 2, "layer.0": 2} and sig.recorded == 2
    torch.testing.assert_close(got, net.encoder(short).logits, atol=1e-5, rtol=1e-5)
    for key, (inp, want) in enumerate(((short, got), (x, out)), start=3):
        assert torch.equal(_last_stage(first, last, inp, key)[0], want) and last.meta_ops == 0
    assert (sig.recorded, sig.replayed, sig.failed, ran) == (2, 3, 0, {"embeddings": 2, "layer.0": 2})


class _Gated(Blocks):
    """Whether ``blocks.0`` runs depends on the input's values: a recording made on one branch is stale on the other."""

    def forward(self, x):
        h = self.inp(x)
        if bool(x[0, 0] > 0):
            h = h + torch.tanh(self.blocks[0](h))
        for block in self.blocks[1:]:
            h = h + torch.tanh(block(h))
        return self.out(h)


def test_a_stale_recording_is_thrown_away_and_the_forward_runs_unskipped():
    net = _Gated()
    x = torch.randn(4, 4)
    x[0, 0] = 1.0
    first, last = _stages(net, "blocks.2", x)
    for key in range(2):
        out, _ = _last_stage(first, last, x, key)
    torch.testing.assert_close(out, net(x), atol=1e-6, rtol=0)
    other = x.clone()
    other[0, 0] = -1.0  # same shape, blocks.0 skipped: the replay reaches the split point with a recorded call not made
    for key in (2, 3):
        out, _ = _last_stage(first, last, other, key)
        torch.testing.assert_close(out, net(other), atol=1e-6, rtol=0)
    sig = last.signatures
    assert (sig.recorded, sig.replayed, sig.failed) == (1, 1, 1)  # the signature is never replayed again


def test_a_boundary_packs_as_float32_when_exact_and_every_value_arrives_bit_identical():
    """``pack``'s vector is float32 when float32 holds every value and header entry exactly (an fp32 activation then
    travels as itself), float64 otherwise (int64 positions, a key of 2^24); either way ``unpack`` returns each value
    bit-identical in its own dtype, and the gradient reaches the float values unchanged."""
    from lightning_pdist.pipeline.ownership import gradient_parts, pack, unpack

    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 3, 4, generator=g).requires_grad_()
    mask = torch.rand(2, 1, 4, generator=g) > 0.5
    cases = [([h, mask, h.detach().half(), h.detach().bfloat16(), torch.tensor([-32768, 7, 32767], dtype=torch.int16)], 5,
              torch.float32),  # fmt: skip
             ([h, mask, torch.arange(3) + 2**40], 5, torch.float64), ([h, mask], 1 << 24, torch.float64)]
    for values, key, dtype in cases:
        packed = pack(key, values)
        assert packed.dtype == dtype
        got_key, got = unpack(packed)
        assert got_key == key and [v.dtype for v in got] == [v.dtype for v in values]
        assert all(torch.equal(a, b) for a, b in zip(got, values))
        assert [shape for _, shape in gradient_parts(packed)] == [(2, 3, 4)]
        h.grad = None
        (got[0] * torch.arange(24.0).view(2, 3, 4)).sum().backward()
        assert torch.equal(h.grad, torch.arange(24.0).view(2, 3, 4))


def test_the_stage_mode_flattens_only_ops_that_may_carry_a_meta_tensor():
    """The mode's check before any pytree flatten: real tensors, non-meta devices and scalars pass straight to the op;
    a meta tensor or device, or any container (which could hold one), takes the full path."""
    from lightning_pdist.pipeline.ownership import _plain

    real, meta = torch.ones(2), torch.ones(2, device="meta")
    assert _plain((real, 1, 2.0, None, torch.float32, torch.device("cpu"), slice(0, 1)))
    for bad in ((meta,), (real, [real]), ((real,),), ({"a": real},), (torch.device("meta"),)):
        assert not _plain(bad)
