"""Tier 3: SignSGDStrategy in real Lightning runs (fork launcher, gloo) against plain-torch references.

The references recompute every rank's gradient on its own DistributedSampler batches in one process,
aggregate them from the papers' equations (majority; eqs. 3–4 via ``reference_it_signsgd`` of the hook
tests), and apply ``x ← x − δ·U``.
"""

import re
import json
import math
from pathlib import Path

import pytest
import torch
from _helpers import SnapshotParams, TinyRegression, fit, load_snapshot, make_net, rank_batches, regression_data
from sign.test_hooks import binary, reference_it_signsgd
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn

import lightning_pdist  # noqa: F401  (registers the names)
from lightning_pdist import SignSGDStrategy
from lightning_pdist.sign.hooks import ITSignSGDState, SignSGDState, it_signsgd_hook, sign_hook_bytes, signsgd_mv_hook
from lightning_pdist.core import rank_files

LR = 0.01  # the sign step δ
D, LENGTHS = 58, [32, 8, 16, 2]  # TinyRegression: Linear(4, 8) + Linear(8, 2)
LENGTHS_PARAM_ORDER = LENGTHS  # the order of module.parameters() (the DDP bucket's may differ)
STEPS, WARMUP = 6, 2  # 3 ranks × 4 samples × 6 steps: one epoch of 64 samples, so rank_batches(epoch 0) suffices


class RecordLogged(Callback):
    """Each rank writes its logged pdist/comm_bytes per step to dirpath/bytes{rank}.json."""

    def __init__(self, dirpath):
        self.dirpath, self.per_step = Path(dirpath), []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.per_step.append(float(trainer.callback_metrics["pdist/comm_bytes"]))

    def on_train_end(self, trainer, pl_module):
        (self.dirpath / f"bytes{trainer.global_rank}.json").write_text(json.dumps(self.per_step))


def reference_run(world, steps, aggregate, lr=LR, accumulate=1, batches=None):
    """Plain torch: per-rank gradients on their own batches, ``U = aggregate(all rounds (t, M, D))``, x ← x − lr·U.

    Returns the flat parameters after every step, ``[(D,)] * steps``.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' kernels, so gradients (and their signs) agree to the bit
    try:
        net = make_net()
        params = list(net.parameters())
        data = regression_data()
        batches = batches or [rank_batches(data, r, world, 4) for r in range(world)]
        rounds, history = [], []
        for t in range(steps):
            grads = []
            for r in range(world):
                net.zero_grad()
                for a in range(accumulate):
                    x, y = batches[r][t * accumulate + a]
                    (nn.functional.mse_loss(net(x), y) / accumulate).backward()
                grads.append(torch.cat([p.grad.reshape(-1) for p in params]))
            rounds.append(torch.stack(grads))
            update = aggregate(torch.stack(rounds))
            with torch.no_grad():
                for p, u in zip(params, update.split([p.numel() for p in params])):
                    p.add_(u.view_as(p), alpha=-lr)
            history.append(torch.cat([p.detach().reshape(-1) for p in params]).clone())
        return history
    finally:
        torch.set_num_threads(threads)


def majority(rounds):
    return binary(binary(rounds[-1]).sum(0))


def it_signsgd_coordinate(rounds):
    return reference_it_signsgd(rounds, WARMUP, "coordinate", [D])[0][-1]


def assert_every_rank_follows(snapdir, history, world):
    for t, expected in enumerate(history, start=1):
        for r in range(world):
            torch.testing.assert_close(load_snapshot(snapdir, r, t), expected, atol=1e-6, rtol=0,
                                       msg=lambda m: f"rank {r} step {t}: {m}")  # fmt: skip


# --- three ranks ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def three_rank_runs(tmp_path_factory):
    """signsgd_mv and it_signsgd (coordinate estimator, warm-up 2) on 3 fork-started ranks, 6 steps each."""
    runs = {}
    for name, strategy in [
        ("mv", SignSGDStrategy(start_method="fork")),
        ("it", SignSGDStrategy("llr", warmup_rounds=WARMUP, estimator="coordinate", start_method="fork")),
    ]:
        out = tmp_path_factory.mktemp(name)
        fit(strategy, TinyRegression(lr=LR), devices=3, max_steps=STEPS, callbacks=[SnapshotParams(out), RecordLogged(out)])
        runs[name] = out
    return runs


def test_three_ranks_majority_vote_equals_reference(three_rank_runs):
    """signsgd_mv on 3 ranks with different data: every rank's parameters after every step equal plain-torch MV."""
    assert_every_rank_follows(three_rank_runs["mv"], reference_run(3, STEPS, majority), world=3)


