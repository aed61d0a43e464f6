"""Gradient compression as values that compose with the strategies (``docs/algorithms/compression.md``).

``PdistStrategy(compression=TopK(0.01))`` compresses DDP's gradients; ``BMUFStrategy(compression=...)`` and
``LocalSGDStrategy(compression=...)`` the model delta since the last synchronization. Every compressor implements
:class:`lightning_pdist.core.compression.Compressor`.
"""

from lightning_pdist.core.lazy import lazy_names

__getattr__, __dir__ = lazy_names(__name__, {  # imported on first use: importing a transport module stays Lightning-free
    "PowerSGD": "powersgd",
    "BF16": "quantizers",
    "FP16": "quantizers",
    "QSGD": "quantizers",
    "Sign": "quantizers",
    "TernGrad": "quantizers",
    "DGC": "sparsifiers",
    "RandomK": "sparsifiers",
    "TopK": "sparsifiers",
})

__all__ = ["BF16", "DGC", "FP16", "PowerSGD", "QSGD", "RandomK", "Sign", "TernGrad", "TopK"]
