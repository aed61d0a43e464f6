"""One rank of the tensor-parallel suite: ``python -m lightning_pdist.bench.tp_worker --spec JSON --out-dir DIR``.

Started once per rank by :func:`~lightning_pdist.bench.netns.launch_ranks` on loopback or emulated links
(each rank its own Lightning "node": ``Trainer(devices=1,
num_nodes=world_size)``). ``spec["config"]`` picks the strategy:

* ``dp``: ``PdistStrategy`` (Lightning's DDP plus byte accounting), every rank ``global_batch / world_size`` samples;
* ``tp``: :class:`~lightning_pdist.tensor_parallel.strategy.TensorParallelStrategy` over all ranks (plan
  ``"auto"``), the TP group on the whole ``global_batch``;
* ``tp_sp``: the same with ``sequence_parallel=True``;
* ``dp_tp``: the same with ``tensor_parallel_size=tp_size``: ``world_size / tp_size`` replicas of
  ``global_batch · tp_size / world_size`` samples each;
* ``hybrid``: the same with ``plan="hybrid"`` (VGG: convolutions data-parallel, the FC stack sharded over the
  all-gathered batch), every rank ``global_batch / world_size`` images.

Models: ``EncoderClassifier`` (``spec["model"]`` ``"bert"`` or ``"albert"``, keywords ``spec["model_kwargs"]``) on
the IMDB-format folder ``spec["data_dir"]`` (:class:`~lightning_pdist.data.IMDBDataModule`), or
``vgg16_scaled(spec["vgg_width"])`` on random 32×32 images, or (``"transformer"``) Lightning's demo Transformer
(``lightning.pytorch.demos.Transformer(**model_kwargs)``) on random tokens, predicting each next token (NLL, as
Lightning's ``LightningTransformer``). SGD, no validation during ``fit``.

The rank runs ``warmup_steps`` untimed optimizer steps, then ``steps`` timed ones; at both edges of the timed
window every rank waits at a barrier and reads the clock, its :class:`~lightning_pdist.core.accounting.CommMeter`
and its veth's kernel ``tx_bytes`` / ``tx_packets`` (emulated links). ``DIR/rank<r>.json``::

    {"rank", "world_size", "spec", "step_s", "window_s", "cpu_s", "meter_bytes", "meter_by_kind", "tx_bytes",
     "tx_packets", "params_full", "params_local", "losses", "fit_s"}

``cpu_s`` (this process's CPU time, all its threads), ``meter_*`` and ``tx_*`` cover the timed window only (the
barriers add a few hundred bytes to ``tx``). CPU time barely moves when other work shares the cores; wall time does.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from lightning_pdist.bench.launch import WorkerSpec, bench_trainer, close_group, worker_main

CONFIGS = ("dp", "tp", "tp_sp", "dp_tp", "hybrid")
MODELS = ("bert", "albert", "vgg", "transformer")


@dataclass(frozen=True)
class Spec(WorkerSpec):
    """One tensor-parallel run: ``config`` on ``model``, ``steps`` timed steps of ``global_batch`` after ``warmup_steps``."""

    WHO: ClassVar[str] = "tp_worker"
    config: str
    model: str
    world_size: int
    tp_size: int
    global_batch: int
    seq_len: int
    model_kwargs: dict
    vgg_width: float
    warmup_steps: int
    steps: int
    seed: int
    lr: float
    data_dir: str

    def __post_init__(self) -> None:
        self.one_of("config", CONFIGS)
        self.one_of("model", MODELS)
        self.ints("world_size", "tp_size", "global_batch", "seq_len", "warmup_steps", "steps")
        ws, tp, config = self.world_size, self.tp_size, self.config
        allowed = ("dp", "hybrid") if self.model == "vgg" else ("dp", "tp", "tp_sp", "dp_tp")
        if config not in allowed:
            raise self.bad("config", f"model {self.model!r} runs one of {allowed}")
        expected_tp = {"dp": 1, "tp": ws, "tp_sp": ws, "hybrid": ws}.get(config)
        if expected_tp is not None and tp != expected_tp:
            raise self.bad("tp_size", f"config {config!r} on world_size={ws} ranks has tp_size={expected_tp}")
        if config == "dp_tp" and (ws % tp or not 1 < tp < ws):
            raise self.bad("tp_size", f"dp_tp needs 1 < tp_size < world_size ({ws}), dividing it")
        if self.global_batch % ws:
            raise self.bad("global_batch", f"global_batch must be a multiple of world_size ({ws}): every rank's share is whole")
        if not self.lr > 0:
            raise self.bad("lr", "lr must be > 0")


check_spec = Spec.check


def loader_batch(spec: dict[str, Any]) -> int:
    """Samples one rank's data loader yields per step: the global batch over the data-parallel replicas.

    DP and hybrid: every rank is a replica; TP and DP×TP: a TP group (``tp_size`` ranks) shares one.
    """
    replicas = spec["world_size"] if spec["config"] in ("dp", "hybrid") else spec["world_size"] // spec["tp_size"]
    return spec["global_batch"] // replicas


def build_strategy(spec: dict[str, Any]) -> Any:
    """The strategy of ``spec["config"]``, on gloo."""
    from lightning_pdist.core.strategy import PdistStrategy
    from lightning_pdist.tensor_parallel.strategy import TensorParallelStrategy

    if spec["config"] == "dp":
        return PdistStrategy(process_group_backend="gloo")
    plan = "hybrid" if spec["config"] == "hybrid" else "auto"
    # nonfinite='propagate': the byte model is the algorithm's traffic; the default's 4·world_size-byte agreement on
    # non-finite gradients per step (kind nonfinite_flag) would sit beside it, unmodelled.
    return TensorParallelStrategy(tensor_parallel_size=spec["tp_size"], plan=plan, process_group_backend="gloo",
                                  nonfinite="propagate", sequence_parallel=spec["config"] == "tp_sp")


def build_module_and_data(spec: dict[str, Any]) -> tuple[Any, Any]:
    """``(ClassifierModule, datamodule or DataLoader)`` of the spec's model."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pdist.data import IMDBDataModule
    from lightning_pdist.models.classifier import ClassifierModule

    batch = loader_batch(spec)
    if spec["model"] == "vgg":
        from lightning_pdist.models.vgg import vgg16_scaled

        model = vgg16_scaled(width=spec["vgg_width"])
        g = torch.Generator().manual_seed(spec["seed"])
        n = batch * (spec["warmup_steps"] + spec["steps"]) * spec["world_size"]
        data = TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, model.num_classes, (n,), generator=g))
        module = ClassifierModule(model=model, num_classes=model.num_classes, optimizer="sgd", lr=spec["lr"])
        return module, DataLoader(data, batch_size=batch)
    if spec["model"] == "transformer":
        from lightning.pytorch.demos import Transformer

        model = Transformer(**spec["model_kwargs"])
        g = torch.Generator().manual_seed(spec["seed"])
        n = batch * (spec["warmup_steps"] + spec["steps"]) * spec["world_size"]
        tokens = torch.randint(0, model.vocab_size, (n, spec["seq_len"] + 1), generator=g)
        return DemoLM(model, spec["lr"]), DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch)
    from lightning_pdist.models.encoder import EncoderClassifier

    kwargs = spec["model_kwargs"]
    model = EncoderClassifier(spec["model"], **kwargs)
    data = IMDBDataModule(spec["data_dir"], vocab_size=kwargs["vocab_size"], max_len=spec["seq_len"], batch_size=batch,
                          seed=spec["seed"])  # fmt: skip
    return ClassifierModule(model=model, num_classes=2, optimizer="sgd", lr=spec["lr"]), data


