"""Tier 3: fp16 mixed precision with a GradScaler under PipelineStrategy (PipelineMixedPrecision), 2 stages on 2 ranks.

``Fp32Regression`` computes its network in fp32 inside the fp16 autocast: a power-of-two loss scale ``S`` then scales
every product and sum without rounding, so the scaled gradients are exactly ``S·g`` and a loss-scaled run must equal
the fp32 run bit for bit; skipped updates and scales are checked against plain torch's GradScaler.
"""

import json
import warnings
from pathlib import Path

import pytest
import torch
from _helpers import SnapshotParams, TinyRegression, fit, load_snapshot, rank_batches, regression_data
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_pdist import PipelineStrategy
from lightning_pdist.pipeline.precision import PipelineMixedPrecision

LR, BS, N, M = 0.1, 4, 64, 2


class Fp32Linear(nn.Linear):
    """A Linear that autocast leaves in fp32."""

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            return super().forward(x.float())


def fp32_net():
    torch.manual_seed(0)
    return nn.Sequential(Fp32Linear(4, 8), nn.Tanh(), Fp32Linear(8, 8), nn.Tanh(), Fp32Linear(8, 2))


def fp16_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


class Regression(TinyRegression):
    """MSE regression on ``make()``'s network; ``overflow_at=step`` makes that step's first micro-batch loss infinite."""

    def __init__(self, make=fp32_net, overflow_at=None, overflow_rank=None, **kwargs):
        super().__init__(**kwargs)
        self.net, self.overflow_at, self.overflow_rank, self.seen = make(), overflow_at, overflow_rank, 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)  # autocast runs mse_loss in fp32
        if self.trainer.global_step == self.overflow_at and self.overflow_rank in (None, self.global_rank):
            self.seen += 1  # the last stage calls training_step once per micro-batch
            if self.seen == 1:
                loss = loss * float("inf")
        return loss


def _plugin(init_scale=2.0**10, growth_interval=2):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's GradScaler on CPU may warn
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
        return MixedPrecision("16-mixed", "cpu", scaler=scaler)


def pipeline(**kwargs):
    kwargs.setdefault("num_microbatches", M)
    return PipelineStrategy(start_method="fork", num_stages=2, **kwargs)


class RecordScaling(Callback):
    """Each rank writes its scale after every step, its skipped updates and its scaler state to dirpath/scaling{r}.json."""

    def __init__(self, dirpath):
        self.dirpath, self.scales = Path(dirpath), []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.scales.append(trainer.precision_plugin.scaler.get_scale())

    def on_fit_end(self, trainer, pl_module):  # after the strategy's final drain (2bw's last steps land there)
        plugin = trainer.precision_plugin
        record = {"plugin": type(plugin).__name__, "scales": self.scales, "skipped": plugin.skipped_steps,
                  "scaler": plugin.scaler.state_dict(), "flag_bytes": trainer.strategy.comm_meter.by_kind.get("overflow_flag", 0)}  # fmt: skip
        (self.dirpath / f"scaling{trainer.global_rank}.json").write_text(json.dumps(record))


def _records(dirpath, world=2):
    return [json.loads((Path(dirpath) / f"scaling{r}.json").read_text()) for r in range(world)]


def reference_run(steps, overflow_at=None, init_scale=2.0**10, growth_interval=2):
    """Plain torch: one process, the whole network, GradScaler over gradients accumulated on ``M`` micro-batches."""
    net = fp32_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    scales, batches = [], rank_batches(regression_data(N), 0, 1, BS)
    for t in range(steps):
        x, y = batches[t % len(batches)]
        optimizer.zero_grad()
        for j, (xm, ym) in enumerate(zip(x.tensor_split(M), y.tensor_split(M))):
            loss = nn.functional.mse_loss(net(xm), ym)
            if t == overflow_at and j == 0:
                loss = loss * float("inf")
            scaler.scale(loss / M).backward()
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return net, scales


