"""Importing the package without the garbage collector's full passes, and leaving what it imported frozen.

Importing torch, Lightning and what Lightning imports (torchmetrics, which imports ``transformers``, scipy and
matplotlib when they are installed) allocates ~430k objects that live as long as the process. While they are
allocated, the collector runs a full pass over the whole, growing heap each time it has grown by a quarter; at exit
the interpreter's last collections pass over all of it again. Measured on this project's 2-core CPU machine
(``python -c "import lightning.pytorch"``, CPU seconds, loaded): 13.5 as is, 10.0 with the collector paused during
the import and the imported objects frozen after it. The suite starts a few hundred such processes (ranks,
benchmark workers, the ``pdist`` command); a user's every rank and every ``pdist`` run pays it too.

So ``lightning_pdist/__init__.py`` imports inside :func:`paused_then_frozen`: the collector is paused for the
package's import (Lightning's included, when the package imports it), then every object alive at its end is moved to
the permanent generation (``gc.freeze``), which no later collection examines — the modules, classes and functions
just imported, and whatever the program held before importing the package. The collector is then switched back on
(if it was on). Garbage among the frozen objects is never freed: call ``gc.unfreeze()`` after the import to undo
the freeze. A fork later unfreezes them in the parent (:mod:`lightning_pdist.core.forking`); nothing else does.

Standard library only: it runs before torch is imported.
"""

from __future__ import annotations

import contextlib
import gc
import os
from typing import Iterator

__all__ = ["froze_at_import", "paused_then_frozen"]

_frozen_by: int | None = None  # the pid of the process whose import froze, in it and (copied) in its forked children


@contextlib.contextmanager
def paused_then_frozen() -> Iterator[None]:
    """No automatic collection inside; on leaving, ``gc.freeze()`` and the collector back as it was."""
    global _frozen_by
    collecting, clean = gc.isenabled(), gc.get_freeze_count() == 0
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        # frozen objects already here were inherited (or frozen by the program): then the freeze is not this import's
        _frozen_by = os.getpid() if clean else None
        if collecting:
            gc.enable()


def froze_at_import() -> bool:
    """Whether every frozen object here was frozen by this process's own import of the package (none inherited from
    a fork, none frozen by the program before it)."""
    return _frozen_by == os.getpid()
