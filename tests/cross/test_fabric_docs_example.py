"""Tier 3 (standalone): docs/fabric.md's example runs as written (popen: Fabric re-runs the script for rank 1)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
AS_WRITTEN = 'strategy="bmuf"'


@pytest.mark.standalone
def test_the_fabric_example_runs(tmp_path):
    """The example trains, prints each epoch once (rank 0), and leaves a checkpoint with every rank's file."""
    code = re.search(r"## Example\n\n.*?```python\n(.*?)```", (ROOT / "docs" / "fabric.md").read_text(), re.S).group(1)
    assert AS_WRITTEN in code and 'if __name__ == "__main__":' in code
    script = tmp_path / "example.py"
    script.write_text(code)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, env=env,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [float(m) for m in re.findall(r"^epoch \d: global model loss ([\d.]+)$", done.stdout, re.M)]
    assert len(losses) == 3, done.stdout[-2000:]
    assert losses[-1] < losses[0]
    saved = torch.load(tmp_path / "bmuf.ckpt", weights_only=True)
    assert saved["epoch"] == 2 and saved["pdist"]["strategy"] == "BMUFFabricStrategy"
    assert (tmp_path / "bmuf.ckpt.pdist-rank1-of-2").exists()
