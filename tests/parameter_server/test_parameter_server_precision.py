"""Tier 3: fp16 mixed precision with a GradScaler under ParameterServerStrategy (ParameterServerMixedPrecision).

``ExactScaling`` computes the module in fp32 inside the fp16 autocast: the scaled gradient is then exactly ``S·g``
(``S`` a power of two scales every product and sum without rounding) and unscaling gives ``g`` back bit for bit, so
a loss-scaled run must equal the fp32 run exactly. Other runs use real fp16 autocast against plain torch.
"""

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from _helpers import SnapshotParams, TinyRegression, fit, load_snapshot, make_net, rank_batches, regression_data
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch import nn

from lightning_pdist import ParameterServerStrategy
from lightning_pdist.core.ps_wire import Kind, loads_state
from lightning_pdist.parameter_server.precision import ParameterServerMixedPrecision
from tests._scaling_reference import reference_scales

LR = 0.05


def ps(**kwargs) -> ParameterServerStrategy:
    """Fork-launched (devices=1 runs use the default launcher instead: in this process, the swapped plugin visible)."""
    return ParameterServerStrategy(start_method="fork", **kwargs)


def _plugin(init_scale=2.0**10, growth_interval=2):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's GradScaler on CPU may warn
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
        return MixedPrecision("16-mixed", "cpu", scaler=scaler)


class Fp16Regression(TinyRegression):
    """TinyRegression; ``overflow_at={(rank, step), ...}`` (0-based global step) makes that rank's loss infinite."""

    def __init__(self, overflow_at=(), **kwargs):
        super().__init__(**kwargs)
        self.overflow_at = set(overflow_at)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if (self.global_rank, self.trainer.global_step) in self.overflow_at:
            loss = loss * float("inf")  # every gradient of this rank becomes Inf/NaN
        return loss


class ExactScaling(Fp16Regression):
    """Fp16Regression computed in fp32 inside the fp16 autocast (scaled gradients exact)."""

    def training_step(self, batch, batch_idx):
        with torch.autocast("cpu", enabled=False):
            return super().training_step(batch, batch_idx)


class AdamExact(ExactScaling):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.02)


class RecordScaling(Callback):
    """Each rank writes its scale after every step, its skips and scaler state to dirpath/scaling{r}.json; rank 0
    adds every server's version, sync step and SSP clocks once all workers finished their steps."""

    def __init__(self, dirpath):
        self.dirpath, self.scales = Path(dirpath), []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.scales.append(trainer.precision_plugin.scaler.get_scale())

    def on_train_end(self, trainer, pl_module):
        plugin, strategy = trainer.precision_plugin, trainer.strategy
        record = {"plugin": type(plugin).__name__, "scales": self.scales, "skipped": plugin.skipped_steps,
                  "scaler": plugin.scaler.state_dict()}  # fmt: skip
        strategy.barrier()  # every worker pushed its last gradient
        if trainer.global_rank == 0:
            states = [loads_state(p) for _, p in strategy.client.map(Kind.GET_STATE, [{}] * strategy.client.num_servers)]
            record["servers"] = [{"version": s["version"], "aggregator": s["aggregator"], "clock": s["clock"],
                                  "histogram": s["histogram"]} for s in states]  # fmt: skip
        (self.dirpath / f"scaling{trainer.global_rank}.json").write_text(json.dumps(record))


def _records(dirpath, world=2):
    return [json.loads((Path(dirpath) / f"scaling{r}.json").read_text()) for r in range(world)]




