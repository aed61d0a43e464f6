"""lightning_pdist's algorithms as Lightning Fabric strategies: ``Fabric(strategy="bmuf")`` or a class below.

Importing ``lightning_pdist`` registers the names with Fabric's ``STRATEGY_REGISTRY`` (a registry of its own, apart
from the Trainer's): ``local_sgd``, ``simuparallel_sgd``, ``bmuf``, ``easgd``, ``signsgd_mv``, ``it_signsgd``, ``diloco``, ``streaming_diloco``, ``dpsgd`` and ``hogwild``,
and the compression names ``topk``, ``dgc``, ``qsgd``, ``terngrad``, ``powersgd``
(:class:`PdistFabricStrategy` with ``compression=``), each with ``_fork`` and ``_spawn`` variants and ``_find_unused_parameters_true`` forms. ``docs/fabric.md`` has a
whole training loop, and says per strategy why the parameter server, the pipeline and tensor parallelism have no
Fabric form.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY

from lightning_pdist.compression.strategy import register_fabric_strategies
from lightning_pdist.core.fabric import PdistFabricStrategy
from lightning_pdist.averaging.bmuf_fabric import BMUFFabricStrategy
from lightning_pdist.averaging.easgd_fabric import EASGDFabricStrategy
from lightning_pdist.averaging.local_sgd_fabric import LocalSGDFabricStrategy
from lightning_pdist.sign.fabric import SignSGDFabricStrategy
from lightning_pdist.diloco.fabric import DiLoCoFabricStrategy, StreamingDiLoCoFabricStrategy
from lightning_pdist.averaging.simuparallel_fabric import SimuParallelSGDFabricStrategy
from lightning_pdist.decentralized.fabric import DecentralizedFabricStrategy
from lightning_pdist.shared_memory.fabric import HogwildFabricStrategy

__all__ = ["BMUFFabricStrategy", "DecentralizedFabricStrategy", "EASGDFabricStrategy", "HogwildFabricStrategy", "LocalSGDFabricStrategy", "PdistFabricStrategy",
           "SignSGDFabricStrategy", "SimuParallelSGDFabricStrategy", "DiLoCoFabricStrategy",
           "StreamingDiLoCoFabricStrategy"]  # fmt: skip

for _strategy in (LocalSGDFabricStrategy, SimuParallelSGDFabricStrategy, BMUFFabricStrategy, EASGDFabricStrategy,
                  SignSGDFabricStrategy, DiLoCoFabricStrategy, StreamingDiLoCoFabricStrategy,
                  DecentralizedFabricStrategy, HogwildFabricStrategy):  # fmt: skip
    _strategy.register_strategies(STRATEGY_REGISTRY)
register_fabric_strategies(STRATEGY_REGISTRY)
