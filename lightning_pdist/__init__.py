"""lightning_pdist: distributed-training algorithms from the literature as Lightning strategies.

Importing the package registers every strategy name with Lightning's ``StrategyRegistry``, so
``Trainer(strategy="bmuf")`` works after ``import lightning_pdist``; the Lightning Fabric strategies
(:mod:`lightning_pdist.fabric`) register with Fabric's own registry, so ``Fabric(strategy="bmuf")`` works too.

One folder per family (averaging, compression, sign, parameter_server, pipeline, tensor_parallel, diloco, decentralized, shared_memory, rl) over :mod:`lightning_pdist.core`;
``docs/architecture.md`` draws the house.
"""

import os
import sys

from lightning_pdist.core.lazy import lazy_names
from lightning_pdist.core.startup import paused_then_frozen

__version__ = "0.1.0"

#: Set to "1" in a process that imports only transport and math (the benchmark harness sets it for its ranks):
#: importing the package then neither imports Lightning nor registers the strategy names.
NO_LIGHTNING_ENV = "PDIST_NO_LIGHTNING"

#: Programs that never train (``python -m <one of these>``): a hand-started parameter server needs neither
#: Lightning nor the strategy names, and importing Lightning costs ~10 s of CPU per process here.
TRANSPORT_PROGRAMS = ("lightning_pdist.parameter_server.process",)

__getattr__, __dir__ = lazy_names(__name__, {
    "PdistStrategy": "core.strategy",
    "BMUFStrategy": "averaging",
    "EASGDStrategy": "averaging",
    "LocalSGDStrategy": "averaging",
    "SimuParallelSGDStrategy": "averaging",
    "SignSGDStrategy": "sign",
    "ParameterServerStrategy": "parameter_server",
    "ParallaxStrategy": "parameter_server",
    "SandblasterStrategy": "parameter_server",
    "PipelineStrategy": "pipeline",
    "TensorParallelStrategy": "tensor_parallel",
    "DiLoCoStrategy": "diloco",
    "StreamingDiLoCoStrategy": "diloco",
    "DecentralizedStrategy": "decentralized",
    "HogwildStrategy": "shared_memory",
    "ApeXStrategy": "rl",
    "GorilaStrategy": "rl",
})

__all__ = ["BMUFStrategy", "EASGDStrategy", "LocalSGDStrategy", "PdistStrategy", "SignSGDStrategy", "SimuParallelSGDStrategy"]
__all__ += ["ParameterServerStrategy", "PipelineStrategy", "TensorParallelStrategy"]
__all__ += ["DiLoCoStrategy", "StreamingDiLoCoStrategy", "DecentralizedStrategy", "HogwildStrategy"]
__all__ += ["ApeXStrategy", "GorilaStrategy", "ParallaxStrategy", "SandblasterStrategy"]


def _register() -> None:
    """Every strategy name into Lightning's ``StrategyRegistry`` (and, through :mod:`lightning_pdist.fabric`, Fabric's)."""
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_pdist import fabric  # noqa: F401  (registers the Fabric strategy names with Fabric's registry)
    from lightning_pdist.compression.strategy import register_strategies as register_compression

    for name in __all__:
        __getattr__(name).register_strategies(StrategyRegistry)
    register_compression(StrategyRegistry)  # topk, dgc, qsgd, terngrad, powersgd: PdistStrategy(compression=...)


def _runs_a_transport_program() -> bool:
    """True while ``python -m <a TRANSPORT_PROGRAMS module>`` imports this package (runpy sets ``argv[0]`` to "-m" then)."""
    argv = getattr(sys, "orig_argv", [])
    return sys.argv[:1] == ["-m"] and any(argv[i : i + 2] == ["-m", m] for i in range(len(argv)) for m in TRANSPORT_PROGRAMS)


# The collector paused for torch's and Lightning's ~430k objects, then frozen: about a third of a fresh process's start-up CPU here
# (lightning_pdist.core.startup says why and how to undo it).
with paused_then_frozen():
    import torch  # noqa: F401  (every family's first import; here, inside the pause)

    if os.environ.get(NO_LIGHTNING_ENV) != "1" and not _runs_a_transport_program():
        _register()