def reference_sync(steps, lr, momentum=0.0, overflow_at=(), autocast=True, init_scale=2.0**10, growth_interval=2):
    """Plain torch, DDP-style: the mean of 2 ranks' scaled gradients, ``scaler.step``/``update`` of a real GradScaler.

    Returns (flat parameters after every step, the scale after every step).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        net = make_net()
        params = list(net.parameters())
        opt = torch.optim.SGD(params, lr=lr, momentum=momentum)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
        batches = [rank_batches(regression_data(), r, 2, 4) for r in range(2)]
        history, scales = [], []
        for t in range(steps):
            grads = []
            for r in range(2):
                net.zero_grad()
                x, y = batches[r][t]
                with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
                    loss = nn.functional.mse_loss(net(x), y)
                if (r, t) in overflow_at:
                    loss = loss * float("inf")
                scaler.scale(loss).backward()
                grads.append([p.grad.clone() for p in params])
            for p, (g0, g1) in zip(params, zip(*grads)):
                p.grad = (g0 + g1) / 2
            scaler.step(opt)  # unscales the mean, skips the step on Inf/NaN
            scaler.update()
            history.append(torch.cat([p.detach().reshape(-1) for p in params]).clone())
            scales.append(scaler.get_scale())
        return history, scales
    finally:
        torch.set_num_threads(threads)


def test_grad_scaler_plugin_is_swapped_keeping_the_users_scaler():
    """A MixedPrecision with a GradScaler becomes ParameterServerMixedPrecision at setup, with the user's scaler."""
    plugin = _plugin(init_scale=2.0**8, growth_interval=3)
    scaler = plugin.scaler
    trainer = fit(ParameterServerStrategy(), ExactScaling(lr=LR), devices=1, max_steps=4, plugins=[plugin])
    swapped = trainer.precision_plugin
    assert isinstance(swapped, ParameterServerMixedPrecision) and swapped.scaler is scaler
    assert (swapped.precision, swapped.device) == ("16-mixed", "cpu")
    # 4 good steps, growth every 3: one growth, tracker at 1; nothing skipped.
    assert scaler.state_dict() == {"scale": 2.0**9, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3,
                                   "_growth_tracker": 1}  # fmt: skip
    assert swapped.skipped_steps == 0


def test_loss_scaled_run_without_overflow_equals_the_fp32_run(tmp_path):
    """Sync, Adam on 2 servers: with no overflow the loss-scaled run (scale growing every 2 steps) equals the fp32 run
    exactly on both workers, since the pushed gradient is S·g divided by S (exact for a power of two)."""
    scaled, plain = tmp_path / "scaled", tmp_path / "plain"
    for d in (scaled, plain):
        d.mkdir()
    fit(ps(num_servers=2), AdamExact(), max_steps=6, callbacks=[SnapshotParams(scaled), RecordScaling(scaled)],
        plugins=[_plugin()])  # fmt: skip
    fit(ps(num_servers=2), AdamExact(), max_steps=6, callbacks=[SnapshotParams(plain)])
    for t in range(1, 7):
        for r in range(2):
            torch.testing.assert_close(load_snapshot(scaled, r, t), load_snapshot(plain, r, t), atol=0, rtol=0)
    for record in _records(scaled):
        assert record["plugin"] == "ParameterServerMixedPrecision" and record["skipped"] == 0
        assert record["scales"] == reference_scales(2.0**10, 6, 2)


def test_sync_overflow_on_one_worker_skips_the_step_on_every_worker(tmp_path):
    """Real fp16 autocast, an Inf loss on worker 1 at step 2 only: both workers skip step 2 (no server steps: every
    server's version and sync step stay one behind), and both scales back off identically, as plain torch with a
    GradScaler on the mean gradient (DDP) does."""
    fit(ps(num_servers=2), Fp16Regression(overflow_at={(1, 1)}, lr=LR, momentum=0.9), max_steps=6,
        callbacks=[SnapshotParams(tmp_path), RecordScaling(tmp_path)], plugins=[_plugin()])  # fmt: skip
    history, scales = reference_sync(6, LR, momentum=0.9, overflow_at={(1, 1)})
    assert scales[:3] == [2.0**10, 2.0**9, 2.0**9] and scales == reference_scales(2.0**10, 6, 2, {2})
    for t, expected in enumerate(history, start=1):
        for r in range(2):
            torch.testing.assert_close(load_snapshot(tmp_path, r, t), expected, atol=1e-6, rtol=0,
                                       msg=lambda m: f"worker {r} step {t}: {m}")  # fmt: skip
    torch.testing.assert_close(load_snapshot(tmp_path, 0, 2), load_snapshot(tmp_path, 0, 1), atol=0, rtol=0)
    records = _records(tmp_path)
    for record in records:
        assert record["scales"] == scales and record["skipped"] == 1
    for server in records[0]["servers"]:
        assert server["version"] == 5 and server["aggregator"] == {"step": 5, "num_dropped": 0}


