"""The columns of the matrix: every registered strategy family, with settings small enough for 8 steps.

Periods are 3, so the checkpoint after epoch 0 (training step 4) falls mid-period. A strategy is
given by its registered name, as a user would write it; modules with unused parameters get the
``<name>_find_unused_parameters_true`` variant where it exists, as Lightning's own advice says.

``REFUSALS`` lists the cells that must be refused at setup, with the message (a regular
expression) the user sees and the alternative ``docs/compatibility.md`` offers. Every other cell must
run fit → validate → test → predict → resume → ``load_from_checkpoint``. A refusal that starts to
pass, or a pass that starts to refuse, fails the suite.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

import lightning_pdist  # noqa: F401 - registers the strategies
from tests.conformance.modules import MODULES

TIMEOUT = timedelta(seconds=90)  # a rank that fails alone makes the other's next collective fail, not hang

#: name -> (registry name, extra constructor arguments, exact resume, description)
STRATEGIES: dict[str, tuple[str, dict, bool, str]] = {
    "ddp": ("ddp", {}, True, "Lightning's DDP (the baseline)"),
    "pdist_ddp": ("pdist_ddp", {}, True, "DDP with counted comm hooks"),
    "local_sgd": ("local_sgd", {"period": 3}, True, "local SGD, period 3"),
    "simuparallel_sgd": ("simuparallel_sgd", {}, True, "one-shot averaging"),
    "bmuf": ("bmuf", {"period": 3}, True, "BMUF, period 3"),
    "easgd": ("easgd", {"period": 3}, True, "EASGD, period 3"),
    "signsgd_mv": ("signsgd_mv", {}, True, "signSGD with majority vote"),
    "it_signsgd": ("it_signsgd", {"warmup_rounds": 2}, True, "IT-signSGD (LLR vote)"),
    "topk": ("topk", {}, True, "top-k 1 % with error feedback (compressed DDP)"),
    "dgc": ("dgc", {}, True, "Deep Gradient Compression 0.1 %"),
    "parameter_server": ("parameter_server", {"server_timeout": 60.0}, True, "parameter server, sync"),
    "parameter_server_async": ("parameter_server_async", {"server_timeout": 60.0}, False, "parameter server, async"),
    # exchanges land in arrival order (no barrier): the resumed state is exact, the resumed run is not reproducible
    "parameter_server_easgd": ("parameter_server_easgd", {"server_timeout": 60.0, "easgd_period": 3}, False,
                               "parameter server, asynchronous EASGD, τ=3"),
    # no conformance module has a sparse embedding: every cell is refused, naming the rule, before any server starts
    "parallax": ("parallax", {"server_timeout": 60.0}, True, "Parallax (sparse tables on servers, dense all-reduced)"),
    # 2 micro-batches of 2: BatchNorm cannot train on micro-batches of one sample
    "pipeline": ("pipeline", {"num_microbatches": 2}, True, "pipeline, 2 stages, 1F1B, 2 micro-batches"),
    "tensor_parallel": ("tensor_parallel", {}, True, "tensor parallelism, t=2, plan='auto'"),
    "diloco": ("diloco", {"sync_every": 3}, True, "DiLoCo, H=3, Nesterov outer step"),
    "streaming_diloco": ("streaming_diloco", {"sync_every": 4, "num_fragments": 2, "overlap_steps": 1, "quantize": "int8"},
                         True, "Streaming DiLoCo, H=4, P=2, τ=1, int8"),
    "dpsgd": ("dpsgd", {}, True, "D-PSGD, ring (on 2 ranks: the pair)"),
    "adpsgd": ("adpsgd", {}, False, "AD-PSGD, ring, asynchronous pairs"),
    "hogwild": ("hogwild", {}, False, "Hogwild! (lock-free steps on shared memory)"),
    # batch L-BFGS: every module here returns another optimizer, so every cell is refused at setup
    "sandblaster": ("sandblaster", {"server_timeout": 60.0}, True, "Sandblaster L-BFGS (refuses modules whose optimizer is not LBFGS)"),
    # an RL learner is not a supervised module: every cell is refused, before any actor starts (tests/rl trains DQNs)
    "apex": ("apex", {"num_actors": 1}, False, "Ape-X (a DQN learner and actor processes; refuses supervised modules)"),
    "gorila": ("gorila", {"num_actors": 1}, False, "Gorila (DQN learner ranks, actors, parameter servers; refuses supervised modules)"),
}



def strategy_class(name: str) -> type:
    """The class a column's registered name builds."""
    return StrategyRegistry[STRATEGIES[name][0]]["strategy"]


#: Every lightning_pdist strategy class, once: the one list the cross-cutting suites (constructor fuzz, resume)
#: draw from. A new family joins them by joining ``STRATEGIES`` (tests/test_strategy_list.py checks none is missing).
PDIST_CLASSES: list[type] = list(dict.fromkeys(strategy_class(n) for n in STRATEGIES if n != "ddp"))