def DemoLM(model: Any, lr: float) -> Any:  # noqa: N802 (a class, built on demand: Lightning imports lazily here)
    """Lightning's ``LightningTransformer`` step (NLL of the next token) around ``model``, SGD at ``lr``, no download."""
    import torch
    from lightning.pytorch import LightningModule
    from torch.nn import functional as F

    class _DemoLM(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            inputs, target = batch
            return F.nll_loss(self.model(inputs, target), target.reshape(-1))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.model.parameters(), lr=lr)

    return _DemoLM()


def run(spec: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """Train this rank as ``spec`` says; write and return its result dict."""
    import torch
    from lightning.pytorch import Callback, Trainer, seed_everything

    from lightning_pdist.bench.worker import read_tx

    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    warmup, steps = spec["warmup_steps"], spec["steps"]
    edges: list[dict[str, Any]] = []
    step_s: list[float] = []
    losses: list[float] = []

    class Window(Callback):
        """Clock, meter and kernel counters at the edges of the timed steps, every rank after a barrier."""

        def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, *args: Any) -> None:
            step_s.append(time.perf_counter() - self.t0)
            losses.append(float(outputs["loss"]) if isinstance(outputs, dict) else float(outputs))
            if trainer.global_step in (warmup, warmup + steps):
                trainer.strategy.barrier()  # every rank's sends of the last step have left
                meter = trainer.strategy.comm_meter
                edges.append({"t": time.perf_counter(), "cpu": time.process_time(), "bytes": meter.total_bytes,
                              "by_kind": dict(meter.by_kind), "tx": read_tx(ifname)})  # fmt: skip

    seed_everything(spec["seed"], verbose=False)  # the same seed everywhere: a TP group draws the same dropout masks
    module, data = build_module_and_data(spec)
    params_full = sum(p.numel() for p in module.parameters())
    trainer = bench_trainer(devices=1, num_nodes=spec["world_size"], strategy=build_strategy(spec), max_steps=warmup + steps,
                            use_distributed_sampler=True, callbacks=[Window()])  # fmt: skip
    t0 = time.perf_counter()
    if isinstance(data, torch.utils.data.DataLoader):
        trainer.fit(module, data)
    else:
        trainer.fit(module, datamodule=data)
    fit_s = time.perf_counter() - t0
    params_local = sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in module.parameters())
    close_group()
    if len(edges) != 2:
        raise RuntimeError(f"tp_worker: the run ended after {trainer.global_step} steps, before the timed window "
                           f"closed ({warmup} + {steps}); give the data more samples")  # fmt: skip
    start, end = edges
    tx = None if start["tx"] is None or end["tx"] is None else [end["tx"][i] - start["tx"][i] for i in (0, 1)]
    kinds = {k: v - start["by_kind"].get(k, 0) for k, v in end["by_kind"].items() if v - start["by_kind"].get(k, 0)}
    result = {
        "rank": trainer.global_rank, "world_size": trainer.world_size, "spec": spec, "step_s": step_s[warmup:],
        "window_s": end["t"] - start["t"], "cpu_s": end["cpu"] - start["cpu"], "meter_bytes": end["bytes"] - start["bytes"], "meter_by_kind": kinds,
        "tx_bytes": None if tx is None else tx[0], "tx_packets": None if tx is None else tx[1],
        "params_full": params_full, "params_local": params_local, "losses": losses, "fit_s": fit_s,
    }  # fmt: skip
    return result


if __name__ == "__main__":
    raise SystemExit(worker_main("lightning_pdist.bench.tp_worker", __doc__, check_spec, run))