def test_async_overflow_skips_only_that_workers_push(tmp_path):
    """Async, 2 workers, an Inf loss on worker 1 at step 2: worker 1 alone skips its push and backs its own scale
    off; worker 0 pushes every step with its scale untouched; the servers applied 6 + 5 pushes."""
    fit(ps(mode="async"), ExactScaling(overflow_at={(1, 1)}, lr=LR), max_steps=6, callbacks=[RecordScaling(tmp_path)],
        plugins=[_plugin()])  # fmt: skip
    worker0, worker1 = _records(tmp_path)
    assert worker0["skipped"] == 0 and worker0["scales"] == reference_scales(2.0**10, 6, 2)
    assert worker1["skipped"] == 1 and worker1["scales"] == reference_scales(2.0**10, 6, 2, {2})
    (server,) = worker0["servers"]
    assert server["version"] == 11 and sum(server["histogram"]) == 11


def test_async_overflow_drops_that_steps_gradient_only():
    """One async worker, push_every=2: the overflowed step 2 adds nothing, step 1's gradient is still pushed on time;
    the weights follow plain torch with step 2's gradient removed."""
    model = ExactScaling(overflow_at={(0, 1)}, lr=LR)
    trainer = fit(ParameterServerStrategy(mode="async", push_every=2), model, devices=1, max_steps=6, plugins=[_plugin()])
    assert trainer.precision_plugin.skipped_steps == 1
    server, local = make_net(), make_net()
    batches = rank_batches(regression_data(64), rank=0, world_size=1, batch_size=4)
    acc = None
    for t in range(1, 7):
        if t != 2:
            local.zero_grad()
            x, y = batches[t - 1]
            nn.functional.mse_loss(local(x), y).backward()
            g = torch.cat([p.grad.reshape(-1) for p in local.parameters()])
            acc = g if acc is None else acc + g
        if t % 2 == 0:
            w = torch.nn.utils.parameters_to_vector(server.parameters()) - LR * acc
            torch.nn.utils.vector_to_parameters(w, server.parameters())
            acc = None
        torch.nn.utils.vector_to_parameters(torch.nn.utils.parameters_to_vector(server.parameters()), local.parameters())
    expected = torch.nn.utils.parameters_to_vector(server.parameters())
    torch.testing.assert_close(torch.nn.utils.parameters_to_vector(model.parameters()).detach(), expected, atol=1e-6, rtol=0)


def test_ssp_overflow_still_advances_the_workers_clock(tmp_path):
    """SSP, staleness=0, an Inf loss on worker 1 at step 2: worker 1 sends an empty push, so its clock still counts
    the iteration (both end at clock 6) and the bound keeps its meaning: the weights are sync SGD with worker 1's
    step-2 gradient counted as zero (a clock left behind would let worker 0 compute step 3 on other weights)."""
    fit(ps(mode="ssp", staleness=0), ExactScaling(overflow_at={(1, 1)}, lr=LR), max_steps=6,
        callbacks=[SnapshotParams(tmp_path), RecordScaling(tmp_path)], plugins=[_plugin()])  # fmt: skip
    net = make_net()
    batches = [rank_batches(regression_data(), r, 2, 4) for r in range(2)]
    for t in range(6):
        grads = []
        for r in range(2):
            net.zero_grad()
            x, y = batches[r][t]
            nn.functional.mse_loss(net(x), y).backward()
            grads.append([torch.zeros_like(p) if (r, t) == (1, 1) else p.grad.clone() for p in net.parameters()])
        with torch.no_grad():
            for p, (g0, g1) in zip(net.parameters(), zip(*grads)):
                p.sub_(LR * (g0 + g1) / 2)
        expected = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        for r in range(2):
            torch.testing.assert_close(load_snapshot(tmp_path, r, t + 1), expected, atol=1e-6, rtol=0)
    worker0, worker1 = _records(tmp_path)
    assert (worker0["skipped"], worker1["skipped"]) == (0, 1)
    assert worker1["scales"] == reference_scales(2.0**10, 6, 2, {2}) and worker0["scales"] == reference_scales(2.0**10, 6, 2)
    (server,) = worker0["servers"]
    assert server["clock"]["clocks"] == [6, 6] and server["version"] == 12


