"""1-bit sign voting: signSGD with majority vote (and EF-signSGD, Signum) and IT-signSGD's LLR-weighted vote.

Math: :mod:`.vote`, :mod:`.llr`, :mod:`.simulator`. Transport: :mod:`.bits`, :mod:`.stats`, :mod:`.participation`,
:mod:`.overflow`, :mod:`.hooks` (DDP comm hooks usable without Lightning), :mod:`.config` (``SignSGDConfig``: the
settings and advice both strategies share). Wiring: :mod:`.precision`,
:mod:`.strategy`, :mod:`.fabric`. Card: ``docs/algorithms/signsgd.md``.
"""

from lightning_pdist.sign.config import SignSGDConfig
from lightning_pdist.sign.fabric import SignSGDFabricStrategy
from lightning_pdist.sign.hooks import ITSignSGDState, SignSGDState, it_signsgd_hook, sign_hook_bytes, signsgd_mv_hook
from lightning_pdist.sign.strategy import SignSGDStrategy

__all__ = ["ITSignSGDState", "SignSGDConfig", "SignSGDFabricStrategy", "SignSGDState", "SignSGDStrategy",
           "it_signsgd_hook", "sign_hook_bytes", "signsgd_mv_hook"]  # fmt: skip
