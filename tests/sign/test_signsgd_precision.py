"""Tier 3: fp16 mixed precision with a GradScaler under SignSGDStrategy (SignMixedPrecision), against plain torch.

Most runs compute the module in fp32 inside the fp16 autocast (``_ExactScaling``): the scaled gradient is then
exactly ``S·g`` (``S`` a power of two scales every product and sum without rounding), so a loss-scaled run must
equal the fp32 run bit for bit, and skipped steps and scales can be checked against plain-torch references.
"""

import json
import warnings
from pathlib import Path

import pytest
import torch
from _helpers import SnapshotParams, TinyRegression, fit, load_snapshot, make_net, rank_batches, regression_data
from sign.test_hooks import binary
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_pdist import SignSGDStrategy
from lightning_pdist.sign.precision import SignMixedPrecision
from tests._scaling_reference import reference_scales

LR = 0.01  # the sign step δ
EF_LR = 0.05  # error feedback returns s̄·U in gradient units: an SGD lr


def _plugin(init_scale=2.0**10, growth_interval=2):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's GradScaler on CPU may warn
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
        return MixedPrecision("16-mixed", "cpu", scaler=scaler)


class _ExactScaling(TinyRegression):
    """TinyRegression in fp32 inside the fp16 autocast; ``overflow_at=(rank, batch_idx)`` makes that loss infinite."""

    def __init__(self, overflow_at=None, **kwargs):
        super().__init__(**kwargs)
        self.overflow_at = overflow_at

    def training_step(self, batch, batch_idx):
        with torch.autocast("cpu", enabled=False):
            loss = super().training_step(batch, batch_idx)
        if self.overflow_at == (self.global_rank, batch_idx):
            loss = loss * float("inf")  # every gradient of this rank becomes Inf/NaN
        return loss


class RecordScaling(Callback):
    """Each rank writes its scale after every step, the skipped steps and the vote's rounds to dirpath/scaling{r}.json."""

    def __init__(self, dirpath):
        self.dirpath, self.scales = Path(dirpath), []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.scales.append(trainer.precision_plugin.scaler.get_scale())

    def on_train_end(self, trainer, pl_module):
        plugin, state = trainer.precision_plugin, trainer.strategy.hook_state
        record = {"plugin": type(plugin).__name__, "scales": self.scales, "skipped": plugin.skipped_steps,
                  "rounds": {i: b.rounds for i, b in state.buckets.items()},
                  "scaler": plugin.scaler.state_dict()}  # fmt: skip
        (self.dirpath / f"scaling{trainer.global_rank}.json").write_text(json.dumps(record))


def _records(dirpath, world=2):
    return [json.loads((Path(dirpath) / f"scaling{r}.json").read_text()) for r in range(world)]




