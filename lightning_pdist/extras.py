"""Optional dependencies: which ``pip`` extra brings what, and an error that names it where one is missing.

Training needs none of them (``Trainer(strategy="bmuf")`` on your own data). The bundled digits (the CLI's and
the recipes' default data) need scikit-learn; the demo and the benchmark plots need matplotlib::

    pip install 'lightning_pdist[demo]'    # scikit-learn + matplotlib: the digits, recipes, python -m lightning_pdist.demo
    pip install 'lightning_pdist[bench]'   # the same, for python -m lightning_pdist.bench <suite>
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

__all__ = ["EXTRAS", "require", "require_extra"]

#: extra -> the modules it installs (each checked by :func:`require_extra`).
EXTRAS: dict[str, tuple[str, ...]] = {"demo": ("sklearn", "matplotlib"), "bench": ("sklearn", "matplotlib")}
_DISTRIBUTION = {"sklearn": "scikit-learn"}  # import name -> what pip calls it


def _missing(module: str, extra: str, purpose: str) -> ImportError:
    top = module.split(".")[0]
    return ImportError(f"{purpose} needs {_DISTRIBUTION.get(top, top)}, which is not installed: "
                       f"pip install 'lightning_pdist[{extra}]'")  # fmt: skip


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """Import ``module``; if it is not installed, ``ImportError`` naming ``purpose`` and the extra to install."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name is not None and error.name.split(".")[0] != module.split(".")[0]:
            raise  # the module is there but one of its own dependencies is not: let that error speak
        raise _missing(module, extra, purpose) from error


def require_extra(extra: str, purpose: str) -> None:
    """``ImportError`` before any work starts if a module of ``extra`` is not installed (nothing is imported)."""
    for module in EXTRAS[extra]:
        if importlib.util.find_spec(module) is None:
            raise _missing(module, extra, purpose)
