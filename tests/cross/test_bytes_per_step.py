"""The bytes every strategy logs per step equal docs/results/bytes.json exactly (``python -m lightning_pdist.bench bytes``).

bytes.json is computed from the byte models alone (:mod:`lightning_pdist.bench.bytes`); here each registered strategy
trains the recipes' digits model on 2 real forked ranks for the steps the file lists, at the recipe's settings, and
every rank's logged ``pdist/comm_bytes`` of every step must be the file's figure. ``nonfinite="raise"`` (the default)
for every strategy; ``"propagate"`` for those where the non-finite agreement changes the figure, in the same fits
where it can be (one fit per strategy and policy). Top-k, DGC and QSGD send a Zstandard code whose length depends
on the gradients: their logged bytes must lie strictly between the file's exact part and the uncoded payload.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.strategies import StrategyRegistry

from lightning_pdist.bench import bytes as byte_models
from lightning_pdist.data import DigitsDataModule

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results" / "bytes.json"
ROWS = {row["strategy"]: row for row in json.loads(RESULTS.read_text())["rows"]}
CODED = {row["strategy"]: row for row in json.loads(RESULTS.read_text())["coded_rows"]}
# PS servers on this host (as recipes/parameter_server.yaml): where they listen changes no byte.
PS_HOST = {"server_host": "127.0.0.1", "allowed_networks": "127.0.0.0/8"}


class LoggedBytes(Callback):
    """Each rank writes its logged pdist/comm_bytes of every step to ``dir/rank{r}.json`` at the end of fit."""

    def __init__(self, out: Path):
        self.out, self.seen = out, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append(int(trainer.callback_metrics["pdist/comm_bytes"]))

    def on_train_end(self, trainer, pl_module):
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.seen))


def _measure(name: str, policy: str, tmp_path: Path) -> list[list[int]]:
    row = ROWS.get(name) or CODED[name]
    entry = StrategyRegistry[name]
    kwargs = {**entry["init_params"], **row["settings"], "start_method": "fork", "nonfinite": policy}
    if name.startswith("parameter_server"):
        kwargs.update(PS_HOST)
    out = tmp_path / f"{name}-{policy}"
    out.mkdir()
    module = byte_models._module.__wrapped__(row["model"])  # a fresh module: the same model and optimizer
    _fit(entry["strategy"](**kwargs), module, row["steps"], LoggedBytes(out))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(byte_models.WORLD)]


def _fit(strategy, module, steps, callback):
    """Fork-launched CPU fit on the digits, every step a logging step (pdist/comm_bytes is then the step's bytes)."""
    trainer = Trainer(accelerator="cpu", devices=byte_models.WORLD, strategy=strategy, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0, callbacks=[callback], log_every_n_steps=1)  # fmt: skip
    trainer.fit(module, DigitsDataModule(batch_size=byte_models.BATCH))


def test_bytes_json_is_what_the_byte_models_give_today():
    """A stale docs/results/bytes.json (the code's byte models changed, the file was not regenerated) fails here."""
    today = byte_models.compute(json.loads(RESULTS.read_text())["command"])
    assert json.loads(RESULTS.read_text()) == json.loads(json.dumps(today))


def test_the_docs_show_the_table():
    """docs/benchmarks.md holds the table the renderer makes from bytes.json (rerun the command, paste its section)."""
    doc = json.loads(RESULTS.read_text())
    table = byte_models.docs_section(doc, "docs/results/bytes.json").split("\n\n", 1)[1].strip()
    assert table in (ROOT / "docs" / "benchmarks.md").read_text()


@pytest.mark.parametrize("name", [n for n, *_ in byte_models.CASES])
def test_logged_bytes_equal_the_byte_models_every_step(name, tmp_path):
    row = ROWS[name]
    for policy in byte_models.POLICIES:
        if policy != "raise" and row[policy] == row["raise"]:
            continue  # the agreement costs nothing here: one fit shows both figures
        assert _measure(name, policy, tmp_path) == row[policy], f"{name}, nonfinite={policy!r}"


@pytest.mark.parametrize("name", [n for n, *_ in byte_models.CODED_CASES])
def test_coded_payloads_lie_between_their_exact_part_and_the_uncoded_payload(name, tmp_path):
    row = CODED[name]
    for rank, logged in enumerate(_measure(name, "raise", tmp_path)):
        assert len(logged) == row["steps"]
        for step, (low, sent, high) in enumerate(zip(row["exact_part"], logged, row["uncoded"]), 1):
            assert low < sent < high, f"{name}, rank {rank}, step {step}: {sent} B not in ({low}, {high})"
