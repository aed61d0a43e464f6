"""The house rules, checked on the source with ``ast`` (never ``sys.modules``).

1. A family (averaging, sign, parameter_server, pipeline, tensor_parallel, and every family added later: any folder
   of the package that is not ``core``, ``data``, ``models`` or ``bench``) imports only ``core/`` and itself.
2. ``core/`` imports only ``core/``; nothing outside ``bench/`` (and ``demo.py``, its client) imports ``bench/``.
3. Inside a family (and ``core/``) files have roles: **math** imports torch only (no ``torch.distributed``, no
   Lightning, no transport); **transport** imports no Lightning and no wiring; **wiring** (the rest) may use both.
"""

import ast
import re
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_pdist"
STDLIB = set(sys.stdlib_module_names)
SHARED = ("core", "data", "models", "bench")
FAMILIES = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists() and p.name not in SHARED)

#: Files by role (stem), per folder; whatever is not listed is wiring.
MATH = {
    "core": {"flat", "nonfinite", "accounting", "config", "momentum", "startup"},
    "averaging": {"schedule", "rules", "bmuf", "easgd"},
    "compression": {"sparse", "quantize"},
    "sign": {"vote", "llr", "simulator"},
    "parameter_server": {"sharding", "rules", "elastic", "parallax", "sandblaster", "chunks"},
    "pipeline": {"schedule", "partition", "spectrain", "delayed", "dni", "split", "ownership", "earlier"},
    "tensor_parallel": {"plan", "cost", "regions"},
    "diloco": {"outer", "fragments", "quantize"},
    "decentralized": {"topology", "config"},
    "shared_memory": {"config", "svrg"},
    "rl": {"config", "replay", "nstep", "dqn"},
}
TRANSPORT = {
    "core": {"collectives", "hooks", "liveness", "forking", "compression", "control_group", "push_codec", "ps_wire",
             "ps_auth", "ps_client"},
    "compression": {"codec", "exchange", "base", "sparsifiers", "quantizers", "powersgd"},
    "averaging": {"replicas"},
    "sign": {"bits", "stats", "participation", "overflow", "hooks", "config"},
    "parameter_server": {"shard", "layout", "loop", "server", "process", "coded_push", "parallax_rows",
                         "sandblaster_server"},
    "pipeline": {"p2p", "executor"},
    "tensor_parallel": {"meter", "comm", "layers", "shard"},
    "diloco": {"exchange", "rounds", "fault_tolerance"},
    "decentralized": {"gossip"},
    "shared_memory": {"memory"},
    "rl": {"channel", "actor", "actors", "servers"},
}


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
            names.append(f"lightning_pdist.{path.parent.name}.{node.module or ''}")  # relative: its own folder
    return names


def role(folder: str, stem: str) -> str:
    if stem in MATH.get(folder, ()):
        return "math"
    if stem in TRANSPORT.get(folder, ()):
        return "transport"
    return "wiring"


def _own(name: str) -> tuple[str, str] | None:
    """(folder, stem) of a lightning_pdist module name; None for anything else."""
    parts = name.split(".")
    if parts[0] != "lightning_pdist":
        return None
    return (parts[1] if len(parts) > 1 else "", parts[2] if len(parts) > 2 else "")


def violation(folder: str, stem: str, name: str) -> str | None:
    """Why importing ``name`` from ``lightning_pdist/<folder>/<stem>.py`` breaks a rule (None: allowed)."""
    top = name.split(".")[0]
    mine = role(folder, stem)
    own = _own(name)
    if own is not None:
        target_folder, target_stem = own
        if target_folder == "bench" and folder != "bench":
            return "imports the benchmark harness (a guest: nothing in the library imports it)"
        if folder in ("core", *FAMILIES) and target_folder not in ("core", folder):
            return f"{folder}/ may import only core/ and itself, not {target_folder or 'the package root'}"
        if target_folder in (folder, "core") and target_stem:
            theirs = role(target_folder, target_stem)
            if mine == "math" and theirs != "math":
                return f"math imports {theirs}"
            if mine == "transport" and theirs == "wiring":
                return "transport imports wiring"
        return None
    if mine in ("math", "transport") and top in ("lightning", "pytorch_lightning"):
        return f"{mine} imports Lightning"
    if mine == "math" and name.startswith("torch.distributed"):
        return "math imports torch.distributed"
    if mine == "math" and not (top in STDLIB or top in ("torch", "numpy", "typing_extensions", "__future__")):
        return f"math imports {top}"
    return None


