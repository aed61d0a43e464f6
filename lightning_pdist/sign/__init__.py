"""1-bit sign voting: signSGD with majority vote (and EF-signSGD, Signum) and IT-signSGD's LLR-weighted vote.

Math: :mod:`.vote`, :mod:`.llr`, :mod:`.simulator`. Transport: :mod:`.bits`, :mod:`.stats`, :mod:`.participation`,
:mod:`.overflow`, :mod:`.hooks` (DDP comm hooks usable without Lightning), :mod:`.config` (``SignSGDConfig``: the
settings and advice both strategies share). Wiring: :mod:`.precision`,
:mod:`.strategy`, :mod:`.fabric`. Card: ``docs/algorithms/signsgd.md``.
"""

from lightning_pdist.core.lazy import lazy_names

__getattr__, __dir__ = lazy_names(__name__, {  # imported on first use: importing a transport module stays Lightning-free
    "SignSGDConfig": "config",
    "SignSGDFabricStrategy": "fabric",
    "ITSignSGDState": "hooks",
    "SignSGDState": "hooks",
    "it_signsgd_hook": "hooks",
    "sign_hook_bytes": "hooks",
    "signsgd_mv_hook": "hooks",
    "SignSGDStrategy": "strategy",
})

__all__ = ["ITSignSGDState", "SignSGDConfig", "SignSGDFabricStrategy", "SignSGDState", "SignSGDStrategy",
           "it_signsgd_hook", "sign_hook_bytes", "signsgd_mv_hook"]  # fmt: skip