#: (strategy, module) -> (message regex, the alternative a user has)
_MANUAL = (r"automatic_optimization is False; the pipeline runs every backward and update inside its schedule",
           "the data-parallel strategies (local_sgd, bmuf, easgd, signsgd_mv, parameter_server) train "
           "manual-optimization and multi-optimizer modules")  # fmt: skip
_BF16 = "precision='bf16-mixed' (same speed-up on CPU and Ampere+ GPUs, no loss scaling needed)"
_TP_NOTHING = (r"TensorParallelStrategy\(plan='auto'\): plan_for\(\w+\): found nothing to shard",
               "plan={'<a Linear>': 'colwise', '<the next Linear>': 'rowwise'} naming two Linear layers with only "
               "elementwise modules between them, or a data-parallel column (a network this small gains nothing "
               "from sharding)")  # fmt: skip
_NO_LEARNER = (r"ApeXStrategy: the LightningModule \w+ has no make_env, q_network, target_network, td_errors; the "
               r"learner hooks are", "an RL learner (subclass lightning_pdist.rl.DQNModule); train supervised "
               "modules with any other column")  # fmt: skip
REFUSALS: dict[tuple[str, str], tuple[str, str]] = {
    ("streaming_diloco", "boring"): (
        r"StreamingDiLoCoStrategy\(num_fragments=2\): the model has 1 layers with parameters; num_fragments must not",
        "num_fragments=1 (one fragment: DiLoCo) or fragments=[[...], [...]] naming submodules, or a deeper network"),
    ("pipeline", "gan"): _MANUAL,
    ("pipeline", "slow_second_optimizer"): _MANUAL,
    ("pipeline", "batchnorm_clip_norm_accumulate"): (
        r"Trainer\(accumulate_grad_batches=2\): the pipeline already accumulates over micro-batches",
        "raise num_microbatches or the batch size: the pipeline's micro-batches are its accumulation"),
    ("pipeline", "unused_parameters"): (
        r"parameters are not all inside one nn.Sequential \(net holds .*; outside: aux.weight, aux.bias\)",
        "put every trained layer in the one nn.Sequential the pipeline splits"),
    ("pipeline", "frozen"): (
        r"num_stages=2: the network has 1 layer with parameters \(3 layers in all\); every stage needs one",
        "fewer stages than trainable layers (here num_stages=1, i.e. data parallel), or a deeper network"),
    ("tensor_parallel", "boring"): _TP_NOTHING,
    ("tensor_parallel", "batchnorm_clip_norm_accumulate"): _TP_NOTHING,
    ("tensor_parallel", "batchnorm_clip_value"): _TP_NOTHING,
    ("tensor_parallel", "16_mixed"): (
        r"The `ModelParallelStrategy` does not support `Fabric\(..., precision='16-mixed'\)`",
        f"{_BF16}, or fp16 with plugins=[MixedPrecision('16-mixed', device, GradScaler())] (the fp16_grad_scaler row)"),
}


REFUSALS.update({("apex", module): _NO_LEARNER for module in MODULES})
REFUSALS.update({("gorila", module): (_NO_LEARNER[0].replace("ApeXStrategy", "GorilaStrategy"), _NO_LEARNER[1])
                 for module in MODULES})
_NO_SPARSE = (r"ParallaxStrategy\(sparse_params=None\): the module has no sparse parameter: no nn.Embedding or "
              r"nn.EmbeddingBag with sparse=True", "build the embedding with sparse=True or name its table in "
              "sparse_params; a model without a table of rows trains with ddp or parameter_server")  # fmt: skip
REFUSALS.update({("parallax", module): _NO_SPARSE for module in MODULES})
_NOT_LBFGS = (r"SandblasterStrategy: configure_optimizers returned .*; Sandblaster runs batch L-BFGS and needs exactly "
              r"one torch.optim.LBFGS", "return torch.optim.LBFGS(self.parameters(), max_iter=1) (ClassifierModule("
              "optimizer='lbfgs')), or train the module with any other column")  # fmt: skip
REFUSALS.update({("sandblaster", module): _NOT_LBFGS for module in MODULES})


def registry_name(strategy: str, unused: bool) -> str:
    name = STRATEGIES[strategy][0]
    variant = f"{name}_find_unused_parameters_true"
    return variant if unused and variant in StrategyRegistry else name


def make(strategy: str, unused: bool) -> Any:
    """A fresh strategy instance the way the registry builds it, plus the matrix's settings."""
    name = registry_name(strategy, unused)
    entry = StrategyRegistry[name]
    kwargs = {**entry["init_params"], **STRATEGIES[strategy][1], "timeout": TIMEOUT}
    return entry["strategy"](**kwargs)
