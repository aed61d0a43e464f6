"""One rank of the compression suite: ``python -m lightning_pdist.bench.compression_worker --spec JSON --out-dir DIR``.

Started once per rank by :class:`~lightning_pdist.bench.launch.Launcher` (``RANK``, ``WORLD_SIZE``, ... set; each rank
its own Lightning node, gloo over TCP). The rank trains ``ClassifierModule(model="cnn", width=...)`` on the digits
once per method of ``spec["methods"]`` (:data:`METHODS`), in turn, in this process, every fit from the same seed,
data order and weights. Per fit it records:

* the bytes our :class:`~lightning_pdist.core.accounting.CommMeter` counted in the training loop (torch's hooks, the
  peers, are not counted by it: the suite models theirs), and by kind;
* this host's kernel ``tx_bytes``/``tx_packets`` at ``on_train_start`` and ``on_train_end`` (emulated links only);
* the training time: the loop's wall time minus the evaluations below, and the per-step times;
* every ``eval_every`` steps, the accuracy on the whole validation split of the model this rank holds, with the
  training time so far (time to accuracy), and at the end the accuracy of the model ``fit`` leaves (BMUF's global
  model for ``bmuf_topk``).

Writes ``DIR/rank<r>.json``: ``{"rank", "world_size", "spec", "fits": [{"method", "train_steps",
"loop_comm_bytes", "comm_by_kind", "train_s", "step_ms", "evals": [[step, train_s, acc], ...], "val_acc",
"tx", "tx_packets", "param_digest", "shapes"}]}``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from lightning_pdist.bench.launch import WorkerSpec, worker_main
from lightning_pdist.bench.worker import evaluate, param_digest, read_tx

#: method -> what it runs (the suite's rows). ``local_only`` communicates nothing in the loop (one-shot averaging at
#: the end of fit): its kernel bytes are Lightning's own per-step traffic, the baseline of the kernel check.
METHODS: dict[str, str] = {
    "ddp": "PdistStrategy() (fp32 all-reduce)",
    "fp16_hook": "torch's fp16_compress_hook",
    "powersgd_hook": "torch's powerSGD_hook (rank 1, start_powerSGD_iter=2)",
    "topk": "PdistStrategy(compression=TopK(0.01))",
    "dgc": "PdistStrategy(compression=DGC(0.001)), optimizer momentum 0",
    "qsgd": "PdistStrategy(compression=QSGD(16))",
    "terngrad": "PdistStrategy(compression=TernGrad())",
    "sign": "PdistStrategy(compression=Sign(error_feedback=False))",
    "ef_sign": "PdistStrategy(compression=Sign())",
    "bmuf_topk": "BMUFStrategy(period=8, compression=TopK(0.01))",
    "local_only": "SimuParallelSGDStrategy(nonfinite='propagate') (no communication in the loop)",
}
PEERS = ("fp16_hook", "powersgd_hook")
#: Optimizer momentum per method where it differs from the spec's: DGC's momentum correction replaces it.
NO_OPTIMIZER_MOMENTUM = ("dgc",)
BMUF_PERIOD = 8


@dataclass(frozen=True)
class Spec(WorkerSpec):
    """One launch of the compression suite: every method of ``methods`` on ``world_size`` ranks, in turn."""

    WHO: ClassVar[str] = "compression_worker"
    methods: list
    world_size: int
    steps: int
    batch_size: int
    lr: float
    momentum: float
    width: int
    seed: int
    eval_every: int

    def __post_init__(self) -> None:
        if not self.methods or any(m not in METHODS for m in self.methods):
            raise self.bad("methods", f"each method must be one of {tuple(METHODS)}")
        self.ints("world_size", "steps", "batch_size", "width", "eval_every")
        self.ints("seed", low=0)
        self.sgd()


check_spec = Spec.check


def build_strategy(method: str) -> Any:
    """The strategy of ``method`` (:data:`METHODS`), on gloo."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    from lightning_pdist import BMUFStrategy, PdistStrategy, SimuParallelSGDStrategy
    from lightning_pdist.compression import DGC, QSGD, Sign, TernGrad, TopK

    gloo = {"process_group_backend": "gloo"}
    compressors = {"topk": lambda: TopK(0.01), "dgc": lambda: DGC(0.001), "qsgd": lambda: QSGD(16),
                   "terngrad": TernGrad, "sign": lambda: Sign(error_feedback=False), "ef_sign": Sign}  # fmt: skip
    if method in compressors:
        return PdistStrategy(compression=compressors[method](), **gloo)
    if method == "fp16_hook":
        return PdistStrategy(ddp_comm_hook=default_hooks.fp16_compress_hook, **gloo)
    if method == "powersgd_hook":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                            min_compression_rate=2.0)  # fmt: skip
        return PdistStrategy(ddp_comm_state=state, ddp_comm_hook=powerSGD_hook.powerSGD_hook, **gloo)
    if method == "bmuf_topk":
        return BMUFStrategy(period=BMUF_PERIOD, compression=TopK(0.01), **gloo)
    if method == "local_only":
        return SimuParallelSGDStrategy(nonfinite="propagate", **gloo)
    return PdistStrategy(**gloo)


