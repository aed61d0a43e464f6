"""The registered Trainer names of the compression family: ``topk``, ``dgc``, ``qsgd``, ``terngrad``, ``powersgd``.

Each is :class:`~lightning_pdist.core.strategy.PdistStrategy` (DDP) with ``compression=`` set to the compressor's
defaults (:data:`REGISTERED`); any other setting is a value away:
``Trainer(strategy=PdistStrategy(compression=TopK(0.001)))``. The same names in Fabric's registry
(:func:`register_fabric_strategies`) are :class:`~lightning_pdist.core.fabric.PdistFabricStrategy` with the same
compressors: ``Fabric(strategy="topk")``.
"""

from __future__ import annotations

from typing import Any

from lightning_pdist.compression.powersgd import PowerSGD
from lightning_pdist.compression.quantizers import QSGD, TernGrad
from lightning_pdist.compression.sparsifiers import DGC, TopK
from lightning_pdist.core.compression import Compressor
from lightning_pdist.core.fabric import PdistFabricStrategy
from lightning_pdist.core.strategy import PdistStrategy, register_variants

__all__ = ["REGISTERED", "register_fabric_strategies", "register_strategies"]

#: name -> (compressor at its defaults, description)
REGISTERED: dict[str, tuple[Compressor, str]] = {
    "topk": (TopK(), "top-k sparsification (1 %) with error feedback"),
    "dgc": (DGC(), "Deep Gradient Compression (0.1 %, momentum correction 0.9)"),
    "qsgd": (QSGD(), "QSGD, 16 levels, Zstandard-coded"),
    "terngrad": (TernGrad(), "TernGrad, 2 bits per entry"),
    "powersgd": (PowerSGD(), "PowerSGD rank 1 (torch's hook)"),
}


def register_strategies(registry: Any) -> None:
    """Register every name of :data:`REGISTERED` with its variants (PdistStrategy with ``compression=``)."""
    for name, (compressor, description) in REGISTERED.items():
        register_variants(registry, PdistStrategy, name, f"{description}: PdistStrategy(compression={compressor!r})",
                          compression=compressor)  # fmt: skip


def register_fabric_strategies(registry: Any) -> None:
    """Register every name of :data:`REGISTERED` with Fabric's registry (PdistFabricStrategy with ``compression=``)."""
    for name, (compressor, description) in REGISTERED.items():
        register_variants(registry, PdistFabricStrategy, name,
                          f"{description} (Lightning Fabric): PdistFabricStrategy(compression={compressor!r})",
                          compression=compressor)  # fmt: skip