def reference_2bw(steps, overflow_at=None, init_scale=2.0**10, growth_interval=2, m=M):
    """Plain torch PipeDream-2BW with a GradScaler: batch ``t`` computes on version ``max(0, t-1)``; a skipped update
    is a version equal to the one before it. Returns the network and the scaler's final state."""
    net = fp32_net()
    names = [n for n, _ in net.named_parameters()]
    current = [nn.Parameter(p.detach().clone()) for p in net.parameters()]
    optimizer = torch.optim.SGD(current, lr=LR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    versions, batches = [[p.detach().clone() for p in current]], rank_batches(regression_data(N), 0, 1, BS)
    for t in range(steps):
        x, y = batches[t % len(batches)]
        w = [v.clone().requires_grad_() for v in versions[max(0, t - 1)]]
        for j, (xm, ym) in enumerate(zip(x.tensor_split(m), y.tensor_split(m))):
            loss = nn.functional.mse_loss(torch.func.functional_call(net, dict(zip(names, w)), (xm,)), ym)
            if t == overflow_at and j == 0:
                loss = loss * float("inf")
            scaler.scale(loss / m).backward()
        for p, leaf in zip(current, w):
            p.grad = leaf.grad
        scaler.step(optimizer)  # skipped on Inf/NaN
        scaler.update()
        versions.append([p.detach().clone() for p in current])
    with torch.no_grad():
        for p, v in zip(net.parameters(), current):
            p.copy_(v)
    return net, scaler.state_dict()


def _flat(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "2bw"])
def test_scaled_run_equals_the_fp32_run_exactly(tmp_path, schedule):
    """No overflow: the loss-scaled pipeline (scale growing every 2 updates) equals the fp32 pipeline bit for bit."""
    fp32, fp16 = Regression(lr=LR), Regression(lr=LR)
    fit(pipeline(schedule=schedule), fp32, max_steps=6)
    fit(pipeline(schedule=schedule), fp16, max_steps=6, plugins=[_plugin()], callbacks=[RecordScaling(tmp_path)])
    assert torch.equal(_flat(fp16), _flat(fp32))
    records = _records(tmp_path)
    assert [r["plugin"] for r in records] == ["PipelineMixedPrecision"] * 2
    assert records[0]["scaler"] == records[1]["scaler"]
    assert records[0]["scaler"]["scale"] == reference_run(6)[1][-1] == 2.0**13  # grown 3 times, on both stages
    if schedule != "2bw":  # 2bw's steps land later on the first stage: per-step scales differ between stages
        assert records[0]["scales"] == records[1]["scales"] == reference_run(6)[1]
    assert [r["skipped"] for r in records] == [0, 0]
    assert records[0]["flag_bytes"] > 0  # the agreement is counted in the pipeline's comm bytes


def test_fp16_autocast_run_is_close_to_the_fp32_run(tmp_path):
    """A network computed in fp16 by autocast ends within fp16 tolerance of the fp32 run, no update skipped."""
    fp32, fp16 = Regression(make=fp16_net, lr=LR), Regression(make=fp16_net, lr=LR)
    fit(pipeline(), fp32, max_steps=6)
    fit(pipeline(), fp16, max_steps=6, plugins=[_plugin(init_scale=2.0**16, growth_interval=2000)],
        callbacks=[RecordScaling(tmp_path)])  # fmt: skip
    records = _records(tmp_path)
    assert [r["skipped"] for r in records] == [0, 0]
    assert records[0]["scales"] == records[1]["scales"] == [2.0**16] * 6  # never backed off: no overflow, no skip
    # fp16 rounds each activation and gradient to 11 significant bits (u = 2**-11 ~ 4.9e-4 relative); an update is
    # lr * g with |g| < 1 here, so each step moves a weight by at most ~0.1 * 4.9e-4 ~ 5e-5 more than fp32 does, and
    # 6 steps by at most ~3e-4 (measured: 3.8e-5). The run did compute in fp16: it is not the fp32 run.
    torch.testing.assert_close(_flat(fp16), _flat(fp32), atol=3e-4, rtol=0)
    assert not torch.equal(_flat(fp16), _flat(fp32))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_overflow_on_one_microbatch_skips_the_update_on_every_rank(tmp_path, schedule):
    """An infinite loss on one micro-batch of step 2 (last stage only): both stages skip and back off, as plain torch."""
    module = Regression(lr=LR, overflow_at=2)
    fit(pipeline(schedule=schedule), module, max_steps=6, plugins=[_plugin()], callbacks=[RecordScaling(tmp_path)])
    expected, scales = reference_run(6, overflow_at=2)
    records = _records(tmp_path)
    assert [r["skipped"] for r in records] == [1, 1]
    assert records[0]["scales"] == records[1]["scales"] == scales
    assert scales[2] == scales[1] / 2  # the back-off
    assert records[0]["scaler"] == records[1]["scaler"]
    assert torch.equal(_flat(module), _flat(expected))


def test_2bw_overflow_skips_the_update_on_every_rank_as_plain_torch(tmp_path):
    """2bw: an infinite loss on one micro-batch of step 2 makes both stages skip update 2 and back off, as plain-torch 2BW."""
    module = Regression(lr=LR, overflow_at=2)
    fit(pipeline(schedule="2bw"), module, max_steps=6, plugins=[_plugin()], callbacks=[RecordScaling(tmp_path)])
    expected, scaler_state = reference_2bw(6, overflow_at=2)
    records = _records(tmp_path)
    assert [r["skipped"] for r in records] == [1, 1]
    assert records[0]["scaler"] == records[1]["scaler"] == scaler_state
    assert torch.equal(_flat(module), _flat(expected))


def test_2bw_overflow_on_three_stages(tmp_path):
    """2bw on 3 stages (a middle stage waits on flags too): one infinite loss skips update 2 on all three, as plain torch."""
    module = Regression(lr=LR, overflow_at=2)
    strategy = PipelineStrategy(start_method="fork", schedule="2bw", num_microbatches=3, split_points=["net.2", "net.4"])
    fit(strategy, module, devices=3, max_steps=5, plugins=[_plugin()], callbacks=[RecordScaling(tmp_path)])
    expected, scaler_state = reference_2bw(5, overflow_at=2, m=3)
    records = _records(tmp_path, world=3)
    assert [r["skipped"] for r in records] == [1, 1, 1]
    assert all(r["scaler"] == scaler_state for r in records)
    torch.testing.assert_close(_flat(module), _flat(expected), atol=1e-6, rtol=0)


