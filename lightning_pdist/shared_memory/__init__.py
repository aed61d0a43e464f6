"""Shared-memory asynchronous SGD on one machine: Hogwild!, HogBatch, AsySVRG (``docs/algorithms/hogwild.md``).

Math: ``config.py`` (the settings and their rules), ``svrg.py`` (AsySVRG's direction). Transport: ``memory.py`` (the
weights mapped by every process, the process lock), ``group.py`` (the private gloo group for Lightning's
bookkeeping). Wiring: ``snapshot.py`` (AsySVRG's snapshot on a LightningModule), ``strategy.py``.
"""

from lightning_pdist.shared_memory.config import HogwildConfig
from lightning_pdist.shared_memory.strategy import HogwildStrategy

__all__ = ["HogwildConfig", "HogwildStrategy"]
