"""Transport: how tensors move (counted collectives, DDP comm hooks, packed bits).

Uses ``torch.distributed``; never imports Lightning (``tests/test_layering.py`` enforces this).
"""

from lightning_pdist.comm.accounting import CommMeter
from lightning_pdist.comm.hooks import AllReduceState, allreduce_hook, periodic_allreduce_hook
from lightning_pdist.comm.sign_hooks import ITSignSGDState, SignSGDState, it_signsgd_hook, signsgd_mv_hook

__all__ = [
    "AllReduceState",
    "CommMeter",
    "ITSignSGDState",
    "SignSGDState",
    "allreduce_hook",
    "it_signsgd_hook",
    "periodic_allreduce_hook",
    "signsgd_mv_hook",
]
