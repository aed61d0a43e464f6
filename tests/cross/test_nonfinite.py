"""One non-finite policy for every strategy: a NaN on one rank at a chosen step, under raise, skip_step and propagate.

Real 2-rank fork-launched runs. A rank multiplies its input by NaN at one batch (the loss and every gradient of
that step are NaN, and a BatchNorm's running statistics take the NaN in the forward). Each rank writes what it
raised, with its state before the step and at the exception, so every test sees *both* ranks.
"""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback
from torch import nn
from torch.distributed.tensor import DTensor
from torch.multiprocessing import ProcessRaisedException
from torch.utils.data import DataLoader, TensorDataset

from lightning_pdist import (BMUFStrategy, EASGDStrategy, LocalSGDStrategy, ParameterServerStrategy, PdistStrategy,
                             PipelineStrategy, SignSGDStrategy, SimuParallelSGDStrategy, TensorParallelStrategy)  # fmt: skip
from lightning_pdist.core.nonfinite import (
    NONFINITE_POLICIES,
    BufferSnapshot,
    SkippedSteps,
    all_finite,
    grads_finite,
    check_nonfinite_policy,
    culprit_ranks,
    nonfinite_error,
    one_hot_flag,
)
from _helpers import TinyRegression, fit, make_net, regression_data
from tests.conformance.strategies import PDIST_CLASSES

NAN_RANK, NAN_BATCH = 1, 2  # rank 1's third batch (global step 2)


# ---------------------------------------------------------------------------------------------- tier 1: the policy
def test_policy_values_are_checked_naming_argument_value_and_rule():
    """A policy outside the three is refused with the argument, the value and the rule; a non-str is a TypeError."""
    assert NONFINITE_POLICIES == ("raise", "skip_step", "propagate")
    assert check_nonfinite_policy("skip_step", "X") == "skip_step"
    with pytest.raises(ValueError, match=r"X\(nonfinite='skip'\): nonfinite must be one of 'raise', 'skip_step', "
                                         r"'propagate' \('raise': every rank stops"):
        check_nonfinite_policy("skip", "X")
    with pytest.raises(TypeError, match=r"X\(nonfinite=True\): nonfinite must be a str"):
        check_nonfinite_policy(True, "X")


# Every class of the one strategy list that takes the policy (Parallax, Sandblaster, Ape-X and Gorila take none).
WITH_POLICY = [cls for cls in PDIST_CLASSES if "nonfinite" in inspect.signature(cls).parameters]


@pytest.mark.parametrize("make", WITH_POLICY, ids=lambda cls: cls.__name__)
def test_every_strategy_refuses_a_bad_policy_at_construction(make):
    """The same refusal from every constructor of the one list that takes a policy, before any process starts."""
    with pytest.raises(ValueError, match=rf"{make.__name__}\(nonfinite='Raise'\): nonfinite must be one of"):
        make(nonfinite="Raise")
    assert make().nonfinite == "raise" and make(nonfinite="propagate").nonfinite == "propagate"


@pytest.mark.parametrize(("make", "match"), [
    (lambda: BMUFStrategy(block_lr=float("inf")), r"BMUFStrategy\(block_lr=inf\): block_lr must be a finite number > 0"),
    (lambda: BMUFStrategy(block_lr=float("nan")), r"BMUFStrategy\(block_lr=nan\): block_lr must be a finite number > 0"),
    (lambda: BMUFStrategy(block_momentum=float("nan")), r"BMUFStrategy\(block_momentum=nan\): block_momentum must be in"),
    (lambda: EASGDStrategy(alpha=float("nan")), r"EASGDStrategy\(alpha=nan\): alpha must be in \(0, 1\]"),
    (lambda: SignSGDStrategy(momentum=float("nan")), r"SignSGDStrategy\(momentum=nan\): momentum \(Signum's beta\)"),
    (lambda: SignSGDStrategy("llr", max_weight=float("inf")), r"SignSGDStrategy\(max_weight=inf\): max_weight must be finite"),
    (lambda: ParameterServerStrategy(mode="async", delay_compensation=float("nan")), r"delay_compensation=nan\)"),
    (lambda: ParameterServerStrategy(server_timeout=float("nan")), r"server_timeout=nan\): server_timeout must be a finite"),
])  # fmt: skip
def test_infinite_and_nan_hyperparameters_are_refused_at_construction(make, match):
    """The strategies' float hyperparameters refuse inf and NaN before any process starts, naming the argument."""
    with pytest.raises(ValueError, match=match):
        make()


