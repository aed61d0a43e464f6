"""One rank of the compression suite: ``python -m lightning_pdist.bench.compression_worker --spec JSON --out-dir DIR``.

Started once per rank by :class:`~lightning_pdist.bench.launch.Launcher` (``RANK``, ``WORLD_SIZE``, ... set; each rank
its own Lightning node, gloo over TCP). The rank trains ``spec["model"]`` once per method of ``spec["methods"]``
(:data:`METHODS`), in turn, in this process, every fit from the same seed, data order and weights: ``cnn``,
``ClassifierModule(model="cnn", width=...)`` on the digits; ``lm``, the byte-level Transformer LM of
:mod:`~lightning_pdist.bench.text_lm` (the DiLoCo suite's) on the standard library's source, ``batch_size``
windows per rank and step, the aggregated gradient clipped to norm :data:`LM_CLIP`, a step with non-finite
gradients skipped. Both train with SGD (``lr``, ``momentum``; momentum 0 for DGC, whose momentum correction
replaces it). Per fit it records:

* the bytes our :class:`~lightning_pdist.core.accounting.CommMeter` counted in the training loop (torch's hooks, the
  peers, are not counted by it: the suite models theirs), and by kind;
* this host's kernel ``tx_bytes``/``tx_packets`` at ``on_train_start`` and ``on_train_end`` (emulated links only);
* the training time: the loop's wall time minus the evaluations below, and the per-step times;
* every ``eval_every`` steps, the accuracy (digits: of the classes; LM: of the next byte) and the mean
  cross-entropy on the whole validation split (LM: the held-out windows) of the model this rank holds, with the
  training time so far (time to accuracy / loss), and at the end those of the model ``fit`` leaves (BMUF's global
  model for ``bmuf_topk``).

Writes ``DIR/rank<r>.json``: ``{"rank", "world_size", "spec", "fits": [{"method", "train_steps",
"loop_comm_bytes", "comm_by_kind", "train_s", "step_ms", "evals": [[step, train_s, acc, loss], ...], "val_acc",
"val_loss", "tx", "tx_packets", "param_digest", "shapes"}]}``.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from lightning_pdist.bench.launch import SGDSpec, bench_trainer, worker_main
from lightning_pdist.bench.worker import param_digest, read_tx

#: method -> what it runs (the suites' rows). ``local_only`` communicates nothing in the loop (one-shot averaging at
#: the end of fit): its kernel bytes are Lightning's own per-step traffic, the baseline of the kernel check.
METHODS: dict[str, str] = {
    "ddp": "PdistStrategy() (fp32 all-reduce)",
    "fp16_hook": "torch's fp16_compress_hook",
    "powersgd_hook": "torch's powerSGD_hook (rank 1, start_powerSGD_iter=2)",
    "topk": "PdistStrategy(compression=TopK(0.01))",
    "dgc": "PdistStrategy(compression=DGC(0.001)), optimizer momentum 0",
    "dgc_warmup": "PdistStrategy(compression=DGC(0.001, warmup_steps=W)), optimizer momentum 0",
    "qsgd": "PdistStrategy(compression=QSGD(16))",
    "terngrad": "PdistStrategy(compression=TernGrad())",
    "sign": "PdistStrategy(compression=Sign(error_feedback=False))",
    "ef_sign": "PdistStrategy(compression=Sign())",
    "bmuf_topk": "BMUFStrategy(period=8, compression=TopK(0.01))",
    "local_only": "SimuParallelSGDStrategy(nonfinite='propagate') (no communication in the loop)",
}
PEERS = ("fp16_hook", "powersgd_hook")
MODELS = ("cnn", "lm")
#: Optimizer momentum per method where it differs from the spec's: DGC's momentum correction replaces it.
NO_OPTIMIZER_MOMENTUM = ("dgc", "dgc_warmup")
BMUF_PERIOD = 8
DGC_RATIO = 0.001
#: DGC's warm-up stages: density ``0.001^{(j+1)/5}`` in stage j = 0..3 (25.1 %, 6.3 %, 1.6 %, 0.4 %), then 0.1 %: the
#: paper's 75 %, 93.75 %, 98.4 %, 99.6 %, 99.9 % sparsity.
DGC_WARMUP_STAGES = 4
TEXT_BYTES = 1 << 20
#: The LM's fits clip the (aggregated) gradient to this norm and skip a step whose gradients are not finite
#: (``nonfinite="skip_step"``): a method that diverges ends with its loss recorded as None instead of stopping the launch.
LM_CLIP = 1.0


@dataclass(frozen=True)
class Spec(SGDSpec):
    """One launch of the compression suite: every method of ``methods`` on ``world_size`` ranks, in turn."""

    WHO: ClassVar[str] = "compression_worker"
    model: str
    methods: list
    layers: int
    context: int
    eval_every: int
    dgc_warmup_steps: int

    def __post_init__(self) -> None:
        self.one_of("model", MODELS)
        if not self.methods or any(m not in METHODS for m in self.methods):
            raise self.bad("methods", f"each method must be one of {tuple(METHODS)}")
        super().__post_init__()
        self.ints("layers", "context", "eval_every")
        self.ints("dgc_warmup_steps", low=0)


check_spec = Spec.check


def build_strategy(method: str, dgc_warmup_steps: int = 0, nonfinite: str = "raise") -> Any:
    """The strategy of ``method`` (:data:`METHODS`), on gloo, with the ``nonfinite`` policy (``local_only``:
    ``propagate``, it has no step to skip)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    from lightning_pdist import BMUFStrategy, PdistStrategy, SimuParallelSGDStrategy
    from lightning_pdist.compression import DGC, QSGD, Sign, TernGrad, TopK

    gloo = {"process_group_backend": "gloo", "nonfinite": nonfinite}
    warm = {"warmup_steps": dgc_warmup_steps, "warmup_stages": DGC_WARMUP_STAGES}
    compressors = {"topk": lambda: TopK(0.01), "dgc": lambda: DGC(DGC_RATIO), "dgc_warmup": lambda: DGC(DGC_RATIO, **warm),
                   "qsgd": lambda: QSGD(16), "terngrad": TernGrad, "sign": lambda: Sign(error_feedback=False),
                   "ef_sign": Sign}  # fmt: skip
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
        return SimuParallelSGDStrategy(**{**gloo, "nonfinite": "propagate"})
    return PdistStrategy(**gloo)