def test_it_signsgd_warmup_equals_majority_vote(three_rank_runs):
    """During its warm-up rounds it_signsgd takes exactly signsgd_mv's steps."""
    for t in range(1, WARMUP + 1):
        for r in range(3):
            assert torch.equal(load_snapshot(three_rank_runs["it"], r, t), load_snapshot(three_rank_runs["mv"], r, t))


def test_it_signsgd_after_warmup_equals_llr_reference(three_rank_runs):
    """After warm-up it_signsgd follows eqs. 3–4 (per-coordinate LLR weights) and departs from the majority vote."""
    expected = reference_run(3, STEPS, it_signsgd_coordinate)
    assert_every_rank_follows(three_rank_runs["it"], expected, world=3)
    assert not torch.allclose(load_snapshot(three_rank_runs["it"], 0, STEPS), load_snapshot(three_rank_runs["mv"], 0, STEPS))


@pytest.mark.parametrize("name", ["mv", "it"])
def test_logged_comm_bytes_equal_sign_hook_bytes(three_rank_runs, name):
    """Every rank logs sum(sign_hook_bytes(58, 3, 4)) per step: about d/8 per direction, not 4d."""
    expected = sum(sign_hook_bytes(D, 3, len(LENGTHS), estimator="coordinate" if name == "it" else None).values())
    for r in range(3):
        assert json.loads((three_rank_runs[name] / f"bytes{r}.json").read_text()) == [float(expected)] * STEPS


# --- one rank (in-process) --------------------------------------------------------------------------------


def _one_rank_batches():
    # One rank: Lightning still injects a shuffled DistributedSampler (seed 0), as for several ranks.
    return [rank_batches(regression_data(), 0, 1, 4)]


def test_one_rank_step_is_lr_times_sign_of_grad(tmp_path):
    """With one rank the update is lr * sign(grad) (signSGD), with a warning that there is no vote."""
    with pytest.warns(UserWarning, match=r"world_size == 1, so there is no vote; each step applies lr \* sign\(grad\)"):
        fit(SignSGDStrategy(), TinyRegression(lr=LR), devices=1, max_steps=4, callbacks=[SnapshotParams(tmp_path)])
    expected = reference_run(1, 4, lambda rounds: binary(rounds[-1][0]), batches=_one_rank_batches())
    assert_every_rank_follows(tmp_path, expected, world=1)


def test_gradient_accumulation_votes_once_on_the_accumulated_gradient(tmp_path):
    """accumulate_grad_batches=2: one vote per optimizer step, on the sign of the summed micro-batch gradients."""
    with pytest.warns(UserWarning, match="world_size == 1"):
        fit(SignSGDStrategy(), TinyRegression(lr=LR), devices=1, max_steps=3, accumulate_grad_batches=2,
            callbacks=[SnapshotParams(tmp_path)])  # fmt: skip
    expected = reference_run(1, 3, lambda rounds: binary(rounds[-1][0]), accumulate=2, batches=_one_rank_batches())
    assert_every_rank_follows(tmp_path, expected, world=1)


class _Manual(TinyRegression):
    def __init__(self, optimizers=1):
        super().__init__(lr=LR, optimizers=optimizers)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        optimizers = self.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        for opt in optimizers:
            opt.zero_grad()
        self.manual_backward(loss)
        for opt in optimizers:
            opt.step()


