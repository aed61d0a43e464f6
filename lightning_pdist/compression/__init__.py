"""Gradient compression as values that compose with the strategies (``docs/algorithms/compression.md``).

``PdistStrategy(compression=TopK(0.01))`` compresses DDP's gradients; ``BMUFStrategy(compression=...)`` and
``LocalSGDStrategy(compression=...)`` the model delta since the last synchronization. Every compressor implements
:class:`lightning_pdist.core.compression.Compressor`.
"""

from lightning_pdist.compression.powersgd import PowerSGD
from lightning_pdist.compression.quantizers import BF16, FP16, QSGD, Sign, TernGrad
from lightning_pdist.compression.sparsifiers import DGC, RandomK, TopK

__all__ = ["BF16", "DGC", "FP16", "PowerSGD", "QSGD", "RandomK", "Sign", "TernGrad", "TopK"]
