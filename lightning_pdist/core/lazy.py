"""A package's public names, imported on first use (PEP 562).

A family's ``__init__`` names its public classes without importing them: ``from lightning_pdist.pipeline import
PipelineStrategy`` imports the strategy (and Lightning with it) only then. A process that imports only a family's
transport or math (a benchmark rank, a parameter server started by hand) does not pay Lightning's import (~6 s of
CPU here: Lightning imports torchmetrics, which imports transformers and scipy when they are installed).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable

__all__ = ["lazy_names"]


def lazy_names(package: str, where: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: name ``n`` is ``where[n]``'s attribute ``n`` (a module of the package,
    relative), imported on first access and then kept in the package's namespace."""

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{where[name]}"), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return __getattr__, __dir__
