"""Local SGD (periodic model averaging, post-local SGD) as a Lightning Fabric strategy."""

from __future__ import annotations

from typing import Any

from lightning_pdist.averaging.rules import LocalSGDRule
from lightning_pdist.averaging.fabric import ModelAveragingFabricStrategy
from lightning_pdist.core.compression import Compressor

__all__ = ["LocalSGDFabricStrategy"]


class LocalSGDFabricStrategy(ModelAveragingFabricStrategy):
    """Local SGD: each rank steps on its own gradients; parameters are averaged every ``period`` steps.

    The rule of :class:`~lightning_pdist.averaging.local_sgd_strategy.LocalSGDStrategy` (Stich 2019; Lin et al. 2020):
    optimizer steps ``1..warmup_steps`` average gradients (exactly DDP); afterwards, after step ``t`` with
    ``(t - warmup_steps) % period == 0``, every rank loads ``mean_i w_i`` (parameters and floating-point buffers).

    Args:
        period: local steps between averages (8).
        warmup_steps: leading steps that run as plain DDP (0).
        compression: a compressor from :mod:`lightning_pdist.compression` (e.g. ``TopK(0.01)``) for the model delta
            since the last synchronization, with error feedback per rank (``docs/algorithms/compression.md``).
        **kwargs: passed to Fabric's :class:`~lightning.fabric.strategies.DDPStrategy`.

    Example::

        fabric = Fabric(accelerator="cpu", devices=2, strategy=LocalSGDFabricStrategy(period=4))
    """

    strategy_name = "local_sgd"

    def __init__(self, period: int = 8, warmup_steps: int = 0, compression: Compressor | None = None,
                 **kwargs: Any) -> None:
        rule = LocalSGDRule(period=period, warmup_steps=warmup_steps, owner=type(self).__name__)
        super().__init__(rule=rule, compression=compression, **kwargs)