def test_agreement_vector_messages_and_state():
    """The one-hot flags name the culprits; the error names ranks and step; skip count and buffer copy round-trip."""
    flags = one_hot_flag(True, 2, 4) + one_hot_flag(False, 0, 4) + one_hot_flag(True, 3, 4)
    assert culprit_ranks(flags) == [2, 3]
    assert all_finite([torch.ones(3), torch.zeros(2, 2), torch.zeros(0), torch.ones(2, dtype=torch.bfloat16)])
    assert all_finite([])
    for value in (float("nan"), float("inf"), float("-inf")):  # min/max propagate NaN and hold any infinity
        for dtype in (torch.float32, torch.float16):
            bad = torch.ones(5, dtype=dtype)
            bad[2] = value
            assert not all_finite([torch.ones(3), bad]), (value, dtype)
            sparse = torch.sparse_coo_tensor([[0, 3]], [[1.0, value], [2.0, 3.0]], (5, 2))  # an embedding's gradient
            assert not all_finite([sparse]) and not grads_finite([sparse]), value
    assert all_finite([torch.sparse_coo_tensor([[1]], [[1.0, 1.0]], (5, 2))]) and grads_finite([torch.ones(2).to_sparse()])
    error = nonfinite_error("S", "gradients", [1], 7, "the optimizer step")
    assert isinstance(error, FloatingPointError)
    assert "S(nonfinite='raise'): non-finite gradients (NaN/Inf) on rank(s) [1] at global step 7" in str(error)
    assert "some rank (which one could not be told)" in str(nonfinite_error("S", "gradients", [], 7, "x"))
    skipped = SkippedSteps()
    assert skipped.record(3) and not skipped.record(5)
    again = SkippedSteps()
    again.load_state_dict(skipped.state_dict())
    assert (again.count, again.last_step) == (2, 5)
    buffer = torch.ones(3)
    snapshot = BufferSnapshot()
    snapshot.take([buffer])
    buffer.fill_(float("nan"))
    snapshot.take([buffer])  # a copy is held: kept (an accumulation window keeps its first)
    snapshot.restore_([buffer])
    assert torch.equal(buffer, torch.ones(3)) and snapshot.saved is None


# ---------------------------------------------------------------------------------------------- modules and records
class NormedRegression(TinyRegression):
    """TinyRegression with a BatchNorm; rank ``nan_rank`` feeds NaN at ``nan_batch``.

    Each rank reads rows ``rank::world_size`` in order (run with ``use_distributed_sampler=False``);
    ``drop_batch`` leaves that batch out on every rank (the reference of a skipped step).
    """

    def __init__(self, nan_rank: int | None = NAN_RANK, nan_batch: int = NAN_BATCH, drop_batch: int | None = None,
                 **kwargs):  # fmt: skip
        super().__init__(**kwargs)
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))
        self.nan_rank, self.nan_batch, self.drop_batch = nan_rank, nan_batch, drop_batch

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_rank == self.nan_rank and batch_idx == self.nan_batch:
            x = x * float("nan")
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def optimizer_step(self, *args, **kwargs):
        # Inside the rank's process (Lightning calls callbacks' on_exception in the launching process only).
        try:
            return super().optimizer_step(*args, **kwargs)
        except Exception as exception:
            for callback in self.trainer.callbacks:
                if isinstance(callback, Record):
                    callback.write(self.trainer, exception)
            raise

    def train_dataloader(self):
        x, y = regression_data(self.n).tensors
        rank, world = self.trainer.global_rank, self.trainer.world_size
        x, y = x[rank::world], y[rank::world]
        if self.drop_batch is not None:  # the reference run: this batch never reaches any rank
            keep = torch.ones(len(x), dtype=torch.bool)
            keep[self.drop_batch * self.batch_size : (self.drop_batch + 1) * self.batch_size] = False
            x, y = x[keep], y[keep]
        return DataLoader(TensorDataset(x, y), batch_size=self.batch_size, shuffle=False)


