"""The conformance matrix: every LightningModule in ``modules.py`` × every strategy in ``strategies.py``.

A cell passes when it is either

* **OK**: fit, validate, test, predict, validate from a checkpoint in a fresh Trainer, resume from
  a mid-period checkpoint and ``load_from_checkpoint`` in this (plain) process all run; losses and
  metrics are finite; after fit both ranks hold the same weights and buffers; both ranks report the
  same validation metrics; the resumed run ends where the uninterrupted one did (to 1e-5) when
  module and strategy are deterministic; and the checkpoint loaded without any strategy equals the
  trained model; or
* **a refusal at setup** listed in ``strategies.REFUSALS``, whose message matches, raised on every
  rank before the first step.

Anything else (a crash after setup, a hang, a difference) fails. Each strategy's column runs in one
pair of processes (``runner.py``); results are cached here for the cells of that column and kept in
``runs/conformance/results.json`` for ``python -m tests.conformance.report``, which writes
``docs/compatibility.md``. Each cell also checks its own entry in that file (and its refusal note), and
one test checks the file's frame, so the file is current without one test waiting for every column.
Each column is its own test class, so under ``--dist loadscope`` (scripts/test.sh) the columns spread
over the pytest-xdist workers, each column whole on one.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest
import torch

from _ranks import held_master_port, run_ranks

from tests.conformance import report, runner, strategies
from tests.conformance.modules import MODULES

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "runs" / "conformance"
COLUMN_TIMEOUT_S = 300.0
_columns: dict[str, dict[str, list[dict]]] = {}


def _result_files(root: Path, strategy: str, module: str) -> list[Path]:
    return [root / f"{runner.cell_name(strategy, module)}.rank{r}.json" for r in range(2)]


def _run_pair(strategy: str, modules: list[str], root: Path, timeout_s: float) -> None:
    """One pair of ranks on a port held for it runs ``modules`` in turn; a failed or hung cell shows in the result files."""
    try:
        with held_master_port():
            run_ranks(runner.worker, 2, root, strategy, modules, str(root), timeout=max(timeout_s, 1.0), group=False)
    except Exception:  # noqa: BLE001  (a rank that raised or hung: every rank is killed; the files tell which cell)
        pass


def _launch(strategy: str) -> dict[str, list[dict]]:
    """Run the column in pairs of processes; {module: [rank 0's result, rank 1's]} (a missing cell: it hung)."""
    root = RESULTS / strategy
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    # Imported once here, shared by the forked ranks: `import transformers` alone is lazy, and each rank of every
    # column then imported BERT's modules again (~2.5 s of CPU per rank per pair).
    import transformers.models.bert.modeling_bert  # noqa: F401

    deadline = time.monotonic() + COLUMN_TIMEOUT_S
    remaining = list(MODULES)
    while remaining and time.monotonic() < deadline:
        _run_pair(strategy, remaining, root, deadline - time.monotonic())
        done = [m for m in remaining if all(f.exists() for f in _result_files(root, strategy, m))]
        # A pair stops after a failed cell; the cell after the last one done never finished: it hung.
        hung = remaining[len(done)] if len(done) < len(remaining) and not _stopped_after_failure(root, strategy, done) else None
        remaining = [m for m in remaining if m not in done and m != hung]
    column = {}
    for module in MODULES:
        files = _result_files(root, strategy, module)
        column[module] = [json.loads(f.read_text()) if f.exists() else {"status": "hung", "stage": "?"} for f in files]
    return column


def _stopped_after_failure(root: Path, strategy: str, done: list[str]) -> bool:
    if not done:
        return False
    last = [json.loads(f.read_text()) for f in _result_files(root, strategy, done[-1])]
    return any(r["status"] != "ok" for r in last)


def column(strategy: str) -> dict[str, list[dict]]:
    if strategy not in _columns:
        _columns[strategy] = _launch(strategy)
        report.store(RESULTS / "results.json", strategy, _columns[strategy])
    return _columns[strategy]


def _weights(strategy: str, module: str, run: str, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(RESULTS / strategy / f"{runner.cell_name(strategy, module)}.{run}.rank{rank}.pt")


def _assert_same_weights(a: dict, b: dict, what: str, atol: float = 1e-6) -> None:
    assert a.keys() == b.keys(), what
    for key in a:
        torch.testing.assert_close(a[key].float(), b[key].float(), atol=atol, rtol=0, msg=lambda m: f"{what}, {key}: {m}")


DOC = ROOT / "docs" / "compatibility.md"
REGENERATE = "run: python -m tests.conformance.report"


def _test_cell(strategy: str, module: str) -> None:
    ranks = column(strategy)[module]
    _check_cell(strategy, module, ranks)
    expected = report.expected_cell(strategy, module, report._summary(ranks))
    documented = report.documented_cell(DOC.read_text(), strategy, module)
    if expected[0].startswith("refused") and documented[0].startswith("refused"):
        documented = (expected[0], documented[1])  # the note's number depends on the other cells
    assert documented == expected, f"docs/compatibility.md shows {documented}, this run found {expected}: {REGENERATE}"


def _column_class(strategy: str) -> type:
    """``TestColumn_<strategy>::test_cell[<module>]``: one class per column, so ``--dist loadscope`` keeps a column on
    one pytest-xdist worker (its pair of processes runs once) and spreads the columns over the workers."""

    @pytest.mark.parametrize("module", list(MODULES))
    def test_cell(self, module: str) -> None:
        _test_cell(strategy, module)

    name = f"TestColumn_{strategy}"
    return type(name, (), {"test_cell": test_cell, "__qualname__": name, "__module__": __name__})


for _strategy in strategies.STRATEGIES:
    globals()[f"TestColumn_{_strategy}"] = _column_class(_strategy)


def _check_cell(strategy: str, module: str, ranks: list[dict]) -> None:
    refusal = strategies.REFUSALS.get((strategy, module))
    statuses = [r["status"] for r in ranks]
    if refusal is not None:
        pattern, _ = refusal
        assert statuses == ["error", "error"], f"expected a refusal ({pattern}), got {statuses}"
        for r in ranks:
            assert report.refused_at_setup(r), f"refused after setup (a training batch had begun): {r['message']}"
            assert re.search(pattern, r["message"]), r["message"]
        return
    for r in ranks:
        assert r["status"] == "ok", f"rank stage {r.get('stage')}: {r.get('message')}\n{r.get('traceback', '')}"
    for r in ranks:
        assert runner.finite(r["fit_metrics"]) and (r["fit_metrics"] or r["outputs"]["train"]), r["fit_metrics"]
        assert all(runner.finite(v) for v in r["outputs"].values()), r["outputs"]
        for stage in ("validate", "test", "validate_checkpoint"):
            assert all(runner.finite(d) for d in r[stage]), (stage, r[stage])
        assert r["predict"] and runner.finite(r["predict"])
    assert ranks[0]["validate"] == ranks[1]["validate"], "the ranks report different validation metrics"
    fit0, fit1 = (_weights(strategy, module, "fit", rank) for rank in range(2))
    _assert_same_weights(fit0, fit1, "rank 0 and rank 1 after fit")
    if strategies.STRATEGIES[strategy][2] and MODULES[module].deterministic:
        _assert_same_weights(_weights(strategy, module, "resumed", 0), fit0, "resumed vs uninterrupted", atol=1e-5)
    loaded = type(MODULES[module].make()).load_from_checkpoint(
        RESULTS / strategy / runner.cell_name(strategy, module) / "epoch=1.ckpt", map_location="cpu")  # fmt: skip
    _assert_same_weights({k: v for k, v in loaded.state_dict().items()}, fit0, "load_from_checkpoint vs trained")


def test_the_compatibility_docs_frame_is_current() -> None:
    """docs/compatibility.md has today's text, modules, strategies and refusal numbering (each cell checks its entry)."""
    doc = DOC.read_text()
    table = re.compile(r"^\| .* \|$")
    frame = [line for line in doc.split("\n## Refusals\n")[0].splitlines() if not table.match(line)]
    blank = report.render({})
    assert frame == [line for line in blank.split("\n## Refusals\n")[0].splitlines() if not table.match(line)], REGENERATE
    rows = [line for line in doc.splitlines() if table.match(line)]
    assert rows[0] == next(line for line in blank.splitlines() if table.match(line)), REGENERATE
    assert len(rows) == len(MODULES) + 1, REGENERATE
    assert [r.split(" | ")[0] for r in rows[1:]] == [f"| {m}" for m in MODULES], REGENERATE
    numbers = [int(n) for n in re.findall(r"refused \[(\d+)\]", "\n".join(rows))]
    notes = re.findall(r"^(\d+)\. ", doc.split("\n## Refusals\n")[1], re.MULTILINE)
    assert numbers == list(range(1, len(numbers) + 1)) == [int(n) for n in notes], REGENERATE


def test_a_crash_in_the_first_step_is_not_a_refusal_at_setup() -> None:
    """A fit that failed after its first training batch began (global step still 0) is a failure, not a refusal."""
    refused = {"status": "error", "stage": "fit", "global_step": 0, "batch_started": False, "message": "ValueError: x"}
    crashed = {**refused, "batch_started": True}
    assert report.refused_at_setup(refused) and not report.refused_at_setup(crashed)
    assert not report.refused_at_setup({k: v for k, v in refused.items() if k != "batch_started"})  # unknown: not
    cell = next(iter(strategies.REFUSALS))
    assert report._cell(*cell, report._summary([refused, refused]), []).startswith("refused")
    assert report._cell(*cell, report._summary([crashed, crashed]), []) == "FAIL at fit"
