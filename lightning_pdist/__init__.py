"""lightning_pdist: distributed-training algorithms from the literature as Lightning strategies.

Importing the package registers every strategy name with Lightning's ``StrategyRegistry``, so
``Trainer(strategy="bmuf")`` works after ``import lightning_pdist``; the Lightning Fabric strategies
(:mod:`lightning_pdist.fabric`) register with Fabric's own registry, so ``Fabric(strategy="bmuf")`` works too.

One folder per family (averaging, compression, sign, parameter_server, pipeline, tensor_parallel, diloco, shared_memory) over :mod:`lightning_pdist.core`;
``docs/architecture.md`` draws the house.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_pdist.compression.strategy import register_strategies as _register_compression
from lightning_pdist.averaging import BMUFStrategy, EASGDStrategy, LocalSGDStrategy, SimuParallelSGDStrategy
from lightning_pdist.core.strategy import PdistStrategy
from lightning_pdist.diloco import DiLoCoStrategy, StreamingDiLoCoStrategy
from lightning_pdist.parameter_server import ParameterServerStrategy
from lightning_pdist.pipeline import PipelineStrategy
from lightning_pdist.shared_memory import HogwildStrategy
from lightning_pdist.sign import SignSGDStrategy
from lightning_pdist.tensor_parallel import TensorParallelStrategy

__all__ = ["BMUFStrategy", "EASGDStrategy", "LocalSGDStrategy", "PdistStrategy", "SignSGDStrategy", "SimuParallelSGDStrategy"]
__all__ += ["ParameterServerStrategy", "PipelineStrategy", "TensorParallelStrategy"]
__all__ += ["DiLoCoStrategy", "StreamingDiLoCoStrategy"]
__all__ += ["HogwildStrategy"]
__version__ = "0.1.0"

for _strategy in (PdistStrategy, LocalSGDStrategy, SimuParallelSGDStrategy, BMUFStrategy, EASGDStrategy, SignSGDStrategy):
    _strategy.register_strategies(StrategyRegistry)
ParameterServerStrategy.register_strategies(StrategyRegistry)
PipelineStrategy.register_strategies(StrategyRegistry)
TensorParallelStrategy.register_strategies(StrategyRegistry)
_register_compression(StrategyRegistry)  # topk, dgc, qsgd, terngrad, powersgd: PdistStrategy(compression=...)
DiLoCoStrategy.register_strategies(StrategyRegistry)
StreamingDiLoCoStrategy.register_strategies(StrategyRegistry)
HogwildStrategy.register_strategies(StrategyRegistry)  # hogwild, asysvrg (+ _fork, _spawn)

from lightning_pdist import fabric  # noqa: E402, F401  (registers the Fabric strategy names with Fabric's registry)
