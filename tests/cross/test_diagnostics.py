"""Algorithm diagnostics in the loggers (issue 12): each against an independent computation in plain torch.

Real 2-rank fork runs with a CSVLogger; what the CSV holds is what every logger receives (rank 0's figures).
"""

from __future__ import annotations

import csv
import math
import os

import pytest
import torch
from _helpers import TinyRegression, fit, make_net, reference_replicas
from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger

from lightning_pdist import BMUFStrategy, EASGDStrategy, LocalSGDStrategy


def _series(tmp_path, key: str) -> dict[int, float]:
    """``{step: value}`` of ``key`` in the run's metrics.csv (rows where it is set)."""
    (path,) = tmp_path.glob("**/metrics.csv")
    return {int(r["step"]): float(r[key]) for r in csv.DictReader(open(path)) if r.get(key)}


def _divergence_at_syncs(sync):
    """Wrap a reference ``sync(flats, state)``: record rank 0's ‖w_0 − mean‖ / ‖mean‖ before each synchronization."""
    seen = []

    def wrapped(flats, state):
        mean = torch.stack(flats).mean(0)
        seen.append(float((flats[0] - mean).norm() / mean.norm()))
        return sync(flats, state)

    return wrapped, seen


def _average(flats, state):
    mean = torch.stack(flats).mean(0)
    return [mean.clone() for _ in flats]


def _easgd(alpha):
    def sync(flats, state):
        center = state.get("center", torch.cat([p.detach().reshape(-1) for p in make_net().parameters()]))
        d = [x - center for x in flats]
        state["center"] = center + alpha * torch.stack(d).sum(0)
        return [x - alpha * di for x, di in zip(flats, d)]

    return sync


@pytest.mark.parametrize(
    ("name", "period", "every", "steps", "logged"),
    [
        # syncs after 3, 6, 9, 12; logged batches 2..12: none at 2 and 8 (and the value of 6 must not reappear at 8)
        ("local_sgd", 3, 2, 12, {3: [0], 5: [1], 9: [2], 11: [3]}),
        # syncs after 2, 4, 6, 8, 10; logged at 5 and 10: the mean of the syncs in each interval
        ("local_sgd", 2, 5, 10, {4: [0, 1], 9: [2, 3, 4]}),
        ("easgd", 2, 5, 10, {4: [0, 1], 9: [2, 3, 4]}),  # its all-reduce is Σ_i x_i: the mean is that / N
        ("bmuf", 2, 5, 10, {4: [0, 1], 9: [2, 3, 4]}),  # block_momentum=0, block_lr=1: local SGD's trajectory
    ],
)
def test_replica_divergence_before_each_sync_is_averaged_between_logged_steps(tmp_path, name, period, every, steps,
                                                                              logged):  # fmt: skip
    """pdist/avg/divergence = rank 0's ‖w_0 − mean(w)‖ / ‖mean(w)‖ before each sync (plain-torch local SGD/EASGD;
    BMUF without block momentum is local SGD),
    logged as the mean over the syncs since the previous logged step; absent where no sync happened."""
    make = {"local_sgd": lambda: LocalSGDStrategy(period=period, start_method="fork"),
            "bmuf": lambda: BMUFStrategy(period=period, block_momentum=0.0, start_method="fork"),
            "easgd": lambda: EASGDStrategy(period=period, alpha=0.3, start_method="fork")}[name]  # fmt: skip
    fit(make(), TinyRegression(), max_steps=steps, logger=CSVLogger(tmp_path, name="run"), log_every_n_steps=every)
    sync, seen = _divergence_at_syncs(_easgd(0.3) if name == "easgd" else _average)
    reference_replicas(2, steps, sync, period)
    assert len(seen) == steps // period and min(seen) > 0
    got = _series(tmp_path, "pdist/avg/divergence")
    assert sorted(got) == sorted(logged)
    for step, syncs in logged.items():
        assert got[step] == pytest.approx(sum(seen[i] for i in syncs) / len(syncs), rel=1e-5), step


def test_interval_means_weights_and_forgets():
    """IntervalMeans: the weighted mean of what was noted since the last take; nothing noted, nothing returned."""
    from lightning_pdist.core.run_logging import IntervalMeans

    means = IntervalMeans()
    assert not means and means.take() == {}
    means.note("a", 1.0)
    means.note("a", 4.0, weight=2.0)
    means.note("b", 5.0)
    assert means and means.take() == {"a": 3.0, "b": 5.0}
    assert means.take() == {}