def fit_one(spec: dict[str, Any], method: str, data: Any) -> dict[str, Any]:
    """One fit of ``method``; its record (see the module docstring)."""
    import warnings

    from lightning.pytorch import Callback, Trainer, seed_everything

    from lightning_pdist.models.classifier import ClassifierModule

    ifname = os.environ.get("GLOO_SOCKET_IFNAME")

    class Probe(Callback):
        """Kernel counters at the loop's edges; step times; evaluations every ``eval_every`` steps (not timed)."""

        def __init__(self) -> None:
            self.tx: dict[str, Any] = {}
            self.evals: list[list[float]] = []
            self.step_ms: list[float] = []
            self.eval_s = 0.0

        def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
            self.tx["train_start"] = read_tx(ifname)
            self.t0 = self.last = time.perf_counter()

        def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
            now = time.perf_counter()
            self.step_ms.append(round(1000 * (now - self.last), 3))
            step = trainer.global_step
            if step % spec["eval_every"] == 0:
                acc, _ = evaluate(pl_module, data.val_set)
                pl_module.train()
                self.evals.append([step, round(now - self.t0 - self.eval_s, 4), acc])
                self.eval_s += time.perf_counter() - now
            self.last = time.perf_counter()

        def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
            self.train_s = time.perf_counter() - self.t0 - self.eval_s
            self.tx["train_end"] = read_tx(ifname)
            self.comm = trainer.strategy.comm_meter.total_bytes
            self.by_kind = dict(trainer.strategy.comm_meter.by_kind)

    seed_everything(spec["seed"], workers=True, verbose=False)
    momentum = 0.0 if method in NO_OPTIMIZER_MOMENTUM else spec["momentum"]
    module = ClassifierModule(model="cnn", width=spec["width"], optimizer="sgd", lr=spec["lr"], momentum=momentum)
    probe = Probe()
    trainer = Trainer(accelerator="cpu", devices=1, num_nodes=spec["world_size"], strategy=build_strategy(method),
                      max_steps=spec["steps"], limit_val_batches=0, num_sanity_val_steps=0, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[probe], log_every_n_steps=1)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the peers' "bytes not counted" warning: the suite models their bytes
        trainer.fit(module, datamodule=data)
    val_acc, _ = evaluate(module, data.val_set)
    tx = probe.tx
    return {
        "method": method,
        "train_steps": trainer.global_step,
        "loop_comm_bytes": probe.comm,
        "comm_by_kind": probe.by_kind,
        "train_s": round(probe.train_s, 4),
        "step_ms": probe.step_ms,
        "evals": probe.evals,
        "val_acc": val_acc,
        "tx": {k: v[0] for k, v in tx.items()} if all(tx.values()) else None,
        "tx_packets": {k: v[1] for k, v in tx.items()} if all(tx.values()) else None,
        "param_digest": param_digest(module),
        "shapes": [list(p.shape) for p in module.parameters()],
    }


def run(spec: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """Every method's fit in turn on this rank; the rank's result."""
    import torch

    from lightning_pdist.data import DigitsDataModule

    check_spec(spec)
    torch.set_num_threads(1)  # one core per rank; the ranks share the machine
    env = dict(os.environ)  # Lightning's teardown drops the launcher's variables; each fit starts from them
    fits = []
    for method in spec["methods"]:
        os.environ.clear()
        os.environ.update(env)
        data = DigitsDataModule(batch_size=spec["batch_size"], seed=spec["seed"])
        data.setup("fit")
        fits.append(fit_one(spec, method, data))
    return {"rank": int(env["RANK"]), "world_size": spec["world_size"], "spec": spec, "fits": fits}


if __name__ == "__main__":
    raise SystemExit(worker_main("lightning_pdist.bench.compression_worker", __doc__, check_spec, run))