def test_resume_continues_the_scale_and_the_skips_exactly(tmp_path):
    """Real fp16, sync, momentum on the servers, overflows on worker 0 at step 2 and worker 1 at step 5: stopped at
    step 3 of 8 and resumed, both workers end with the uninterrupted run's weights and scaler state (Lightning
    saves it under the swapped plugin's key)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for d in (straight, resumed):
        d.mkdir()
    model = lambda: Fp16Regression(overflow_at={(0, 1), (1, 4)}, lr=LR, momentum=0.9, n=24)  # noqa: E731
    fit(ps(), model(), max_steps=8, limit_val_batches=1, callbacks=[SnapshotParams(straight), RecordScaling(straight)],
        plugins=[_plugin()])  # fmt: skip
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=False)
    fit(ps(), model(), max_steps=3, callbacks=[ckpt], enable_checkpointing=True, limit_val_batches=1, plugins=[_plugin()])
    path = tmp_path / "ckpts" / "epoch=0-step=3.ckpt"
    saved = torch.load(path, weights_only=False)
    full = _records(straight)
    assert "MixedPrecision" not in saved and saved["ParameterServerMixedPrecision"]["scale"] == full[0]["scales"][2]
    assert full[0]["scales"][:3] == [2.0**10, 2.0**9, 2.0**9]
    fit(ps(), model(), max_steps=8, ckpt_path=str(path), limit_val_batches=1,
        callbacks=[SnapshotParams(resumed), RecordScaling(resumed)], plugins=[_plugin()])  # fmt: skip
    after = _records(resumed)
    for rank in range(2):
        torch.testing.assert_close(load_snapshot(resumed, rank, 8), load_snapshot(straight, rank, 8), atol=0, rtol=0)
        assert full[rank]["skipped"] == 2 and after[rank]["skipped"] == 1
        assert after[rank]["scales"] == full[rank]["scales"][3:] and after[rank]["scaler"] == full[rank]["scaler"]


def test_a_checkpoint_of_the_plain_mixed_precision_restores_the_scaler():
    """A checkpoint written with Lightning's MixedPrecision (its key) restores the scaler of the swapped plugin."""
    plugin = ParameterServerMixedPrecision.replacing(_plugin())
    state = {"scale": 512.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 7, "_growth_tracker": 3}
    plugin.on_load_checkpoint({"MixedPrecision": state})
    assert plugin.scaler.state_dict() == state


def test_the_plugin_needs_a_scaler_and_never_steps_the_workers_optimizer():
    """Without a scaler the plugin is a ValueError; its optimizer_step is a RuntimeError (the servers step)."""
    with pytest.raises(ValueError, match=r"ParameterServerMixedPrecision\(precision='16-mixed', scaler=None\): it exists"):
        ParameterServerMixedPrecision("16-mixed", "cpu", None)
    plugin = ParameterServerMixedPrecision.replacing(_plugin())
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(RuntimeError, match=r"optimizer_step: the parameter servers step, not the worker's optimizer"):
        plugin.optimizer_step(sgd, model=None, closure=lambda: None)


class ScalerPrecision(Precision):
    """A precision plugin of its own with a scaler: not Lightning's MixedPrecision."""

    def __init__(self):
        self.scaler = torch.amp.GradScaler("cpu")


def test_other_precision_plugins_with_a_scaler_are_refused():
    """A scaler on a plugin that is not a MixedPrecision is refused at setup, naming the plugin and the rule."""
    with pytest.raises(ValueError, match=r"the precision plugin ScalerPrecision has a gradient scaler; .*MixedPrecision"):
        fit(ParameterServerStrategy(), TinyRegression(), devices=1, max_steps=1, plugins=[ScalerPrecision()])


def test_reference_scales_follow_torch():
    """The scale rule used above is torch's: a real GradScaler with the same flags gives the same scales."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    param = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([param], lr=0.0)
    scales = []
    for t in range(1, 7):
        param.grad = None
        scaler.scale((param * (math.inf if t in (2, 5) else 1.0)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    assert scales == reference_scales(2.0**10, 6, 2, {2, 5})