# ---------------------------------------------------------------------------------------------------- sign votes
def _sign_reference(steps: int, lr: float, aggregation: str, estimator: str, warmup: int) -> list[dict]:
    """Plain-torch signSGD-MV / IT-signSGD on 2 ranks (TinyRegression's data and net): per step, rank 0's share of
    coordinates whose sign differs from the vote, the share of ties, and each worker's weight after the step."""
    from _helpers import rank_batches, regression_data

    data, net = regression_data(64), make_net()
    per_epoch = len(rank_batches(data, 0, 2, 4))
    d = sum(p.numel() for p in net.parameters())
    columns = d if estimator == "coordinate" else 1
    k, t = torch.zeros(2, columns, dtype=torch.float64), torch.zeros(columns, dtype=torch.float64)
    out = []
    for step in range(steps):
        signs = []
        for r in range(2):
            x, y = rank_batches(data, r, 2, 4, step // per_epoch)[step % per_epoch]
            net.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            g = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
            signs.append(torch.where(g >= 0, 1, -1))
        y_ = torch.stack(signs)  # (2, d)
        majority = torch.where(y_.sum(0) >= 0, 1, -1)
        w = torch.log((t + 1 - k) / (k + 1)).clamp(0, math.log(99)).float()  # (2, columns)
        if aggregation == "majority" or step < warmup:
            vote = majority
        else:
            total = torch.zeros(d) + w[0] * y_[0]
            total = total + w[1] * y_[1]
            tie = total.abs() <= 2 * torch.finfo(torch.float32).eps * (w[0].abs() + w[1].abs())
            vote = torch.where(tie, majority, torch.where(total >= 0, 1, -1))
        differs = (y_ != vote).to(torch.float64)  # (2, d)
        k += differs if estimator == "coordinate" else differs.sum(1, keepdim=True)
        t += 1.0 if estimator == "coordinate" else float(d)
        weights = torch.log((t + 1 - k) / (k + 1)).clamp(0, math.log(99)).mean(1)  # equal observations per column
        out.append({"disagreement": float(differs[0].mean()), "tie": float((y_.sum(0) == 0).double().mean()),
                    "weights": weights.tolist()})  # fmt: skip
        with torch.no_grad():
            flat = torch.nn.utils.parameters_to_vector(net.parameters()) - lr * vote
            torch.nn.utils.vector_to_parameters(flat, net.parameters())
    return out


@pytest.mark.parametrize(("aggregation", "estimator"), [("majority", "worker"), ("llr", "worker"),
                                                       ("llr", "coordinate")])  # fmt: skip
def test_vote_statistics_match_a_plain_torch_vote(tmp_path, aggregation, estimator):
    """pdist/sign/disagreement (rank 0's sign against U) and pdist/sign/tie_rate are the means over the votes since
    the previous logged step; IT-signSGD's pdist/sign/llr_weight/rank{r} are the weights its counts give after the
    logged step (per coordinate: their mean, from every rank's slice); all against plain-torch votes."""
    from lightning_pdist import SignSGDStrategy

    steps, every, lr, warmup = 6, 3, 0.005, 2
    llr = {"warmup_rounds": warmup, "estimator": estimator} if aggregation == "llr" else {}
    strategy = SignSGDStrategy(aggregation, **llr, start_method="fork")
    fit(strategy, TinyRegression(lr=lr), max_steps=steps, logger=CSVLogger(tmp_path, name="run"), log_every_n_steps=every)
    ref = _sign_reference(steps, lr, aggregation, estimator, warmup)
    assert 0 < max(r["disagreement"] for r in ref) and 0 < max(r["tie"] for r in ref) < 1
    for key, field in (("pdist/sign/disagreement", "disagreement"), ("pdist/sign/tie_rate", "tie")):
        got = _series(tmp_path, key)
        assert sorted(got) == [2, 5], key
        for step in (2, 5):
            want = sum(r[field] for r in ref[step - 2 : step + 1]) / 3
            assert got[step] == pytest.approx(want, abs=1e-6), (key, step)
    for rank in range(2):
        got = _series(tmp_path, f"pdist/sign/llr_weight/rank{rank}")
        if aggregation == "majority":
            assert not got
            continue
        assert sorted(got) == [2, 5]
        for step in (2, 5):
            assert got[step] == pytest.approx(ref[step]["weights"][rank], rel=1e-5), (rank, step)


# ---------------------------------------------------------------------------------------------------- parameter server
def _ps(**kwargs):
    from lightning_pdist import ParameterServerStrategy

    return ParameterServerStrategy(start_method="fork", **kwargs)


class _WorkerPids(Callback):
    """Writes each rank's pid: a worker's HELLO names it, so its digits count in the servers' bytes in."""

    def __init__(self, dirpath):
        self.dirpath = dirpath

    def setup(self, trainer, pl_module, stage):
        (self.dirpath / f"pid{trainer.global_rank}").write_text(str(os.getpid()))


def test_server_load_is_summed_between_logged_steps(tmp_path):
    """Sync, 2 servers: each server's logged bytes in/out at a logged step are the sum of its per-step figures (the
    same run logged every step) over the interval, never a sample; the steps after the last logged one come at the
    end of fit."""
    keys = [f"pdist/ps/server{s}_bytes_{d}" for s in range(2) for d in ("in", "out")]
    runs = {"each": {}, "every3": {"log_every_n_steps": 3}}
    for name, kwargs in runs.items():
        (tmp_path / name).mkdir()
        fit(_ps(num_servers=2), TinyRegression(), max_steps=7, logger=CSVLogger(tmp_path / name, name="run"),
            callbacks=[_WorkerPids(tmp_path / name)], **kwargs)  # fmt: skip
    each = {key: _series(tmp_path / "each", key) for key in keys}
    assert all(sorted(each[key]) == list(range(7)) and min(each[key].values()) > 0 for key in keys)
    # pids wrap at pid_max (32768 here): a worker whose pid has one more digit in the second run sends one more byte
    digits = {name: sum(len((tmp_path / name / f"pid{r}").read_text()) for r in range(2)) for name in runs}
    for key in keys:
        got = _series(tmp_path / "every3", key)
        assert sorted(got) == [2, 5, 7]
        # the first interval holds both workers' set-up requests in both runs (counted from the servers' start)
        setup = digits["every3"] - digits["each"] if key.endswith("_in") else 0
        assert (got[2], got[5], got[7]) == (sum(each[key][s] for s in range(3)) + setup,
                                            sum(each[key][s] for s in range(3, 6)), each[key][6]), key  # fmt: skip


def test_staleness_histogram_of_one_async_worker_is_all_fresh(tmp_path):
    """One async worker is never stale: each interval's histogram is its pushes, once per server, at staleness 0."""
    fit(_ps(mode="async", num_servers=2), TinyRegression(), devices=1, max_steps=6,
        logger=CSVLogger(tmp_path, name="run"), log_every_n_steps=3)  # fmt: skip
    assert _series(tmp_path, "pdist/ps/staleness_hist/0") == {2: 6.0, 5: 6.0}
    assert not [k for k in csv.DictReader(open(next(tmp_path.glob("**/metrics.csv")))).fieldnames
                if k.startswith("pdist/ps/staleness_hist/") and k != "pdist/ps/staleness_hist/0"]  # fmt: skip


def test_histogram_goes_to_wandb_and_tensorboard_as_a_histogram(tmp_path):
    """log_histogram: an offline W&B run holds a histogram under the key; TensorBoard gets add_histogram_raw with
    the bins' counts; a CSV logger gets the non-zero bins as scalars."""
    from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

    from lightning_pdist.core.run_logging import log_histogram

    class Recorder:
        def __init__(self):
            self.calls = []

        def add_histogram_raw(self, tag, **kwargs):
            self.calls.append((tag, kwargs))

    class FakeTensorBoard(TensorBoardLogger):  # tensorboard is not installed here: only what log_histogram uses
        experiment = Recorder()

    tb = object.__new__(FakeTensorBoard)
    wandb_logger = WandbLogger(offline=True, save_dir=str(tmp_path), project="pdist-test")
    csv_logger = CSVLogger(tmp_path, name="csv")

    class Trainer:
        is_global_zero, global_step, loggers = True, 7, [wandb_logger, tb, csv_logger]

    log_histogram(Trainer(), "pdist/ps/staleness_hist", [4, 0, 2])
    wandb_logger.experiment.finish()
    import wandb

    wandb.teardown()  # stops wandb's service process (wandb-core), which would otherwise outlive the test
    csv_logger.save()
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    records = run_file.read_bytes()
    assert b"pdist/ps/staleness_hist" in records and b"histogram" in records
    ((tag, raw),) = FakeTensorBoard.experiment.calls
    assert tag == "pdist/ps/staleness_hist" and raw["bucket_counts"] == [4.0, 0.0, 2.0] and raw["global_step"] == 7
    assert raw["num"] == 6.0 and raw["sum"] == 4.0 and raw["sum_squares"] == 8.0 and (raw["min"], raw["max"]) == (0.0, 2.0)
    rows = list(csv.DictReader(open(next((tmp_path / "csv").glob("**/metrics.csv")))))
    assert [(r["step"], r.get("pdist/ps/staleness_hist/0"), r.get("pdist/ps/staleness_hist/2")) for r in rows] == [
        ("7", "4.0", "2.0")]
    assert "pdist/ps/staleness_hist/1" not in rows[0]