def reference_votes(world, steps, lr, beta=0.0, error_feedback=False, skip=(), autocast_scales=None):
    """Plain torch: majority vote of every rank's (Signum, EF) vector, x ← x − lr·U (or s̄·U); ``skip`` steps do nothing.

    With ``autocast_scales`` (the loss scale of each step) the gradients are those of the fp16 autocast, scaled.
    Returns the flat parameters after every step.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        net = make_net()
        params = list(net.parameters())
        lengths = [p.numel() for p in params]
        batches = [rank_batches(regression_data(), r, world, 4) for r in range(world)]
        momenta = [torch.zeros(sum(lengths)) for _ in range(world)]
        residuals = [torch.zeros(sum(lengths)) for _ in range(world)]
        history = []
        for t in range(steps):
            if t + 1 not in skip:
                vectors, scales = [], []
                for r in range(world):
                    net.zero_grad()
                    x, y = batches[r][t]
                    if autocast_scales is None:
                        nn.functional.mse_loss(net(x), y).backward()
                    else:
                        with torch.autocast("cpu", dtype=torch.float16):
                            loss = nn.functional.mse_loss(net(x), y)
                        (loss * autocast_scales[t]).backward()
                    g = torch.cat([p.grad.reshape(-1) for p in params])
                    momenta[r] = beta * momenta[r] + (1 - beta) * g if beta else g
                    p_r = momenta[r] + residuals[r] if error_feedback else momenta[r]
                    if error_feedback:
                        s = torch.cat([seg.abs().double().mean().float().expand(seg.numel()) for seg in p_r.split(lengths)])
                        residuals[r] = p_r - s * binary(p_r)
                        scales.append(s)
                    vectors.append(p_r)
                update = binary(sum(binary(v) for v in vectors))
                if error_feedback:
                    update = torch.stack(scales).mean(0) * update
                with torch.no_grad():
                    for p, u in zip(params, update.split(lengths)):
                        p.add_(u.view_as(p), alpha=-lr)
            history.append(torch.cat([p.detach().reshape(-1) for p in params]).clone())
        return history
    finally:
        torch.set_num_threads(threads)


def assert_every_rank_follows(snapdir, history, world=2, atol=1e-6):
    for t, expected in enumerate(history, start=1):
        for r in range(world):
            torch.testing.assert_close(load_snapshot(snapdir, r, t), expected, atol=atol, rtol=0,
                                       msg=lambda m: f"rank {r} step {t}: {m}")  # fmt: skip


def test_grad_scaler_plugin_is_swapped_keeping_the_users_scaler():
    """A MixedPrecision with a GradScaler becomes SignMixedPrecision at setup, with the user's scaler object and settings."""
    plugin = _plugin(init_scale=2.0**8, growth_interval=3)
    scaler = plugin.scaler
    with pytest.warns(UserWarning, match="world_size == 1"):
        trainer = fit(SignSGDStrategy(), _ExactScaling(lr=LR), devices=1, max_steps=4, plugins=[plugin])
    swapped = trainer.precision_plugin
    assert isinstance(swapped, SignMixedPrecision) and swapped.scaler is scaler
    assert (swapped.precision, swapped.device) == ("16-mixed", "cpu")
    assert swapped.hook_state is trainer.strategy.hook_state and swapped.hook_state.loss_scaling is swapped.round
    # 4 good steps, growth every 3: one growth, tracker at 1; nothing skipped; the vote counted 4 rounds.
    assert scaler.state_dict() == {"scale": 2.0**9, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3,
                                   "_growth_tracker": 1}  # fmt: skip
    assert swapped.skipped_steps == 0 and [b.rounds for b in trainer.strategy.hook_state.buckets.values()] == [4]


@pytest.mark.parametrize("options, lr", [
    (dict(), LR),
    (dict(momentum=0.9, error_feedback=True), EF_LR),
    (dict(aggregation="llr", warmup_rounds=1, estimator="coordinate", momentum=0.5, scale="l1"), EF_LR),
])  # fmt: skip
def test_loss_scaled_run_without_overflow_equals_the_fp32_run(tmp_path, options, lr):
    """With no overflow the loss-scaled run (scale growing every 2 steps) equals the fp32 run exactly, on both ranks:
    the sign ignores S, and momentum, residual and l1 scales see g (S·g divided by S in fp32, exact)."""
    scaled, plain = tmp_path / "scaled", tmp_path / "plain"
    for d in (scaled, plain):
        d.mkdir()
    fit(SignSGDStrategy(start_method="fork", **options), _ExactScaling(lr=lr), max_steps=6,
        callbacks=[SnapshotParams(scaled), RecordScaling(scaled)], plugins=[_plugin()])  # fmt: skip
    fit(SignSGDStrategy(start_method="fork", **options), _ExactScaling(lr=lr), max_steps=6, callbacks=[SnapshotParams(plain)])
    for t in range(1, 7):
        for r in range(2):
            torch.testing.assert_close(load_snapshot(scaled, r, t), load_snapshot(plain, r, t), atol=0, rtol=0)
    expected = reference_scales(2.0**10, 6, 2, overflow_steps=())
    for record in _records(scaled):
        assert record["plugin"] == "SignMixedPrecision" and record["scales"] == expected and record["skipped"] == 0


def test_fp16_autocast_run_equals_the_plain_torch_loss_scaled_vote(tmp_path):
    """A real fp16-autocast run votes on the scaled fp16 gradients: both ranks equal plain torch's autocast majority."""
    fit(SignSGDStrategy(start_method="fork"), TinyRegression(lr=LR), max_steps=6,
        callbacks=[SnapshotParams(tmp_path), RecordScaling(tmp_path)], plugins=[_plugin()])  # fmt: skip
    scales = reference_scales(2.0**10, 6, 2, overflow_steps=())
    loss_scales = [2.0**10] + scales[:-1]  # the scale each step's loss was multiplied by
    assert_every_rank_follows(tmp_path, reference_votes(2, 6, LR, autocast_scales=loss_scales))
    assert all(record["scales"] == scales for record in _records(tmp_path))


