"""The README's example runs as written (one epoch instead of five) and prints once, from rank 0."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.standalone
def test_the_readme_example_runs_and_prints_once(tmp_path):
    readme = (ROOT / "README.md").read_text()
    code = re.search(r"## Example\n\n```python\n(.*?)```", readme, re.S).group(1)
    assert 'if __name__ == "__main__":' in code  # the popen launcher re-runs the script on every rank
    script = tmp_path / "example.py"
    script.write_text(code.replace("max_epochs=5", "max_epochs=1"))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = [line for line in done.stdout.splitlines() if line.startswith("tensor(")]
    assert len(printed) == 1, done.stdout[-2000:]
