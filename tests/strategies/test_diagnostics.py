"""Algorithm diagnostics in the loggers (issue 12): each against an independent computation in plain torch.

Real 2-rank fork runs with a CSVLogger; what the CSV holds is what every logger receives (rank 0's figures).
"""

from __future__ import annotations

import csv

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