def test_manual_optimization_votes_in_manual_backward(tmp_path):
    """Manual optimization with one optimizer takes the same lr * sign(grad) steps as automatic optimization."""
    with pytest.warns(UserWarning, match="world_size == 1"):
        fit(SignSGDStrategy("llr", warmup_rounds=0), _Manual(), devices=1, max_steps=3, callbacks=[SnapshotParams(tmp_path)])
    expected = reference_run(1, 3, lambda rounds: binary(rounds[-1][0]), batches=_one_rank_batches())
    assert_every_rank_follows(tmp_path, expected, world=1)


def test_two_optimizers_on_one_backward_vote_on_the_whole_model(tmp_path):
    """Two optimizers stepping after one backward pass take lr * sign(grad) on all their parameters (no refusal).

    GAN-style alternating backward passes: tests/sign/test_signsgd_optimizers.py.
    """
    with pytest.warns(UserWarning, match="world_size == 1"):
        fit(SignSGDStrategy(), _Manual(optimizers=2), devices=1, max_steps=6, callbacks=[SnapshotParams(tmp_path)])
    # Lightning counts both optimizers' steps: 6 steps are 3 batches.
    expected = reference_run(1, 3, lambda rounds: binary(rounds[-1][0]), batches=_one_rank_batches())
    torch.testing.assert_close(load_snapshot(tmp_path, 0, "final"), expected[-1], atol=1e-6, rtol=0)


def test_sgd_sized_lr_warns_with_the_rule_and_the_value_to_try():
    """lr > 0.01 under scale='unit' warns: lr is the sign step; try 0.001 or scale='l1'. lr <= 0.01 does not warn."""
    with pytest.warns(UserWarning) as record:
        fit(SignSGDStrategy(), TinyRegression(lr=0.1), devices=1, max_steps=1)
    messages = [str(w.message) for w in record]
    expected = (
        "SignSGDStrategy(scale='unit'): SGD(lr=0.1) is the sign step δ: every coordinate moves by ±0.1 per step "
        "whatever its gradient (SGD would move it by lr·|g|). Sign steps above 0.01 rarely train; try lr=0.001, or "
        "keep lr=0.1 with SignSGDStrategy(scale='l1'), which scales the vote by the gradient's mean magnitude per tensor."
    )
    assert expected in messages
    for strategy, lr in [(SignSGDStrategy(), LR), (SignSGDStrategy(scale="l1"), 0.1), (SignSGDStrategy(error_feedback=True), 0.1)]:
        with pytest.warns(UserWarning) as record:
            fit(strategy, TinyRegression(lr=lr), devices=1, max_steps=1)
        assert not [w for w in record if "is the sign step" in str(w.message)]


def test_scale_l1_step_is_lr_times_mean_abs_grad_times_sign(tmp_path):
    """scale='l1' on one rank: each tensor moves by lr · mean|g_j| · sign(g_j), so an SGD lr keeps its units."""
    with pytest.warns(UserWarning, match="world_size == 1"):
        fit(SignSGDStrategy(scale="l1"), TinyRegression(lr=0.1), devices=1, max_steps=4, callbacks=[SnapshotParams(tmp_path)])

    def scaled_sign(rounds):
        g = rounds[-1][0]
        scales = torch.cat([seg.abs().mean().expand(seg.numel()) for seg in g.split(LENGTHS_PARAM_ORDER)])
        return scales * binary(g)

    expected = reference_run(1, 4, scaled_sign, lr=0.1, batches=_one_rank_batches())
    assert_every_rank_follows(tmp_path, expected, world=1)


class _NaNAtStep2(TinyRegression):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if batch_idx == 1 else loss


def test_nonfinite_gradient_raises_naming_rank_and_step():
    """A NaN gradient raises (nonfinite='raise') before the optimizer step instead of becoming a silent -1 vote."""
    with pytest.raises(FloatingPointError, match=r"SignSGDStrategy\(nonfinite='raise'\): non-finite gradients \(NaN/Inf\) "
                                                 r"on rank\(s\) \[0\] at global step 1; every rank stops here"):
        fit(SignSGDStrategy(), _NaNAtStep2(lr=LR), devices=1, max_steps=3)


# --- checkpoint and resume --------------------------------------------------------------------------------


def _resume_strategy():
    return SignSGDStrategy("llr", warmup_rounds=1, estimator="coordinate", momentum=0.9, error_feedback=True,
                           start_method="fork")  # fmt: skip


