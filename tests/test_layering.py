"""Imports flow one way: algorithms (torch only) <- comm (torch.distributed, no lightning) <- strategies."""

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_pdist"
STDLIB = set(sys.stdlib_module_names)


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from torch import distributed` imports torch.distributed: check module.name too
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            names.append("lightning_pdist." + path.parent.name)  # relative: stays in its own layer
    return names


def _allowed_in_algorithms(name: str) -> bool:
    top = name.split(".")[0]
    if name.startswith("torch.distributed") or top in ("lightning", "pytorch_lightning"):
        return False
    if top == "lightning_pdist":
        return name.startswith("lightning_pdist.algorithms")
    return top in STDLIB or top in ("torch", "numpy", "typing_extensions", "__future__")


def _allowed_in_comm(name: str) -> bool:
    top = name.split(".")[0]
    if top in ("lightning", "pytorch_lightning"):
        return False
    if top == "lightning_pdist":
        return name.startswith(("lightning_pdist.algorithms", "lightning_pdist.comm"))
    return True


@pytest.mark.parametrize(
    "layer, allowed", [("algorithms", _allowed_in_algorithms), ("comm", _allowed_in_comm)], ids=["algorithms", "comm"]
)
def test_layer_imports_only_what_it_may(layer, allowed):
    """No module of the layer imports across a forbidden edge (parsed with ast, not sys.modules)."""
    files = sorted((PACKAGE / layer).glob("*.py"))
    assert files
    bad = [f"{f.name}: {name}" for f in files for name in _imports(f) if not allowed(name)]
    assert not bad, f"forbidden imports in {layer}/: {bad}"


def test_checker_catches_forbidden_edges(tmp_path):
    """The checker itself flags lightning in comm and torch.distributed in algorithms."""
    f = tmp_path / "m.py"
    f.write_text("import torch.distributed as dist\nfrom lightning.pytorch import Trainer\nimport torch\n"
                 "from torch import distributed\n")
    names = _imports(f)
    assert [n for n in names if not _allowed_in_algorithms(n)] == [
        "torch.distributed", "lightning.pytorch", "lightning.pytorch.Trainer", "torch.distributed"
    ]
    assert [n for n in names if not _allowed_in_comm(n)] == ["lightning.pytorch", "lightning.pytorch.Trainer"]
