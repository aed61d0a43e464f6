"""Tier 3: logged per-rank comm bytes follow the accounting model and shrink with the period."""

import pytest
from _helpers import TinyRegression, fit
from lightning.pytorch import Callback

from lightning_pdist import BMUFStrategy, EASGDStrategy, LocalSGDStrategy, PdistStrategy, SimuParallelSGDStrategy

MODEL_BYTES = 58 * 4  # TinyRegression: Linear(4, 8) + Linear(8, 2) in fp32
RING_2 = MODEL_BYTES  # ring all-reduce on 2 ranks sends 2(N-1)/N · n = n bytes per rank
FLAG_2 = 2 * 4  # nonfinite='raise' after warm-up: one all-reduce of 2 float flags per step (n = 8 bytes on 2 ranks)


class RecordLogged(Callback):
    """Collects the logged pdist/comm_bytes of every step and checks the total on rank 0."""

    def __init__(self):
        self.per_step = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.per_step.append(float(trainer.callback_metrics["pdist/comm_bytes"]))

    def on_train_end(self, trainer, pl_module):
        total = float(trainer.callback_metrics["pdist/comm_bytes_total"])
        assert total == sum(self.per_step) == trainer.strategy.comm_meter.total_bytes


def _logged(strategy, steps=12):
    return fit(strategy, TinyRegression(), max_steps=steps, callbacks=[RecordLogged()]).callback_metrics


@pytest.mark.parametrize(
    "make, period",
    [
        (lambda p, **kw: LocalSGDStrategy(period=p, start_method="fork", **kw), 4),
        (lambda p, **kw: BMUFStrategy(period=p, start_method="fork", **kw), 3),
        (lambda p, **kw: EASGDStrategy(period=p, start_method="fork", **kw), 6),
    ],
)
def test_bytes_are_period_times_smaller_than_every_step(make, period):
    """Total logged bytes over 12 steps: every-step path / periodic path == period (the model's bytes, without the
    non-finite flag: nonfinite='propagate'); with the default nonfinite='raise' each step adds the same flag."""
    every_step = float(_logged(make(1, nonfinite="propagate"))["pdist/comm_bytes_total"])
    periodic = float(_logged(make(period, nonfinite="propagate"))["pdist/comm_bytes_total"])
    assert every_step == 12 * RING_2
    assert every_step / periodic == period
    assert float(_logged(make(period))["pdist/comm_bytes_total"]) == periodic + 12 * FLAG_2


def test_ddp_path_logs_ring_all_reduce_of_the_gradients_every_step():
    """pdist_ddp logs 2(N-1)/N · (gradient bytes) on every step."""
    metrics = _logged(PdistStrategy(start_method="fork"), steps=5)
    assert float(metrics["pdist/comm_bytes"]) == RING_2
    assert float(metrics["pdist/comm_bytes_total"]) == 5 * RING_2


def test_local_sgd_logs_bytes_only_on_averaging_steps():
    """Per-step logged bytes are the ring all-reduce on warm-up and sync steps, plus the non-finite flag after warm-up."""

    class Per(Callback):
        def __init__(self):
            self.seen = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.seen.append(float(trainer.callback_metrics["pdist/comm_bytes"]))

        def on_train_end(self, trainer, pl_module):
            expected = [RING_2 if t <= 2 else FLAG_2 + (RING_2 if (t - 2) % 3 == 0 else 0) for t in range(1, 9)]
            assert self.seen == expected, self.seen

    fit(LocalSGDStrategy(period=3, warmup_steps=2, start_method="fork"), TinyRegression(), max_steps=8, callbacks=[Per()])


def test_simuparallel_sends_one_average_in_total():
    """One-shot averaging sends only the non-finite flag while training and one model all-reduce at the end."""

    class Check(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            assert float(trainer.callback_metrics["pdist/comm_bytes_total"]) == FLAG_2 * (batch_idx + 1)

        def on_fit_end(self, trainer, pl_module):
            assert trainer.strategy.comm_meter.total_bytes == RING_2 + 6 * FLAG_2

    fit(SimuParallelSGDStrategy(start_method="fork"), TinyRegression(), max_steps=6, callbacks=[Check()])