def _package_files():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        folder = rel.parts[0] if len(rel.parts) > 1 else ""
        yield folder, path.stem, path


def test_the_families_are_the_folders():
    assert FAMILIES == ["averaging", "compression", "decentralized", "diloco", "parameter_server", "pipeline",
                        "rl", "shared_memory", "sign", "tensor_parallel"]
    for folder in (*FAMILIES, "core"):
        stems = {p.stem for p in (PACKAGE / folder).glob("*.py")}
        listed = MATH.get(folder, set()) | TRANSPORT.get(folder, set())
        assert listed <= stems, f"{folder}/: roles list files that do not exist: {sorted(listed - stems)}"


def test_every_import_keeps_the_rules():
    """No module imports across a forbidden edge (families, core, bench, roles)."""
    bad = []
    for folder, stem, path in _package_files():
        for name in _imports(path):
            if folder in ("core", *FAMILIES):
                why = violation(folder, stem, name)
            elif folder == "bench" or (folder == "" and stem == "demo"):  # the harness, and the demo: its client
                why = None
            else:  # the package root (cli, fabric, __init__: they curate the families), data/, models/
                why = "imports the benchmark harness" if name.startswith("lightning_pdist.bench") else None
            if why:
                bad.append(f"{path.relative_to(PACKAGE)}: {name}: {why}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("folder, stem, name, expected", [
    ("sign", "hooks", "lightning_pdist.parameter_server.wire", "sign/ may import only core/ and itself, not parameter_server"),
    ("core", "strategy", "lightning_pdist.sign.hooks", "core/ may import only core/ and itself, not sign"),
    ("pipeline", "schedule", "torch.distributed", "math imports torch.distributed"),
    ("pipeline", "schedule", "lightning_pdist.pipeline.p2p", "math imports transport"),
    ("pipeline", "p2p", "lightning.pytorch", "transport imports Lightning"),
    ("parameter_server", "server", "lightning_pdist.parameter_server.strategy", "transport imports wiring"),
    ("averaging", "strategy", "lightning_pdist.bench.report", "imports the benchmark harness (a guest: nothing in the library imports it)"),
    ("averaging", "bmuf", "lightning_pdist.core.flat", None),
    ("sign", "strategy", "lightning.pytorch", None),
    ("sign", "hooks", "lightning_pdist.core.accounting", None),
])
def test_checker_catches_forbidden_edges(folder, stem, name, expected):
    """The checker itself names each kind of forbidden edge, and lets the allowed ones through."""
    assert violation(folder, stem, name) == expected


def test_import_parser_sees_from_imports_of_submodules(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import torch.distributed as dist\nfrom lightning.pytorch import Trainer\nfrom torch import distributed\n")
    assert _imports(f) == ["torch.distributed", "lightning.pytorch", "lightning.pytorch.Trainer", "torch",
                           "torch.distributed"]


def _table_rows(text: str) -> dict[str, list[set[str]]]:
    """docs/architecture.md's "What lives where" rows: folder -> [math, transport, wiring] file stems named there."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`") and cells[0].endswith("/`"):
            rows[cells[0].strip("`/")] = [set(re.findall(r"`(\w+)\.py`", cell)) for cell in cells[1:]]
    return rows


def test_architecture_table_names_every_file_in_its_role():
    """The table a reader learns the house from lists each module of core/ and of every family, in its role's column."""
    rows = _table_rows((PACKAGE.parent / "docs" / "architecture.md").read_text())
    assert sorted(rows) == sorted(("core", *FAMILIES))
    for folder, (math, transport, wiring) in rows.items():
        stems = {p.stem for p in (PACKAGE / folder).glob("*.py")} - {"__init__"}
        by_role = {r: {s for s in stems if role(folder, s) == r} for r in ("math", "transport", "wiring")}
        assert (math, transport, wiring) == (by_role["math"], by_role["transport"], by_role["wiring"]), folder