class Task:
    """The model of a spec, its data and its evaluation: ``fresh(momentum)`` gives a new (module, fit kwargs)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.rank = int(os.environ["RANK"])

    def fresh(self, momentum: float) -> tuple[Any, dict[str, Any]]:
        spec = self.spec
        if spec["model"] == "lm":
            from lightning_pdist.bench.text_lm import lm_module

            lm = {"width": spec["width"], "layers": spec["layers"], "context": spec["context"],
                  "batch_size": spec["batch_size"], "text_bytes": TEXT_BYTES, "seed": spec["seed"]}  # fmt: skip
            module, loader, self.text = lm_module(lm, spec["lr"], momentum, spec["steps"], self.rank)
            return module, {"train_dataloaders": loader}
        from lightning_pdist.data import DigitsDataModule
        from lightning_pdist.models.classifier import ClassifierModule

        self.digits = DigitsDataModule(batch_size=spec["batch_size"], seed=spec["seed"])
        self.digits.setup("fit")
        module = ClassifierModule(model="cnn", width=spec["width"], optimizer="sgd", lr=spec["lr"], momentum=momentum)
        return module, {"datamodule": self.digits}

    def evaluate(self, module: Any) -> tuple[float, float]:
        """(accuracy, mean cross-entropy) of ``module`` on the validation data, in this process."""
        import torch
        from torch.nn import functional as F
        from torch.utils.data import DataLoader

        module.eval()
        if self.spec["model"] == "lm":
            from lightning_pdist.bench.text_lm import evaluate

            loss, acc = evaluate(module, self.text)
            return acc, loss
        correct = total = 0
        loss = 0.0
        with torch.no_grad():
            for x, y in DataLoader(self.digits.val_set, batch_size=256, shuffle=False):
                logits = module(x)
                correct += int((logits.argmax(dim=1) == y).sum())
                loss += float(F.cross_entropy(logits, y, reduction="sum"))
                total += len(y)
        return correct / total, loss / total


def finite(loss: float) -> float | None:
    """``loss`` rounded, or None where training diverged (the results are strict JSON)."""
    return round(loss, 5) if math.isfinite(loss) else None


def fit_one(spec: dict[str, Any], method: str, task: Task) -> dict[str, Any]:
    """One fit of ``method``; its record (see the module docstring)."""
    import warnings

    from lightning.pytorch import Callback, Trainer, seed_everything

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
                acc, loss = task.evaluate(pl_module)
                pl_module.train()
                self.evals.append([step, round(now - self.t0 - self.eval_s, 4), acc, finite(loss)])
                self.eval_s += time.perf_counter() - now
            self.last = time.perf_counter()

        def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
            self.train_s = time.perf_counter() - self.t0 - self.eval_s
            self.tx["train_end"] = read_tx(ifname)
            self.comm = trainer.strategy.comm_meter.total_bytes
            self.by_kind = dict(trainer.strategy.comm_meter.by_kind)

    seed_everything(spec["seed"], workers=True, verbose=False)
    momentum = 0.0 if method in NO_OPTIMIZER_MOMENTUM else spec["momentum"]
    lm = spec["model"] == "lm"
    module, data = task.fresh(momentum)
    probe = Probe()
    trainer = bench_trainer(devices=1, num_nodes=spec["world_size"],
                            strategy=build_strategy(method, spec["dgc_warmup_steps"], "skip_step" if lm else "raise"),
                            gradient_clip_val=LM_CLIP if lm else None, max_steps=spec["steps"], callbacks=[probe],
                            log_every_n_steps=1, use_distributed_sampler=not lm)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the peers' "bytes not counted" warning: the suite models their bytes
        trainer.fit(module, **data)
    val_acc, val_loss = task.evaluate(module)
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
        "val_loss": finite(val_loss),
        "tx": {k: v[0] for k, v in tx.items()} if all(tx.values()) else None,
        "tx_packets": {k: v[1] for k, v in tx.items()} if all(tx.values()) else None,
        "param_digest": param_digest(module),
        "shapes": [list(p.shape) for p in module.parameters()],
    }


def run(spec: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """Every method's fit in turn on this rank; the rank's result."""
    env = dict(os.environ)  # Lightning's teardown drops the launcher's variables; each fit starts from them
    fits = []
    for method in spec["methods"]:
        os.environ.clear()
        os.environ.update(env)
        fits.append(fit_one(spec, method, Task(spec)))
    return {"rank": int(env["RANK"]), "world_size": spec["world_size"], "spec": spec, "fits": fits}


if __name__ == "__main__":
    raise SystemExit(worker_main("lightning_pdist.bench.compression_worker", __doc__, check_spec, run))
