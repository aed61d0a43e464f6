"""lightning_pdist: distributed-training algorithms from the literature as Lightning strategies.

Importing the package registers every strategy name with Lightning's ``StrategyRegistry``, so
``Trainer(strategy="bmuf")`` works after ``import lightning_pdist``; the Lightning Fabric strategies
(:mod:`lightning_pdist.fabric`) register with Fabric's own registry, so ``Fabric(strategy="bmuf")`` works too.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_pdist.strategies import (
    BMUFStrategy,
    EASGDStrategy,
    LocalSGDStrategy,
    PdistStrategy,
    SignSGDStrategy,
    SimuParallelSGDStrategy,
)
from lightning_pdist.strategies import ParameterServerStrategy, PipelineStrategy, TensorParallelStrategy

__all__ = ["BMUFStrategy", "EASGDStrategy", "LocalSGDStrategy", "PdistStrategy", "SignSGDStrategy", "SimuParallelSGDStrategy"]
__all__ += ["ParameterServerStrategy", "PipelineStrategy", "TensorParallelStrategy"]
__version__ = "0.1.0"

for _strategy in (PdistStrategy, LocalSGDStrategy, SimuParallelSGDStrategy, BMUFStrategy, EASGDStrategy, SignSGDStrategy):
    _strategy.register_strategies(StrategyRegistry)
ParameterServerStrategy.register_strategies(StrategyRegistry)
PipelineStrategy.register_strategies(StrategyRegistry)
TensorParallelStrategy.register_strategies(StrategyRegistry)

from lightning_pdist import fabric  # noqa: E402, F401  (registers the Fabric strategy names with Fabric's registry)