@pytest.mark.parametrize("options, lr", [(dict(), LR), (dict(momentum=0.9, error_feedback=True), EF_LR)])
def test_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path, options, lr):
    """An Inf loss on rank 1 at step 2 only: both ranks skip step 2 (no vote, momentum, residual or round) and back the
    scale off identically, as plain torch with that step removed and GradScaler's rule say."""
    fit(SignSGDStrategy(start_method="fork", **options), _ExactScaling(overflow_at=(1, 1), lr=lr), max_steps=6,
        callbacks=[SnapshotParams(tmp_path), RecordScaling(tmp_path)], plugins=[_plugin()])  # fmt: skip
    beta = options.get("momentum", 0.0)
    expected = reference_votes(2, 6, lr, beta=beta, error_feedback=options.get("error_feedback", False), skip={2})
    assert_every_rank_follows(tmp_path, expected)
    torch.testing.assert_close(load_snapshot(tmp_path, 0, 2), load_snapshot(tmp_path, 0, 1), atol=0, rtol=0)
    scales = reference_scales(2.0**10, 6, 2, overflow_steps={2})
    assert scales[:3] == [2.0**10, 2.0**9, 2.0**9]
    for record in _records(tmp_path):
        assert record["scales"] == scales and record["skipped"] == 1
        assert list(record["rounds"].values()) == [5]  # the skipped step is not a round


def test_resume_continues_the_scale_and_the_skips_exactly(tmp_path):
    """Real fp16 overflows (initial scale 2^24) and growth: stopped at step 3 of 8 and resumed, both ranks end with the
    uninterrupted run's weights and scaler state (saved under the plugin's key by Lightning)."""
    ckpt_run, resumed = tmp_path / "ckpt", tmp_path / "resumed"
    for d in (ckpt_run, resumed):
        d.mkdir()
    strategy = lambda: SignSGDStrategy(momentum=0.9, error_feedback=True, start_method="fork")  # noqa: E731
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=False)
    fit(strategy(), TinyRegression(lr=EF_LR, n=24), max_steps=8, callbacks=[SnapshotParams(ckpt_run), RecordScaling(ckpt_run), checkpoint],
        enable_checkpointing=True, limit_val_batches=1, plugins=[_plugin(init_scale=2.0**24)])  # fmt: skip
    first = tmp_path / "ckpts" / "epoch=0-step=3.ckpt"
    saved = torch.load(first, weights_only=False)
    full = _records(ckpt_run)
    assert saved["SignMixedPrecision"]["scale"] == full[0]["scales"][2]
    assert full[0]["skipped"] >= 1 and full[0]["scales"][-1] < 2.0**24  # it did overflow and back off
    fit(strategy(), TinyRegression(lr=EF_LR, n=24), max_steps=8, callbacks=[SnapshotParams(resumed), RecordScaling(resumed)],
        ckpt_path=str(first), limit_val_batches=1, plugins=[_plugin(init_scale=2.0**24)])  # fmt: skip
    after = _records(resumed)
    for rank in range(2):
        torch.testing.assert_close(load_snapshot(resumed, rank, 8), load_snapshot(ckpt_run, rank, 8), atol=0, rtol=0)
        assert after[rank]["scales"] == full[rank]["scales"][3:] and after[rank]["scaler"] == full[rank]["scaler"]


def test_a_checkpoint_of_the_plain_mixed_precision_restores_the_scaler():
    """A checkpoint written with Lightning's MixedPrecision (its key) restores the scaler of the swapped plugin."""
    plugin = SignMixedPrecision.replacing(_plugin(), SignSGDStrategy(momentum=0.0).config.make_hook(None)[0])
    state = {"scale": 512.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 7, "_growth_tracker": 3}
    plugin.on_load_checkpoint({"MixedPrecision": state})
    assert plugin.scaler.state_dict() == state


def test_the_plugin_needs_a_scaler_and_refuses_lbfgs():
    """SignMixedPrecision without a scaler is a ValueError; LBFGS is refused as Lightning's MixedPrecision refuses it."""
    state = SignSGDStrategy().config.make_hook(None)[0]
    with pytest.raises(ValueError, match=r"SignMixedPrecision\(precision='16-mixed', scaler=None\): it exists for a GradScaler"):
        SignMixedPrecision("16-mixed", "cpu", None, state)
    plugin = SignMixedPrecision.replacing(_plugin(), state)
    assert state.loss_scaling is plugin.round
    lbfgs = torch.optim.LBFGS([torch.nn.Parameter(torch.zeros(1))])
    with pytest.raises(MisconfigurationException, match="AMP and the LBFGS optimizer are not compatible"):
        plugin.optimizer_step(lbfgs, model=None, closure=lambda: None)
