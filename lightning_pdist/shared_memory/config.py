"""Hogwild!'s settings, checked at construction (no torch here).

Errors name the argument, the value and the rule: ``HogwildStrategy(lock='yes'): lock must be True or False``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_pdist.core.config import ConfigErrors, is_int

__all__ = ["HogwildConfig", "VARIANCE_REDUCTIONS"]

#: ``variance_reduction`` values: None (Hogwild!/HogBatch) or ``"svrg"`` (AsySVRG).
VARIANCE_REDUCTIONS = (None, "svrg")


@dataclass(frozen=True)
class HogwildConfig(ConfigErrors):
    lock: bool = False
    variance_reduction: str | None = None
    snapshot_every_epochs: int = 1
    implicit_momentum: str | None = None
    owner: str = "HogwildStrategy"

    def __post_init__(self) -> None:
        if not isinstance(self.lock, bool):
            self._fail("lock", "lock must be True (a process lock around each step: the locking baseline) or False "
                               "(lock-free Hogwild!)", TypeError)  # fmt: skip
        if self.variance_reduction not in VARIANCE_REDUCTIONS:
            self._fail("variance_reduction", "variance_reduction must be None (Hogwild!) or 'svrg' (AsySVRG)")
        if not is_int(self.snapshot_every_epochs) or self.snapshot_every_epochs < 1:
            self._fail("snapshot_every_epochs", "snapshot_every_epochs must be an int >= 1 (epochs between SVRG "
                                                "snapshots)", TypeError if not is_int(self.snapshot_every_epochs) else ValueError)  # fmt: skip
        if self.implicit_momentum not in (None, "compensate"):
            self._fail("implicit_momentum", "implicit_momentum must be None or 'compensate' (lower each process's "
                                            "momentum by the 1 − 1/N that N asynchronous processes add)")  # fmt: skip
        if self.variance_reduction is None and self.snapshot_every_epochs != 1:
            self._fail("snapshot_every_epochs", "snapshot_every_epochs only applies with variance_reduction='svrg'; "
                                                "leave it at 1 or set variance_reduction='svrg'")  # fmt: skip

    def check_placement(self, num_nodes: int, devices: Sequence[Any] | None) -> None:
        """Refuse what cannot share one memory: several nodes, an accelerator other than the CPU (``devices``: the
        strategy's ``parallel_devices``, torch devices or their names; none yet means the CPU)."""
        device_type = next((t for t in (str(d).split(":")[0] for d in devices or []) if t != "cpu"), "cpu")
        if num_nodes != 1:
            raise ValueError(f"{self.owner}(num_nodes={num_nodes}): Hogwild! shares the parameters through one "
                             "machine's memory, so every process must run on one node; use num_nodes=1 (or a "
                             "collective strategy such as 'pdist_ddp' across nodes)")  # fmt: skip
        if device_type != "cpu":
            raise ValueError(f"{self.owner}(accelerator={device_type!r}): Hogwild! updates parameters in shared CPU "
                             "memory from several processes; a GPU's memory cannot be mapped by several processes "
                             "this way. Use accelerator='cpu'")  # fmt: skip
