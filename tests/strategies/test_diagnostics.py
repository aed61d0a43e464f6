"""Algorithm diagnostics in the loggers (issue 12): each against an independent computation in plain torch.

Real 2-rank fork runs with a CSVLogger; what the CSV holds is what every logger receives (rank 0's figures).
"""

from __future__ import annotations

import csv
import math

import pytest
import torch
from _helpers import TinyRegression, fit, make_net, reference_replicas
from lightning.pytorch.loggers import CSVLogger

from lightning_pdist import EASGDStrategy, LocalSGDStrategy


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
    ],
)
def test_replica_divergence_before_each_sync_is_averaged_between_logged_steps(tmp_path, name, period, every, steps,
                                                                              logged):  # fmt: skip
    """pdist/avg/divergence = rank 0's ‖w_0 − mean(w)‖ / ‖mean(w)‖ before each sync (plain-torch local SGD/EASGD),
    logged as the mean over the syncs since the previous logged step; absent where no sync happened."""
    make = {"local_sgd": lambda: LocalSGDStrategy(period=period, start_method="fork"),
            "easgd": lambda: EASGDStrategy(period=period, alpha=0.3, start_method="fork")}[name]  # fmt: skip
    fit(make(), TinyRegression(), max_steps=steps, logger=CSVLogger(tmp_path, name="run"), log_every_n_steps=every)
    sync, seen = _divergence_at_syncs(_average if name == "local_sgd" else _easgd(0.3))
    reference_replicas(2, steps, sync, period)
    assert len(seen) == steps // period and min(seen) > 0
    got = _series(tmp_path, "pdist/avg/divergence")
    assert sorted(got) == sorted(logged)
    for step, syncs in logged.items():
        assert got[step] == pytest.approx(sum(seen[i] for i in syncs) / len(syncs), rel=1e-5), step


def test_interval_means_weights_and_forgets():
    """IntervalMeans: the weighted mean of what was noted since the last take; nothing noted, nothing returned."""
    from lightning_pdist.strategies.run_logging import IntervalMeans

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
