"""Lightning wiring: when things happen (hooks, lifecycle, checkpoints, logging)."""

from lightning_pdist.strategies.base import PdistStrategy
from lightning_pdist.strategies.bmuf import BMUFStrategy
from lightning_pdist.strategies.easgd import EASGDStrategy
from lightning_pdist.strategies.local_sgd import LocalSGDStrategy
from lightning_pdist.strategies.parameter_server import ParameterServerStrategy
from lightning_pdist.strategies.pipeline import PipelineStrategy
from lightning_pdist.strategies.signsgd import SignSGDStrategy
from lightning_pdist.strategies.simuparallel_sgd import SimuParallelSGDStrategy
from lightning_pdist.strategies.tensor_parallel import TensorParallelStrategy

__all__ = ["BMUFStrategy", "EASGDStrategy", "LocalSGDStrategy", "PdistStrategy", "SignSGDStrategy", "SimuParallelSGDStrategy"]
__all__ += ["ParameterServerStrategy", "PipelineStrategy", "TensorParallelStrategy"]
