"""What loggers receive: each strategy's resolved settings, comm bytes summed between logged steps, a readable bar."""

from __future__ import annotations

import csv
import json

import pytest
import torch
import yaml
from _helpers import TinyRegression, fit
from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_pdist import BMUFStrategy, LocalSGDStrategy, ParameterServerStrategy
from lightning_pdist.models import ClassifierModule
from lightning_pdist.core.run_logging import human_bytes

MODEL_BYTES = 58 * 4  # TinyRegression in fp32; a ring all-reduce on 2 ranks sends this much per rank


def _hparams(tmp_path) -> dict:
    (path,) = tmp_path.glob("**/hparams.yaml")
    return yaml.safe_load(path.read_text())


def test_bmuf_settings_reach_the_logger_resolved(tmp_path):
    """BMUF's block_momentum=None reaches the logger as 1 - 1/N = 0.5, with the period, world size and nodes."""
    fit(BMUFStrategy(period=3, start_method="fork"), TinyRegression(), max_steps=2,
        logger=CSVLogger(tmp_path, name="run"))  # fmt: skip
    settings = _hparams(tmp_path)["pdist"]
    assert settings["strategy"] == "bmuf" and settings["class"] == "BMUFStrategy"
    assert settings["block_momentum"] == 0.5 and settings["block_lr"] == 1.0 and settings["nesterov"] is True
    assert settings["period"] == 3 and settings["warmup_steps"] == 0
    assert settings["world_size"] == 2 and settings["num_nodes"] == 1 and settings["processes_per_node"] == 2


def test_parameter_server_settings_reach_the_logger(tmp_path):
    """The parameter server's mode, sharding and server count are in the logged config."""
    fit(ParameterServerStrategy(mode="sync", start_method="fork"), TinyRegression(), max_steps=2,
        logger=CSVLogger(tmp_path, name="run"))  # fmt: skip
    settings = _hparams(tmp_path)["pdist"]
    assert settings["strategy"] == "parameter_server" and settings["mode"] == "sync"
    assert settings["sharding"] == "memory" and settings["world_size"] == 2


def test_comm_bytes_are_summed_between_logged_steps_never_sampled(tmp_path):
    """log_every_n_steps=4 over 10 steps of local SGD (warm-up 2, period 3): the logged pdist/comm_bytes add up
    to the total, and the series' last total is the run's total."""
    # nonfinite="propagate": no per-step finiteness flag, so the bytes are the algorithm's alone
    strategy = LocalSGDStrategy(period=3, warmup_steps=2, nonfinite="propagate", start_method="fork")
    fit(strategy, TinyRegression(), max_steps=10, logger=CSVLogger(tmp_path, name="run"), log_every_n_steps=4)
    (path,) = tmp_path.glob("**/metrics.csv")
    rows = list(csv.DictReader(open(path)))
    steps = [float(r["pdist/comm_bytes"]) for r in rows if r.get("pdist/comm_bytes")]
    totals = [float(r["pdist/comm_bytes_total"]) for r in rows if r.get("pdist/comm_bytes_total")]
    # 2 warm-up all-reduces + syncs after steps 5 and 8 = 4 all-reduces of the model
    assert totals[-1] == 4 * MODEL_BYTES
    # logged at steps 4 and 8: the warm-up steps 1, 2, then the syncs after steps 5 and 8; steps 9-10 sent nothing
    assert steps == [2 * MODEL_BYTES, 2 * MODEL_BYTES]


def test_the_tail_after_the_last_logged_step_is_logged_at_the_end(tmp_path):
    """log_every_n_steps=4 over 6 steps of DDP: logged at step 4, then steps 5-6 at the end; they sum to the total."""
    from lightning_pdist import PdistStrategy

    fit(PdistStrategy(start_method="fork"), TinyRegression(), max_steps=6, logger=CSVLogger(tmp_path, name="run"),
        log_every_n_steps=4)  # fmt: skip
    (path,) = tmp_path.glob("**/metrics.csv")
    rows = list(csv.DictReader(open(path)))
    steps = [float(r["pdist/comm_bytes"]) for r in rows if r.get("pdist/comm_bytes")]
    totals = [float(r["pdist/comm_bytes_total"]) for r in rows if r.get("pdist/comm_bytes_total")]
    assert steps == [4 * MODEL_BYTES, 2 * MODEL_BYTES] and totals[-1] == 6 * MODEL_BYTES == sum(steps)


class BarMetrics(Callback):
    """Rank 0 writes what the progress bar shows after validation."""

    def __init__(self, path):
        self.path = path

    def on_validation_end(self, trainer, pl_module):
        if trainer.global_rank == 0 and trainer.state.fn == "fit":
            shown = trainer.progress_bar_callback.get_metrics(trainer, pl_module)
            self.path.write_text(json.dumps({k: v if isinstance(v, (str, int, float)) else str(v)
                                             for k, v in shown.items()}))  # fmt: skip


class DigitsClassifier(ClassifierModule):
    """The recipes' module (val/acc on the progress bar) on random 8x8 images."""

    def train_dataloader(self):
        return self._loader(0)

    def val_dataloader(self):
        return self._loader(1)

    def _loader(self, seed):
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(64, 1, 8, 8, generator=g), torch.randint(0, 10, (64,), generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=8)


@pytest.mark.parametrize(
    ("strategy", "extra"),
    [(lambda: LocalSGDStrategy(period=2, start_method="fork"), None),
     (lambda: ParameterServerStrategy(start_method="fork"), "wait")],
)
def test_progress_bar_shows_comm_with_units_beside_val_acc(tmp_path, strategy, extra):
    """The bar shows comm=<total with a unit>, val/acc, and at most one strategy key; never raw pdist/* floats."""
    out = tmp_path / "bar.json"
    fit(strategy(), DigitsClassifier(), max_steps=4, callbacks=[BarMetrics(out)], enable_progress_bar=True,
        limit_val_batches=1, val_check_interval=4)  # fmt: skip
    shown = json.loads(out.read_text())
    assert not [k for k in shown if k.startswith("pdist/")]
    assert shown["comm"].endswith("B") and shown["comm"][0].isdigit()
    assert "val/acc" in shown and "train/loss" in shown
    extras = set(shown) - {"comm", "v_num", "train/loss", "val/acc"}
    assert extras == ({extra} if extra else set())
    if extra:
        assert shown[extra].endswith("s")


@pytest.mark.parametrize(("n", "text"), [(0, "0B"), (999, "999B"), (76712, "76.7kB"), (11_600_000, "11.6MB"),
                                         (2.5e9, "2.5GB")])  # fmt: skip
def test_human_bytes(n, text):
    """Decimal units, three significant digits."""
    assert human_bytes(n) == text
