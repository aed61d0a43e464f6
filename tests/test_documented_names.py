"""Every lightning_pdist name the README and docs/ mention resolves, and every documented ``python -m`` runs.

The layout moved modules between folders; this keeps what users read true: each dotted name (a module, or an
attribute of one) imports, each ``from lightning_pdist... import X`` line works, each ``python -m lightning_pdist...``
module has a ``--help`` that exits 0, and ``pdist recipes`` lists the recipes.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import runpy
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
DOTTED = re.compile(r"lightning_pdist(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
FROM_IMPORT = re.compile(r"^\s*from (lightning_pdist[\w.]*) import ([\w, ]+)", re.M)
RUN_MODULE = re.compile(r"python -m (lightning_pdist[\w.]*)")


def _mentions(pattern: re.Pattern) -> list[tuple[str, tuple[str, ...]]]:
    found = {}
    for doc in DOCS:
        for match in pattern.finditer(doc.read_text()):
            found.setdefault(match.groups() or (match.group(0),), doc.relative_to(ROOT).as_posix())
    return sorted((where, groups) for groups, where in found.items())


def resolve(dotted: str) -> object:
    """The module or attribute ``dotted`` names: the longest importable prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


@pytest.mark.parametrize("where, name", [(w, g[0]) for w, g in _mentions(DOTTED)])
def test_every_dotted_name_in_the_docs_resolves(where, name):
    try:
        resolve(name.rstrip("."))
    except (ImportError, AttributeError) as err:
        pytest.fail(f"{where} names {name}, which does not resolve: {err}")


@pytest.mark.parametrize("where, line", [(w, g) for w, g in _mentions(FROM_IMPORT)])
def test_every_from_import_in_the_docs_works(where, line):
    module, names = line
    for name in (n.strip() for n in names.split(",") if n.strip()):
        assert hasattr(importlib.import_module(module), name), f"{where}: from {module} import {name}"


def test_the_docs_name_the_moved_modules_at_their_new_home():
    assert ("README.md", ("lightning_pdist.parameter_server.process",)) in _mentions(RUN_MODULE)
    assert not [w for w, (name,) in _mentions(DOTTED) if name.split(".")[1] in ("algorithms", "comm", "strategies", "plugins")]


@pytest.mark.parametrize("module", sorted({g[0] for _, g in _mentions(RUN_MODULE)}))
def test_every_documented_python_dash_m_has_a_help(module, monkeypatch):
    """``python -m module --help`` exits 0 with a usage text, run as ``-m`` runs it (``runpy``, ``__main__``) in this
    process: a fresh interpreter per module cost ~15 s of imports each; ``pdist recipes`` below is a real one."""
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    out = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exited:
        warnings.filterwarnings("ignore", message=".*found in sys.modules", category=RuntimeWarning)
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    assert exited.value.code in (0, None), f"python -m {module} --help exited {exited.value.code}"
    assert "usage" in out.getvalue().lower(), out.getvalue()[-2000:]


def test_pdist_recipes_runs_as_documented():
    result = subprocess.run([sys.executable, "-c", "from lightning_pdist.cli import main; main()", "recipes"],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    for name in ("bmuf", "parameter_server", "pipeline", "tensor_parallel", "signsgd_mv"):
        assert name in result.stdout