def test_resume_restores_every_ranks_hook_state(tmp_path):
    """Stopped at step 3 of 8 and resumed: both ranks end where the uninterrupted run does (LLR counts, EF residual and
    Signum momentum restored per rank)."""
    ckpt_run, resumed = tmp_path / "ckpt", tmp_path / "resumed"
    for d in (ckpt_run, resumed):
        d.mkdir()
    # 24 samples, 2 ranks, batch 4: 3 steps per epoch. Saved at validation end (save_on_train_epoch_end=False):
    # Lightning 2.6 resumes such checkpoints with the exact data order.
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=False)
    fit(_resume_strategy(), TinyRegression(lr=LR, n=24), max_steps=8, callbacks=[SnapshotParams(ckpt_run), checkpoint],
        enable_checkpointing=True, limit_val_batches=1)  # fmt: skip
    first = tmp_path / "ckpts" / "epoch=0-step=3.ckpt"
    stored = torch.load(first, weights_only=False)["pdist"]
    assert stored["strategy"] == "SignSGDStrategy" and stored["config"]["aggregation"] == "llr"
    assert stored["rank_files"]["world_size"] == 2 and "hook_states" not in stored
    states = [torch.load(rank_files.path_for(first, r, 2), weights_only=False)["hook_state"] for r in range(2)]
    assert [s["rank"] for s in states] == [0, 1]
    bucket0 = [s["buckets"][0] for s in states]
    assert all(b["rounds"] == 3 and b["llr"]["rounds"] == 3 for b in bucket0)
    # Each rank holds its own residual and its own slice of the per-coordinate statistics.
    assert not torch.equal(bucket0[0]["residual"], bucket0[1]["residual"])
    assert bucket0[0]["llr"]["disagreements"].shape[1] + bucket0[1]["llr"]["disagreements"].shape[1] == D
    fit(_resume_strategy(), TinyRegression(lr=LR, n=24), max_steps=8, callbacks=[SnapshotParams(resumed)],
        ckpt_path=str(first), limit_val_batches=1)  # fmt: skip
    for rank in range(2):
        torch.testing.assert_close(load_snapshot(resumed, rank, 8), load_snapshot(ckpt_run, rank, 8), atol=1e-6, rtol=0)


def _strategy_with_state(**kwargs):
    strategy = SignSGDStrategy(**kwargs)
    strategy._default_comm_hook()  # what setup does when it wraps the model
    return strategy


def test_resume_with_another_world_size_or_no_state_warns_and_starts_fresh(tmp_path):
    """A checkpoint without this rank's file (another strategy's, another world size's) warns, leaves the state empty."""
    strategy = _strategy_with_state()
    path = tmp_path / "x.ckpt"
    for pdist, why in [({"strategy": "PdistStrategy"}, "names no per-rank files"),
                       ({"rank_files": rank_files.manifest(path, 2)}, "saved by 2 ranks but world_size is 1")]:  # fmt: skip
        state, reason = rank_files.load_own(path, pdist, 0, 1)
        assert state is None and why in reason
        with pytest.warns(UserWarning, match=rf"{re.escape(why)}.*; the vote statistics, residuals and momentum start from zero"):
            strategy.load_pdist_rank_state(state, reason)
    assert strategy.hook_state.buckets == {}


def test_resume_into_other_settings_is_refused():
    """LLR statistics saved by it_signsgd cannot be loaded into signsgd_mv: the hook state raises."""
    saved = _strategy_with_state(aggregation="llr").hook_state
    saved.rank, saved.world_size = 0, 1
    state = saved.state_dict()
    state["buckets"] = {0: {"lengths": [D], "rounds": 1, "momentum": None, "residual": None,
                            "llr": {"estimator": "worker", "disagreements": torch.zeros(1, 1, dtype=torch.float64),
                                    "observations": torch.ones(1, dtype=torch.float64), "rounds": 1}}}  # fmt: skip
    with pytest.raises(ValueError, match="the saved state holds LLR statistics, but this state takes the plain majority"):
        _strategy_with_state().load_pdist_rank_state({"hook_state": state})