def run(strategy, module, **kwargs):
    """A 2-rank fork-launched fit in which each rank reads its own rows (NormedRegression.train_dataloader)."""
    return fit(strategy, module, use_distributed_sampler=False, **kwargs)


def flat_module(module) -> torch.Tensor:
    """Parameters and float buffers as one vector (each rank's own shards of sharded tensors)."""
    tensors = [t.to_local() if isinstance(t, DTensor) else t for t in module.state_dict().values()]
    return torch.cat([t.detach().reshape(-1).clone() for t in tensors if t.is_floating_point()])


def averaging_state(trainer) -> dict:
    strategy = trainer.strategy
    state = {"module": flat_module(trainer.lightning_module), "step": strategy.step}
    state.update({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in strategy.algorithm_state_dict().items()})
    return state


class Record(Callback):
    """Each rank writes the exception it stopped with, its state after the previous batch and at the exception.

    The module's ``optimizer_step`` calls :meth:`write` in the rank's own process when the step raises.
    """

    def __init__(self, dirpath: Path, state, checkpoint: bool = False, barrier: bool = True):
        self.dirpath, self.state, self.checkpoint, self.barrier, self.last = Path(dirpath), state, checkpoint, barrier, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.last = self.state(trainer)

    def write(self, trainer, exception):
        record = {"type": type(exception).__name__, "message": str(exception), "before": self.last,
                  "at": self.state(trainer)}  # fmt: skip
        torch.save(record, self.dirpath / f"rank{trainer.global_rank}.pt")
        if self.checkpoint:  # every rank stopped at the same step, so the collective save works
            trainer.save_checkpoint(self.dirpath / "stopped.ckpt")
        if self.barrier:  # every rank stopped at this step: both records are written before either process exits
            trainer.strategy.barrier()