def test_2bw_short_batches_are_refused_under_the_scaler():
    """2bw with 16-mixed: a batch with fewer micro-batches than stages is refused (flags could wait across steps)."""
    with pytest.raises(Exception, match=r"schedule='2bw'\): a batch of 1 samples gives 1 micro-batches, fewer than num_stages \(2\)"):
        fit(pipeline(schedule="2bw"), Regression(batch_size=1), max_steps=1, plugins=[_plugin()])


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_overflow_on_one_replica_skips_the_update_on_all_four_ranks(tmp_path, schedule):
    """2 stages x 2 replicas: an infinite loss on replica 1's last stage only makes all four ranks skip and back off alike."""
    module = Regression(lr=LR, overflow_at=2, overflow_rank=3)  # rank 3: stage 1 of replica 1
    fit(pipeline(schedule=schedule), module, devices=4, max_steps=4, plugins=[_plugin()], callbacks=[RecordScaling(tmp_path)])
    records = _records(tmp_path, world=4)
    assert [r["skipped"] for r in records] == [1] * 4
    scales = reference_run(4, overflow_at=2)[1]
    assert all(r["scaler"]["scale"] == scales[-1] for r in records)
    if schedule == "1f1b":
        assert all(r["scales"] == scales for r in records)


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_resume_is_exact(tmp_path, schedule):
    """Resumed from a mid-run checkpoint (scale and growth tracker saved by Lightning), each stage ends where the run ends."""
    make = lambda: Regression(lr=0.05, momentum=0.9, n=12, overflow_at=4)  # noqa: E731  # 3 steps per epoch
    strategy = lambda: pipeline(schedule=schedule)  # noqa: E731
    ckpt_run, resumed = tmp_path / "ckpt", tmp_path / "resumed"
    ckpt_run.mkdir(), resumed.mkdir()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=False)
    fit(strategy(), make(), max_steps=8, plugins=[_plugin()], enable_checkpointing=True, limit_val_batches=1,
        callbacks=[SnapshotParams(ckpt_run), RecordScaling(ckpt_run), checkpoint])  # fmt: skip
    first = tmp_path / "ckpts" / "epoch=0-step=3.ckpt"
    assert torch.load(first, weights_only=False)["PipelineMixedPrecision"]["_growth_tracker"] == 1  # mid-interval
    fit(strategy(), make(), max_steps=8, plugins=[_plugin()], ckpt_path=str(first), limit_val_batches=1,
        callbacks=[SnapshotParams(resumed), RecordScaling(resumed)])  # fmt: skip
    for rank in range(2):
        assert torch.equal(load_snapshot(resumed, rank, 8), load_snapshot(ckpt_run, rank, 8))
    full, tail = _records(ckpt_run), _records(resumed)
    for r in range(2):
        assert tail[r]["scales"] == full[r]["scales"][3:]
        assert tail[r]["scaler"] == full[r]["scaler"]
    assert [r["skipped"] for r in full] == [1, 1]


def test_pipedream_refuses_the_scaler():
    """pipedream cannot agree on a skip without breaking its schedule: refused at setup, naming the schedule and the reason."""
    match = (r"PipelineStrategy\(schedule='pipedream'\): precision with a gradient scaler \(16-mixed\) is not supported: "
             r"each stage updates right after its own backward of a micro-batch")  # fmt: skip
    with pytest.raises(Exception, match=match):
        fit(pipeline(schedule="pipedream"), Regression(), max_steps=1, plugins=[_plugin()])


def test_fused_optimizer_is_refused():
    """An optimizer that unscales inside step() (fused Adam) is refused under 16-mixed: no agreement could come first."""

    class Fused(Regression):
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), fused=True)

    with pytest.raises(Exception, match=r"Adam unscales its gradients inside step\(\) \(a fused optimizer\)"):
        fit(pipeline(), Fused(), max_steps=1, plugins=[_plugin()])


def test_other_scaled_plugins_are_refused():
    """A precision plugin with a scaler that is not Lightning's MixedPrecision is refused, naming it."""
    from lightning.pytorch.plugins.precision import Precision

    class ScalerPrecision(Precision):
        scaler = object()

    with pytest.raises(Exception, match=r"the precision plugin ScalerPrecision has a gradient scaler"):
        fit(pipeline(), Regression(), max_steps=1, plugins=[ScalerPrecision()])


def test_the_plugin_needs_a_scaler():
    """PipelineMixedPrecision without a scaler is refused: it exists for one."""
    with pytest.raises(ValueError, match=r"PipelineMixedPrecision\(precision='16-mixed', scaler=None\): it exists for a GradScaler"):
        PipelineMixedPrecision("16-mixed", "cpu", None)
