"""Shared-memory asynchronous SGD on one machine: Hogwild!, HogBatch, AsySVRG (``docs/algorithms/hogwild.md``).

Math: ``config.py`` (the settings and their rules), ``svrg.py`` (AsySVRG's direction). Transport: ``memory.py`` (the
weights mapped by every process, the process lock), ``core/control_group.py`` (the private gloo group for Lightning's
bookkeeping). Wiring: ``snapshot.py`` (AsySVRG's snapshot on a LightningModule), ``strategy.py`` (the Trainer), ``fabric.py``
(Hogwild! under Fabric).
"""

from lightning_pdist.core.lazy import lazy_names

__getattr__, __dir__ = lazy_names(__name__, {  # imported on first use: importing a transport module stays Lightning-free
    "HogwildConfig": "config",
    "HogwildStrategy": "strategy",
    "HogwildFabricStrategy": "fabric",
})

__all__ = ["HogwildConfig", "HogwildFabricStrategy", "HogwildStrategy"]
