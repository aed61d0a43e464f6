"""Importing a family's transport or math never imports Lightning; importing the package registers every name.

The benchmark ranks rely on the first (``PDIST_NO_LIGHTNING=1``, set by the harness): Lightning's import costs ~6 s
of CPU per process here. Users rely on the second: ``import lightning_pdist`` then ``Trainer(strategy="bmuf")``.
"""

import json
import os
import subprocess
import sys

TRANSPORT_AND_MATH = [
    "lightning_pdist.pipeline.executor", "lightning_pdist.pipeline.p2p", "lightning_pdist.core.ps_client",
    "lightning_pdist.parameter_server.process", "lightning_pdist.tensor_parallel.plan", "lightning_pdist.sign.hooks",
    "lightning_pdist.averaging.rules", "lightning_pdist.compression.sparsifiers", "lightning_pdist.diloco.outer",
    "lightning_pdist.core.accounting", "lightning_pdist.bench.launch",
]  # fmt: skip


def _run(code: str, *args: str, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k != "PDIST_NO_LIGHTNING"} | env
    out = subprocess.run([sys.executable, "-c", code, *args], env=environ, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_transport_and_math_import_without_lightning_and_the_names_resolve_on_use():
    code = f"""
import json, sys
for name in {TRANSPORT_AND_MATH!r}:
    __import__(name)
light = "lightning" not in sys.modules and "lightning.pytorch" not in sys.modules
import lightning_pdist
from lightning_pdist.pipeline import PipelineStrategy, build_schedule
from lightning.pytorch.strategies import StrategyRegistry
print(json.dumps({{"light": light, "cls": PipelineStrategy.__module__, "registered": "bmuf" in StrategyRegistry}}))
"""
    got = _run(code, PDIST_NO_LIGHTNING="1")
    assert got == {"light": True, "cls": "lightning_pdist.pipeline.strategy", "registered": False}


def test_importing_the_package_registers_every_trainer_and_fabric_name():
    """Also in a program that merely mentions the hand-started server's module in its arguments (each fresh process
    that imports Lightning costs ~10 s of CPU here: one checks both)."""
    code = """
import gc, json
import lightning_pdist
from lightning.pytorch.strategies import StrategyRegistry
from lightning.fabric.strategies import STRATEGY_REGISTRY
print(json.dumps({"trainer": sorted(StrategyRegistry), "fabric": sorted(STRATEGY_REGISTRY), "all": lightning_pdist.__all__,
                  "dir": [n for n in lightning_pdist.__all__ if n not in dir(lightning_pdist)],
                  "full_collections": gc.get_stats()[2]["collections"], "frozen": gc.get_freeze_count(),
                  "collecting": gc.isenabled()}))
"""
    got = _run(code, "-m", "lightning_pdist.parameter_server.process")
    # lightning_pdist.core.startup: no full collection during the import (Lightning's included), its objects frozen
    # (Lightning's import alone leaves ~430k), the collector on again afterwards
    assert got["full_collections"] == 0 and got["frozen"] > 200_000 and got["collecting"], got
    for name in ("bmuf", "easgd", "local_sgd", "signsgd_mv", "parameter_server", "pipeline", "tensor_parallel", "topk",
                 "powersgd", "diloco", "streaming_diloco", "pdist_ddp"):  # fmt: skip
        assert name in got["trainer"], name
    for name in ("bmuf", "signsgd_mv", "diloco_fork"):
        assert name in got["fabric"], name
    assert got["dir"] == [] and "DiLoCoStrategy" in got["all"]


def test_a_hand_started_parameter_server_imports_no_lightning():
    """``python -m lightning_pdist.parameter_server.process`` (a server host) never imports Lightning (a program that
    merely mentions the module in its arguments still registers every name: the test above)."""
    environ = {k: v for k, v in os.environ.items() if k != "PDIST_NO_LIGHTNING"}
    server = subprocess.run([sys.executable, "-X", "importtime", "-m", "lightning_pdist.parameter_server.process", "--help"],
                            env=environ, capture_output=True, text=True, check=True)  # fmt: skip
    assert "--secret-file" in server.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in server.stderr.splitlines() if "|" in line}
    assert "lightning_pdist.parameter_server.server" in imported and "lightning" not in imported
