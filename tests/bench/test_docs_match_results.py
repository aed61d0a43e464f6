"""docs/benchmarks.md shows what the results files hold: every table the suites' renderers make from
docs/results/*.json appears in it verbatim, so a table edited by hand, or left behind when a results file was
regenerated, fails here."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
SUITES = ["averaging", "sign", "ps_sharding", "pipeline", "tensor_parallel", "compression", "diloco", "asynchronous",
          "parameter_server", "rl"]


def tables(markdown: str) -> list[str]:
    """Each markdown table (a run of lines starting with '|'), as one string."""
    found, current = [], []
    for line in [*markdown.splitlines(), ""]:
        if line.startswith("|"):
            current.append(line.rstrip())
        elif current:
            found.append("\n".join(current))
            current = []
    return found


def _load(name: str) -> dict:
    return json.loads((ROOT / "docs" / "results" / f"{name}.json").read_text())


#: Results files of a suite beyond its own ``<suite>.json`` that docs/benchmarks.md shows: (suite, file stem).
EXTRA = [("ps_sharding", "ps_sharding_spread"), ("ps_sharding", "ps_sharding_paced_4"), ("ps_sharding", "ps_sharding_paced_8"),
         ("ps_sharding", "ps_sharding_ab8_old_replies"), ("ps_sharding", "ps_sharding_ab8_paced_replies"),
         *[("ps_sharding", f"ps_sharding_turns_{run}") for run in ("main_raise", "turns_raise", "main_propagate", "turns_propagate")],
         ("ps_sharding", "ps_sharding_final_4_raise"), ("ps_sharding", "ps_sharding_final_4_propagate"),
         ("ps_sharding", "ps_sharding_final_8_raise"), ("ps_sharding", "ps_sharding_final_8_propagate"),
         ("pipeline", "pipeline_speed"), ("pipeline", "pipeline_post_ahead"), ("pipeline", "pipeline_post_ahead_run1")]


@pytest.mark.parametrize("suite, name", [(s, s) for s in SUITES] + EXTRA)
def test_every_rendered_table_is_in_the_docs(suite, name):
    rendered = importlib.import_module(f"lightning_pdist.bench.{suite}").docs_section(_load(name), f"docs/results/{name}.json")
    made = tables(rendered)
    assert made, f"{suite}: the renderer made no table from docs/results/{name}.json"
    shown = tables(BENCHMARKS.read_text())
    missing = [t.splitlines()[0] for t in made if t not in shown]
    assert not missing, (f"docs/benchmarks.md lacks {len(missing)} of the {len(made)} tables rendered from "
                         f"docs/results/{name}.json (re-run the suite or paste its docs_section.md): {missing}")  # fmt: skip


def test_the_overhead_table_is_in_the_docs():
    from lightning_pdist.bench.averaging import overhead_table

    made = tables(overhead_table(_load("averaging_overhead")["overhead"]["rows"]))
    assert made and set(made) <= set(tables(BENCHMARKS.read_text()))


def test_a_changed_figure_is_caught():
    """The check is not vacuous: one digit changed in a results row gives a table the docs do not hold."""
    doc = _load("ps_sharding")
    row = doc["rows"][0]
    key = next(k for k, v in row.items() if isinstance(v, float) and v)
    row[key] = row[key] * 1.5 + 1
    rendered = importlib.import_module("lightning_pdist.bench.ps_sharding").docs_section(doc, "x.json")
    shown = tables(BENCHMARKS.read_text())
    assert any(t not in shown for t in tables(rendered))
