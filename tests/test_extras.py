"""The core package imports and trains without scikit-learn and matplotlib; what needs them names the extra."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from lightning_pdist.extras import EXTRAS, require, require_extra

ROOT = Path(__file__).resolve().parents[1]
# Top-level names in site-packages that belong to scikit-learn or matplotlib (packages, dist-info, vendored libs).
HIDDEN = ("sklearn", "scikit_learn", "matplotlib", "mpl_toolkits", "pylab")

# Run in a Python that cannot see them at all (neither import nor package metadata, as in a clean environment).
CHILD = textwrap.dedent('''
    import importlib, pkgutil, sys
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_pdist
    from lightning_pdist import cli
    from lightning_pdist.data import DigitsDataModule

    skipped = ("lightning_pdist.bench", "lightning_pdist.demo")  # need the bench/demo extras at run time only
    for info in pkgutil.walk_packages(lightning_pdist.__path__, "lightning_pdist."):
        if not info.name.startswith(skipped):
            importlib.import_module(info.name)
    assert not {"sklearn", "matplotlib"} & set(sys.modules), "imported by the core"

    class Regression(L.LightningModule):  # a user's own module and data
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(4, 1)
        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    if __name__ == "__main__":
        data = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy="bmuf_fork", max_steps=4, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(Regression(), data)
        assert trainer.state.finished, trainer.state
        try:
            DigitsDataModule().setup("fit")
        except ImportError as error:
            print("DIGITS:", error)
        assert not {"sklearn", "matplotlib"} & set(sys.modules)
        print("TRAINED")
''')


def _site_packages_without(folder: Path, hidden: tuple[str, ...]) -> Path:
    """A copy of this environment's site-packages (links) without the entries whose top-level name is in ``hidden``."""
    folder.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if entry.name.split("-")[0].split(".")[0].lower() not in hidden:
            (folder / entry.name).symlink_to(entry)
    return folder


@pytest.mark.standalone
def test_core_imports_and_trains_without_sklearn_and_matplotlib(tmp_path):
    """Every module but bench/demo imports, and a user's module trains with strategy='bmuf' on 2 ranks, in an
    environment with neither installed; the digits then say which extra to install."""
    site = _site_packages_without(tmp_path / "site", HIDDEN)
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(site)]), PYTHONNOUSERSITE="1")
    # -S: no site-packages of our own environment, only the filtered links on PYTHONPATH
    done = subprocess.run([sys.executable, "-S", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "TRAINED" in done.stdout
    assert ("DIGITS: DigitsDataModule (scikit-learn's bundled digits) needs scikit-learn, which is not installed: "
            "pip install 'lightning_pdist[demo]'") in done.stdout  # fmt: skip


def test_require_names_the_extra_to_install():
    """A missing optional module is an ImportError naming what needs it, the pip name and the extra."""
    with pytest.raises(ImportError, match=r"^the plot needs no-such-pkg, which is not installed: "
                                          r"pip install 'lightning_pdist\[bench\]'$"):  # fmt: skip
        require("no-such-pkg", "bench", "the plot")
    assert require("json", "demo", "x").__name__ == "json"


def test_require_extra_checks_every_module_of_the_extra(monkeypatch):
    """require_extra refuses before any work if one of the extra's modules is missing (scikit-learn named by pip name)."""
    require_extra("demo", "the demo")  # the dev environment has them
    monkeypatch.setitem(sys.modules, "sklearn", None)  # find_spec reports a None entry as not installed
    with pytest.raises(ImportError, match=r"^the demo needs scikit-learn, which is not installed: "
                                          r"pip install 'lightning_pdist\[demo\]'$"):  # fmt: skip
        require_extra("demo", "the demo")
    assert set(EXTRAS) == {"demo", "bench"}


def test_the_extras_are_declared_in_pyproject_and_dev_includes_them():
    """pyproject's demo/bench extras hold scikit-learn and matplotlib, the core dependencies do not, dev has both."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = lambda reqs: {r.split(">")[0].split("=")[0].split("[")[0].strip() for r in reqs}  # noqa: E731
    assert not {"scikit-learn", "matplotlib"} & names(project["dependencies"])
    for extra in ("demo", "bench", "dev"):
        assert {"scikit-learn", "matplotlib"} <= names(project["optional-dependencies"][extra]), extra