# --- names, construction and bad inputs -------------------------------------------------------------------


@pytest.mark.parametrize("name, aggregation, state_cls, hook", [
    ("signsgd_mv", "majority", SignSGDState, signsgd_mv_hook),
    ("it_signsgd", "llr", ITSignSGDState, it_signsgd_hook),
])  # fmt: skip
def test_names_are_registered_with_their_aggregation(name, aggregation, state_cls, hook):
    """`strategy="signsgd_mv"` / `"it_signsgd"` (and _fork) build SignSGDStrategy with the matching hook."""
    trainer = Trainer(accelerator="cpu", devices=2, strategy=name, logger=False)
    assert isinstance(trainer.strategy, SignSGDStrategy) and trainer.strategy.aggregation == aggregation
    assert StrategyRegistry[f"{name}_fork"]["init_params"] == {"aggregation": aggregation, "start_method": "fork"}
    state, registered = trainer.strategy._default_comm_hook()
    assert type(state) is state_cls and registered is hook and state.meter is trainer.strategy.comm_meter


def test_options_reach_the_hook_state():
    """Every option the hook states support is passed through."""
    state = _strategy_with_state(aggregation="llr", warmup_rounds=3, estimator="tensor", decay=0.9, max_weight=2.0,
                                 negative_weights=True, momentum=0.5, error_feedback=True,
                                 nonfinite="propagate").hook_state  # fmt: skip
    assert (state.warmup_rounds, state.estimator, state.decay, state.max_weight, state.negative_weights) == (
        3, "tensor", 0.9, 2.0, True)  # fmt: skip
    assert (state.momentum, state.error_feedback, state.nonfinite) == (0.5, True, "propagate")


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(aggregation="mean"), ValueError, r"\(aggregation='mean'\): aggregation must be one of 'majority', 'llr'"),
    (dict(aggregation="llr", estimator="layer"), ValueError, r"\(estimator='layer'\): estimator must be one of"),
    (dict(warmup_rounds=-1), ValueError, r"\(warmup_rounds=-1\): warmup_rounds must be >= 0"),
    (dict(warmup_rounds=2.5), TypeError, r"\(warmup_rounds=2.5\): warmup_rounds must be an int"),
    (dict(aggregation="llr", decay=0.0), ValueError, r"\(decay=0.0\): decay must be in \(0, 1\]"),
    (dict(aggregation="llr", max_weight=math.inf), ValueError, r"\(max_weight=inf\): max_weight must be finite"),
    (dict(momentum=1.0), ValueError, r"\(momentum=1.0\): momentum \(Signum's beta\) must be in \[0, 1\)"),
    (dict(momentum="0.9"), TypeError, r"\(momentum='0.9'\): momentum must be a float"),
    (dict(error_feedback=1), TypeError, r"\(error_feedback=1\): error_feedback must be a bool"),
    (dict(aggregation="llr", negative_weights="yes"), TypeError, r"\(negative_weights='yes'\): negative_weights must"),
    (dict(nonfinite="skip"), ValueError, r"\(nonfinite='skip'\): nonfinite must be one of 'raise', 'skip_step', 'propagate'"),
    (dict(scale="sign"), ValueError, r"\(scale='sign'\): scale must be one of 'unit', 'l1' \('unit': the optimizer's lr is"),
    (dict(ddp_comm_hook=signsgd_mv_hook), ValueError, r"\(ddp_comm_hook=.*\): SignSGDStrategy owns gradient comm"),
])  # fmt: skip
def test_constructor_rejects_bad_values_naming_argument_value_and_rule(kwargs, error, match):
    """Bad options fail at construction, before any process starts, naming the class, argument, value and rule."""
    with pytest.raises(error, match=rf"^SignSGDStrategy{match}"):
        SignSGDStrategy(**kwargs)


def test_llr_options_under_majority_warn_that_they_are_ignored():
    """aggregation='majority' with an LLR-only option set warns that the option does nothing."""
    with pytest.warns(UserWarning, match=r"SignSGDStrategy\(aggregation='majority', estimator='tensor'\): .* ignored"):
        SignSGDStrategy(estimator="tensor")