def records(dirpath: Path, world: int = 2) -> list[dict]:
    return [torch.load(Path(dirpath) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def assert_same_state(before: dict, at: dict) -> None:
    assert before.keys() == at.keys()
    for key in before:
        if isinstance(before[key], torch.Tensor):
            torch.testing.assert_close(at[key], before[key], atol=0, rtol=0, msg=lambda m: f"{key}: {m}")
        else:
            assert at[key] == before[key], key


class FinalModule(Callback):
    """Each rank saves its module (parameters and float buffers), the logged skip count and its warnings at the end."""

    def __init__(self, dirpath: Path):
        self.dirpath = Path(dirpath)

    def on_fit_start(self, trainer, pl_module):
        self._catching = warnings.catch_warnings(record=True)
        self._caught = self._catching.__enter__()
        warnings.simplefilter("always")

    def on_train_end(self, trainer, pl_module):
        self._catching.__exit__(None, None, None)
        skipped = trainer.callback_metrics.get("pdist/skipped_steps")
        torch.save({"module": flat_module(pl_module), "skipped": None if skipped is None else float(skipped),
                    "warnings": [str(w.message) for w in self._caught]},
                   self.dirpath / f"final{trainer.global_rank}.pt")  # fmt: skip


def finals(dirpath: Path, world: int = 2) -> list[dict]:
    return [torch.load(Path(dirpath) / f"final{r}.pt", weights_only=False) for r in range(world)]


def assert_warned_once(final: list[dict], text: str) -> None:
    """Rank 0 warned about the first skip once; rank 1 stayed quiet (rank_zero_warn)."""
    assert [text in w for w in final[0]["warnings"]].count(True) == 1, final[0]["warnings"]
    assert not any(text in w for w in final[1]["warnings"])


# ---------------------------------------------------------------------------------------------- averaging family
AVERAGING = {
    "local_sgd": lambda **kw: LocalSGDStrategy(period=2, start_method="fork", **kw),
    "bmuf": lambda **kw: BMUFStrategy(period=2, start_method="fork", **kw),
    "easgd": lambda **kw: EASGDStrategy(period=2, start_method="fork", **kw),
    "simuparallel_sgd": lambda **kw: SimuParallelSGDStrategy(start_method="fork", **kw),
}


@pytest.mark.parametrize("name", list(AVERAGING))
def test_raise_stops_both_ranks_at_the_step_before_any_state_changes(tmp_path, name):
    """nonfinite='raise': both ranks raise at global step 2 naming rank 1; replica, step count and algorithm state
    (BMUF anchor and block momentum, EASGD center) are those after step 1; BMUF's stopped run checkpoints."""
    checkpoint = name == "bmuf"
    with pytest.raises(ProcessRaisedException, match=r"non-finite gradients \(NaN/Inf\) on rank\(s\) \[1\] at global step 2"):
        run(AVERAGING[name](), NormedRegression(), max_steps=6,
            callbacks=[Record(tmp_path, averaging_state, checkpoint=checkpoint)])  # fmt: skip
    for record in records(tmp_path):
        assert record["type"] == "FloatingPointError"
        assert "(nonfinite='raise'): non-finite gradients (NaN/Inf) on rank(s) [1] at global step 2; every rank " \
               "stops here, before the optimizer step" in record["message"]
        assert_same_state(record["before"], record["at"])
    if checkpoint:
        saved = torch.load(tmp_path / "stopped.ckpt", weights_only=False)["pdist"]
        before = records(tmp_path)[0]["before"]
        torch.testing.assert_close(saved["algorithm"]["anchor"], before["anchor"], atol=0, rtol=0)
        torch.testing.assert_close(saved["algorithm"]["delta"], before["delta"], atol=0, rtol=0)
        assert saved["step"] == before["step"] == 2


def test_raise_during_warmup_names_the_rank_despite_the_gradient_average(tmp_path):
    """In warm-up DDP averages the gradients (NaN everywhere); the comm hook's notes still name rank 1."""
    with pytest.raises(ProcessRaisedException, match=r"on rank\(s\) \[1\] at global step 2"):
        run(LocalSGDStrategy(period=2, warmup_steps=4, start_method="fork"), NormedRegression(), max_steps=6,
            callbacks=[Record(tmp_path, averaging_state)])  # fmt: skip
    for record in records(tmp_path):
        assert "on rank(s) [1] at global step 2" in record["message"]
        assert_same_state(record["before"], record["at"])


def module_state(trainer) -> dict:
    return {"module": flat_module(trainer.lightning_module)}


def test_ddp_raise_names_the_rank_from_the_comm_hooks_notes(tmp_path):
    """pdist_ddp: the averaged gradients are NaN on both ranks; the hook's notes (gathered on this path only) name
    rank 1, and both ranks stop before the optimizer step."""
    with pytest.raises(ProcessRaisedException, match=r"PdistStrategy\(nonfinite='raise'\): non-finite gradients "
                                                     r"\(NaN/Inf\) on rank\(s\) \[1\] at global step 2"):
        run(PdistStrategy(start_method="fork"), NormedRegression(), max_steps=4, callbacks=[Record(tmp_path, module_state)])
    for record in records(tmp_path):
        assert_same_state(record["before"], record["at"])


def test_ddp_with_a_foreign_comm_hook_cannot_tell_which_rank():
    """A ddp_comm_hook from outside lightning_pdist notes nothing: every rank still stops, saying some rank."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    with pytest.warns(UserWarning, match="not counted in pdist/comm_bytes"):
        strategy = PdistStrategy(ddp_comm_hook=allreduce_hook, start_method="fork")
    with pytest.raises(ProcessRaisedException, match=r"non-finite gradients \(NaN/Inf\) on some rank \(which one could "
                                                     r"not be told\) at global step 2"):
        run(strategy, NormedRegression(), max_steps=4)


def assert_skip_step_equals_dropped_batch(tmp_path, make, module, warning, steps, **module_kwargs):
    """Run ``make(nonfinite="skip_step")`` for ``steps`` steps and ``make()`` on the same data without the NaN batch
    for ``steps - 1``; every rank warned once (``warning``), skipped one step, and ended with the reference weights.
    Returns the skipping run's finals."""
    run(make(nonfinite="skip_step"), module(**module_kwargs), max_steps=steps, callbacks=[FinalModule(tmp_path)])
    skipped = finals(tmp_path)
    assert_warned_once(skipped, warning)
    run(make(), module(nan_rank=None, drop_batch=NAN_BATCH, **module_kwargs), max_steps=steps - 1,
        callbacks=[FinalModule(tmp_path)])  # fmt: skip
    reference = finals(tmp_path)
    for rank in range(2):
        assert skipped[rank]["skipped"] == 1.0
        torch.testing.assert_close(skipped[rank]["module"], reference[rank]["module"], atol=1e-6, rtol=0)
    return skipped


@pytest.mark.parametrize("name", ["local_sgd", "bmuf", "easgd"])
def test_skip_step_equals_a_run_without_that_batch(tmp_path, name):
    """nonfinite='skip_step': both ranks skip global step 2 (BatchNorm statistics restored, the step not counted
    towards the period), warn once, log pdist/skipped_steps = 1, and end exactly where a run without that batch does."""
    skipped = assert_skip_step_equals_dropped_batch(
        tmp_path, AVERAGING[name], NormedRegression, "non-finite gradients (NaN/Inf) on rank(s) [1] at global step 2; "
        "every rank skipped that optimizer step", steps=7)  # fmt: skip
    assert all(all_finite([skipped[rank]["module"]]) for rank in range(2))


def test_propagate_lets_the_nan_reach_every_replica(tmp_path):
    """nonfinite='propagate' is plain PyTorch: no check; rank 1's NaN reaches both replicas and fit returns."""
    run(AVERAGING["local_sgd"](nonfinite="propagate"), NormedRegression(), max_steps=4, callbacks=[FinalModule(tmp_path)])
    for final in finals(tmp_path):
        assert torch.isnan(final["module"]).any()


class _DivergeOnRankOne(Callback):
    """Rank 1's optimizer writes inf into a weight after its step at global step 3: finite gradients, diverged replica."""

    def on_train_start(self, trainer, pl_module):
        optimizer = trainer.optimizers[0]

        def diverge(opt, args, kwargs):
            if trainer.global_rank == 1 and trainer.global_step == 3:
                with torch.no_grad():
                    pl_module.net[0].weight[0, 0] = float("inf")

        optimizer.register_step_post_hook(diverge)


@pytest.mark.parametrize("policy", ["raise", "skip_step"])
def test_a_diverged_replica_stops_both_ranks_before_the_block_update(tmp_path, policy):
    """A replica that became non-finite from finite gradients stops every rank at the synchronization (after global
    step 3), naming rank 1, before the anchor and block momentum change; skip_step cannot skip it back."""
    strategy = BMUFStrategy(period=2, start_method="fork", nonfinite=policy)
    with pytest.raises(ProcessRaisedException, match=r"non-finite replica parameters or buffers \(NaN/Inf\) on rank\(s\) "
                                                     r"\[1\] at global step 3; every rank stops here, before the block "
                                                     r"update changes the anchor, the block momentum and the replicas"):
        run(strategy, NormedRegression(nan_rank=None), max_steps=6,
            callbacks=[_DivergeOnRankOne(), Record(tmp_path, averaging_state)])  # fmt: skip
    for record in records(tmp_path):
        assert f"BMUFStrategy(nonfinite={policy!r})" in record["message"]
        assert "skipping a synchronization cannot bring them back" in record["message"]
        assert "skips such steps" not in record["message"]
        for key in ("anchor", "delta"):
            torch.testing.assert_close(record["at"][key], record["before"][key], atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------- sign votes
def sign_state(trainer) -> dict:
    buckets = trainer.strategy.hook_state.buckets.values()
    return {"module": flat_module(trainer.lightning_module), "rounds": sum(b.rounds for b in buckets),
            "momentum": torch.cat([b.momentum.reshape(-1) for b in buckets if b.momentum is not None])}  # fmt: skip


def signum(**kw):
    return SignSGDStrategy(momentum=0.9, start_method="fork", **kw)


def test_sign_raise_stops_both_ranks_before_the_step_and_keeps_the_vote_state(tmp_path):
    """nonfinite='raise' under a sign vote: the flag in the all-to-all header tells both ranks; both raise at global
    step 2 naming rank 1, with the Signum momentum and the round count of step 1 (the pass's changes dropped)."""
    with pytest.raises(ProcessRaisedException, match=r"SignSGDStrategy\(nonfinite='raise'\): non-finite gradients "
                                                     r"\(NaN/Inf\) on rank\(s\) \[1\] at global step 2"):
        run(signum(), NormedRegression(lr=0.01), max_steps=5, callbacks=[Record(tmp_path, sign_state)])
    for record in records(tmp_path):
        assert record["type"] == "FloatingPointError"
        assert record["before"]["rounds"] == 2
        assert_same_state(record["before"], record["at"])


def test_sign_skip_step_equals_a_run_without_that_batch(tmp_path):
    """nonfinite='skip_step': both ranks skip global step 2; momentum, rounds, weights and BatchNorm statistics end
    exactly where a run without that batch ends."""
    assert_skip_step_equals_dropped_batch(
        tmp_path, signum, NormedRegression, "SignSGDStrategy(nonfinite='skip_step'): non-finite gradients (NaN/Inf) "
        "on rank(s) [1] at global step 2; every rank skipped that optimizer step", steps=6, lr=0.01)  # fmt: skip


def test_sign_propagate_hands_the_optimizer_a_nan_gradient(tmp_path):
    """nonfinite='propagate': every rank gets NaN gradients for that step and SGD writes them into the weights."""
    run(signum(nonfinite="propagate"), NormedRegression(lr=0.01), max_steps=4, callbacks=[FinalModule(tmp_path)])
    for final in finals(tmp_path):
        assert torch.isnan(final["module"]).any()


# ---------------------------------------------------------------------------------------------- parameter servers
def ps_state(trainer) -> dict:
    strategy = trainer.strategy
    return {"module": flat_module(trainer.lightning_module), "versions": list(strategy._versions),
            "servers": strategy._servers_params()}  # fmt: skip


def ps(**kw):
    return ParameterServerStrategy(start_method="fork", server_timeout=30.0, **kw)


def test_ps_sync_raise_stops_every_worker_before_the_push(tmp_path):
    """sync, nonfinite='raise': one flag all-reduce per step; both workers raise at global step 2 naming worker 1,
    before pushing: the servers' parameters and versions are those after step 1."""
    with pytest.raises(ProcessRaisedException, match=r"ParameterServerStrategy\(nonfinite='raise'\): non-finite gradients "
                                                     r"\(NaN/Inf\) on rank\(s\) \[1\] at global step 2; every worker "
                                                     r"stops here, before the push \(no server has seen them\)"):
        run(ps(), NormedRegression(), max_steps=5, callbacks=[Record(tmp_path, ps_state)])
    for record in records(tmp_path):
        assert_same_state(record["before"], record["at"])
        assert all_finite([record["at"]["servers"]])


def test_ps_sync_skip_step_equals_a_run_without_that_batch(tmp_path):
    """sync, nonfinite='skip_step': every worker skips global step 2's push (no server steps) and the run ends where
    one without that batch ends (weights and averaged BatchNorm statistics)."""
    assert_skip_step_equals_dropped_batch(
        tmp_path, ps, NormedRegression, "ParameterServerStrategy(nonfinite='skip_step'): non-finite gradients (NaN/Inf) "
        "on rank(s) [1] at global step 2; every worker skipped that step's push (no server stepped)", steps=6)  # fmt: skip


def test_ps_async_raise_stops_that_worker_before_its_push(tmp_path):
    """async, nonfinite='raise': worker 1 checks its own gradient and stops before pushing it (the launcher ends
    worker 0); the servers never see the NaN."""
    with pytest.raises(ProcessRaisedException, match=r"non-finite gradients \(NaN/Inf\) on rank\(s\) \[1\] at global "
                                                     r"step 2; worker 1 stops here, before its push"):
        run(ps(mode="async"), NormedRegression(), max_steps=5, callbacks=[Record(tmp_path, ps_state, barrier=False)])
    record = torch.load(tmp_path / "rank1.pt", weights_only=False)
    assert torch.equal(record["at"]["module"], record["before"]["module"])
    assert all_finite([record["at"]["servers"]])


def test_ps_async_skip_step_skips_that_workers_push_alone(tmp_path):
    """async, nonfinite='skip_step': worker 1 alone skips its push of global step 2 and warns; worker 0 skips
    nothing; both train on to finite weights."""
    run(ps(mode="async", nonfinite="skip_step"), NormedRegression(), max_steps=6, callbacks=[FinalModule(tmp_path)])
    final = finals(tmp_path)
    assert [f["skipped"] for f in final] == [0.0, 1.0]
    text = "on rank(s) [1] at global step 2; worker 1 skipped its own push of that step"
    assert [text in w for w in final[1]["warnings"]].count(True) == 1 and not any(text in w for w in final[0]["warnings"])
    assert all(all_finite([f["module"]]) for f in final)


def test_ps_propagate_lets_the_nan_reach_the_servers(tmp_path):
    """nonfinite='propagate': worker 1's NaN gradient is pushed, the servers step on it, every worker pulls NaN."""
    run(ps(nonfinite="propagate"), NormedRegression(), max_steps=4, callbacks=[FinalModule(tmp_path)])
    for final in finals(tmp_path):
        assert torch.isnan(final["module"]).any()


class _DivergingServerStep(NormedRegression):
    """A weight whose gradient is 0 (finite) but whose weight decay of 1e38 makes the servers' SGD step overflow."""

    def __init__(self):
        super().__init__(nan_rank=None)
        self.extra = nn.Parameter(torch.ones(2))

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) + 0.0 * self.extra.sum()

    def configure_optimizers(self):
        return torch.optim.SGD([{"params": self.net.parameters()},
                                {"params": [self.extra], "lr": 10.0, "weight_decay": 1e38}], lr=0.1)  # fmt: skip


def test_ps_a_diverged_server_step_stops_every_worker_even_under_skip_step():
    """Finite gradients, a server step that overflows: every (sync) worker stops at the pull; no skip can undo it."""
    with pytest.raises(ProcessRaisedException, match=r"ParameterServerStrategy\(nonfinite='skip_step'\): non-finite "
                                                     r"parameters pulled from the servers \(NaN/Inf\) on worker \d at "
                                                     r"global step 0; every worker stops here, before they reach a "
                                                     r"checkpoint\. Every gradient pushed was checked finite"):
        run(ps(nonfinite="skip_step"), _DivergingServerStep(), max_steps=3)


# ---------------------------------------------------------------------------------------------- tensor parallelism
class ShardedRegression(NormedRegression):
    """TinyRegression's Linear stack (sharded colwise/rowwise on 2 ranks; no BatchNorm); every rank reads every row.

    Rank ``nan_rank`` writes NaN into its own shard of the first layer's gradient at ``nan_batch`` (a rank-local
    fault: a NaN input would reach both ranks through the activation all-reduce).
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.net = make_net()

    def training_step(self, batch, batch_idx):
        loss = nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.log("train/loss", loss)
        return loss

    def on_after_backward(self):
        if self.global_rank == self.nan_rank and self.trainer.global_step == self.nan_batch:
            grad = self.net[0].weight.grad
            (grad.to_local() if isinstance(grad, DTensor) else grad)[0, 0] = float("nan")

    def train_dataloader(self):
        x, y = regression_data(self.n).tensors
        if self.drop_batch is not None:
            keep = torch.ones(len(x), dtype=torch.bool)
            keep[self.drop_batch * self.batch_size : (self.drop_batch + 1) * self.batch_size] = False
            x, y = x[keep], y[keep]
        return DataLoader(TensorDataset(x, y), batch_size=self.batch_size, shuffle=False)


def tp_state(trainer) -> dict:
    return {"module": flat_module(trainer.lightning_module)}


def tp(**kw):
    return TensorParallelStrategy(start_method="fork", **kw)


def test_tp_raise_stops_both_ranks_before_the_average_and_the_step(tmp_path):
    """nonfinite='raise' under tensor parallelism: one flag all-reduce; both ranks raise at global step 2 naming
    rank 1 (its own shard's gradient), before the data-parallel average and the optimizer step."""
    with pytest.raises(ProcessRaisedException, match=r"TensorParallelStrategy\(nonfinite='raise'\): non-finite gradients "
                                                     r"\(NaN/Inf\) on rank\(s\) \[1\] at global step 2; every rank stops "
                                                     r"here, before the data-parallel gradient average"):
        run(tp(), ShardedRegression(), max_steps=5, callbacks=[Record(tmp_path, tp_state)])
    for record in records(tmp_path):
        assert_same_state(record["before"], record["at"])


def test_tp_skip_step_equals_a_run_without_that_batch(tmp_path):
    """nonfinite='skip_step': both ranks skip global step 2 (optimizer.step only; nothing zeroed) and end where a run
    without that batch ends."""
    assert_skip_step_equals_dropped_batch(
        tmp_path, tp, ShardedRegression, "TensorParallelStrategy(nonfinite='skip_step'): non-finite gradients (NaN/Inf) "
        "on rank(s) [1] at global step 2; every rank skipped that gradient average and optimizer step", steps=6)  # fmt: skip


def test_tp_propagate_writes_the_nan_into_the_weights(tmp_path):
    """nonfinite='propagate': rank 1's NaN gradient shard reaches its weights."""
    run(tp(nonfinite="propagate"), ShardedRegression(), max_steps=4, callbacks=[FinalModule(tmp_path)])
    assert torch.isnan(finals(tmp_path)[1]["module"]).any()


# ---------------------------------------------------------------------------------------------- pipelines
class StagedRegression(ShardedRegression):
    """A 4-layer Linear stack cut into 2 stages; every rank reads every row; rank ``nan_rank`` (stage 0) feeds NaN at
    ``nan_batch``, which the forward carries to stage 1: both stages' gradients are NaN."""

    def __init__(self, nan_rank: int | None = 0, **kwargs):
        super().__init__(nan_rank=nan_rank, **kwargs)
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                                 nn.Linear(8, 2))  # fmt: skip

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_rank == self.nan_rank and batch_idx == self.nan_batch:
            x = x * float("nan")
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def on_after_backward(self):
        pass


def pipeline(**kw):
    return PipelineStrategy(num_stages=2, num_microbatches=2, start_method="fork", **kw)


def test_pipeline_1f1b_raise_stops_both_stages_at_the_update(tmp_path):
    """1f1b, nonfinite='raise': one flag all-reduce at the batch's update; both stages raise at global step 2 naming
    both ranks (stage 0's NaN input reaches stage 1 in the forward), before the update."""
    with pytest.raises(ProcessRaisedException, match=r"PipelineStrategy\(nonfinite='raise'\): non-finite gradients "
                                                     r"\(NaN/Inf\) on rank\(s\) \[0, 1\] at global step 2; every rank "
                                                     r"stops here, before this update"):
        run(pipeline(), StagedRegression(), max_steps=5, callbacks=[Record(tmp_path, tp_state)])
    for record in records(tmp_path):
        assert_same_state(record["before"], record["at"])


def test_pipeline_1f1b_skip_step_equals_a_run_without_that_batch(tmp_path):
    """1f1b, nonfinite='skip_step': both stages skip global step 2's update and end where a run without that batch
    ends."""
    assert_skip_step_equals_dropped_batch(
        tmp_path, pipeline, StagedRegression, "PipelineStrategy(nonfinite='skip_step'): non-finite gradients (NaN/Inf) "
        "on rank(s) [0, 1] at global step 2; every rank skipped that batch's update", steps=6)  # fmt: skip


def test_pipeline_pipedream_raise_stops_the_stage_that_found_it(tmp_path):
    """pipedream, nonfinite='raise': the stages update at different moments, so the first stage to find NaN gradients
    stops alone before its update, naming itself (the launcher ends the other); skip_step is refused for this
    schedule at construction."""
    with pytest.raises(ProcessRaisedException, match=r"on rank\(s\) \[(\d)\] at global step 2; rank \1 stops here, "
                                                     r"before this update"):
        run(pipeline(schedule="pipedream"), StagedRegression(), max_steps=5,
            callbacks=[Record(tmp_path, tp_state, barrier=False)])  # fmt: skip
    stopped = [torch.load(path, weights_only=False) for path in sorted(tmp_path.glob("rank*.pt"))]
    assert stopped and all(all_finite([record["at"]["module"]]) for record in stopped)
    for schedule in ("pipedream", "2bw"):
        with pytest.raises(ValueError, match=rf"PipelineStrategy\(nonfinite='skip_step'\): skip_step needs every rank to "
                                             rf"agree before an update, which schedule='{schedule}' never waits for"):
            PipelineStrategy(schedule=schedule, nonfinite="skip_step")


def test_pipeline_propagate_writes_the_nan_into_the_weights(tmp_path):
    """nonfinite='propagate': the NaN batch's gradients reach both stages' weights."""
    run(pipeline(nonfinite="propagate"), StagedRegression(), max_steps=4, callbacks=[FinalModule(tmp_path)])
    assert all(torch.isnan(final["module"]).any() for final in finals(tmp_path))
