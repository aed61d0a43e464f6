"""One rank of a benchmark run: ``python -m lightning_pdist.bench.worker --spec JSON --out-dir DIR``.

The launchers (:func:`lightning_pdist.bench.netns.launch_ranks`, on 127.0.0.1 or inside
emulated hosts) start this module once per
rank with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK=0``, ``NODE_RANK``, ``MASTER_ADDR``,
``MASTER_PORT`` and ``GLOO_SOCKET_IFNAME`` set, so each rank is its own Lightning "node":
``Trainer(accelerator="cpu", devices=1, num_nodes=world_size)``. Lightning sees ``LOCAL_RANK`` and
treats the processes as launched externally; the process group is real ``gloo`` over TCP.

Each rank trains ``ClassifierModule(model="cnn")`` on :class:`~lightning_pdist.data.DigitsDataModule`
for ``steps`` optimizer steps with no validation during ``fit`` (so no evaluation traffic mixes
with training traffic), then evaluates the model it holds after ``fit`` (the strategy's output: DDP's
model, the replica average, BMUF's global model, EASGD's center) on the whole validation split,
in-process, and writes ``DIR/rank<r>.json``::

    {"rank", "world_size", "spec", "train_steps", "samples_seen", "val_acc", "val_samples",
     "comm_bytes", "comm_by_kind", "logged_comm_bytes_total", "loop_comm_bytes",
     "loop_s", "loop_cpu_s", "fit_s", "param_digest", "model_params", "tx": {...} | null,
     "tx_packets": {...} | null}

``tx`` and ``tx_packets`` hold this host's kernel ``tx_bytes`` and ``tx_packets`` counters read at
process start, at ``on_train_start``, at ``on_train_end`` (before the strategy's own
``on_train_end``, which loads the consensus model) and after ``fit``, when the rank runs on an
emulated link (``GLOO_SOCKET_IFNAME`` is not ``lo``). The benchmark splits the kernel's byte count
into set-up, training-loop and wind-down phases with them.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from lightning_pdist.bench.launch import SGDSpec, bench_trainer, worker_main

STRATEGIES = ("pdist_ddp", "local_sgd", "bmuf", "easgd", "simuparallel_sgd")
PERIODIC = ("local_sgd", "bmuf", "easgd")


@dataclass(frozen=True)
class Spec(SGDSpec):
    """One run of the averaging suite: a strategy at a period, ``steps`` optimizer steps of ``batch_size`` per rank."""

    WHO: ClassVar[str] = "worker"
    strategy: str
    period: int | None

    def __post_init__(self) -> None:
        self.one_of("strategy", STRATEGIES)
        if self.strategy in PERIODIC and (not isinstance(self.period, int) or self.period < 1):
            raise self.bad("period", f"{self.strategy} needs an int period >= 1")
        if self.strategy == "pdist_ddp" and self.period != 1:
            raise self.bad("period", "pdist_ddp communicates every step; period must be 1")
        if self.strategy == "simuparallel_sgd" and self.period is not None:
            raise self.bad("period", "simuparallel_sgd averages once; period must be None")
        super().__post_init__()


check_spec = Spec.check


def read_tx(ifname: str | None) -> tuple[int, int] | None:
    """This namespace's kernel ``(tx_bytes, tx_packets)`` of ``ifname``; ``None`` on loopback or when unreadable.

    ``ip netns exec`` mounts a sysfs of the namespace, so ``/sys/class/net`` shows the host's veth.
    """
    if not ifname or ifname == "lo":
        return None
    stats = Path(f"/sys/class/net/{ifname}/statistics")
    try:
        return int((stats / "tx_bytes").read_text()), int((stats / "tx_packets").read_text())
    except (OSError, ValueError):
        return None


def build_strategy(spec: dict[str, Any]) -> Any:
    """The strategy object named by ``spec["strategy"]``, on gloo."""
    from lightning_pdist import (
        BMUFStrategy,
        EASGDStrategy,
        LocalSGDStrategy,
        PdistStrategy,
        SimuParallelSGDStrategy,
    )

    common = {"process_group_backend": "gloo"}
    name, period = spec["strategy"], spec["period"]
    if name == "pdist_ddp":
        return PdistStrategy(**common)
    if name == "local_sgd":
        return LocalSGDStrategy(period=period, **common)
    if name == "bmuf":
        return BMUFStrategy(period=period, **common)
    if name == "easgd":
        return EASGDStrategy(period=period, **common)
    return SimuParallelSGDStrategy(**common)


def param_digest(module: Any) -> str:
    """A short hash of the module's parameters, bit for bit: equal digests mean equal models."""
    import torch

    flat = torch.cat([p.detach().reshape(-1).double() for p in module.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


def evaluate(module: Any, dataset: Any) -> tuple[float, int]:
    """Accuracy of ``module`` on ``dataset`` in this process (no collectives), and its size."""
    import torch
    from torch.utils.data import DataLoader

    module.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in DataLoader(dataset, batch_size=256, shuffle=False):
            correct += int((module(x).argmax(dim=1) == y).sum())
            total += len(y)
    return correct / total, total


def run(spec: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """Train one rank as ``spec`` says; write and return its result dict."""
    from lightning.pytorch import Callback, Trainer, seed_everything

    from lightning_pdist.data import DigitsDataModule
    from lightning_pdist.models.classifier import ClassifierModule

    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    tx: dict[str, tuple[int, int] | None] = {"start": read_tx(ifname)}

    class Probe(Callback):
        """Clock and kernel counter at the edges of the training loop."""

        def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
            tx["train_start"] = read_tx(ifname)
            self.t0, self.cpu0 = time.perf_counter(), time.process_time()

        def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
            # Runs before the strategy's on_train_end (Lightning calls callbacks first), so the
            # consensus exchange at the end of fit falls in the wind-down phase.
            self.loop_s = time.perf_counter() - self.t0
            self.loop_cpu_s = time.process_time() - self.cpu0
            tx["train_end"] = read_tx(ifname)
            self.loop_comm_bytes = trainer.strategy.comm_meter.total_bytes
            logged = trainer.callback_metrics.get("pdist/comm_bytes_total")
            self.logged = None if logged is None else float(logged)

    seed_everything(spec["seed"], workers=True, verbose=False)
    data = DigitsDataModule(batch_size=spec["batch_size"], seed=spec["seed"])
    module = ClassifierModule(
        model="cnn", width=spec["width"], optimizer="sgd", lr=spec["lr"], momentum=spec["momentum"]
    )
    probe = Probe()
    trainer = bench_trainer(
        devices=1,
        num_nodes=spec["world_size"],
        strategy=build_strategy(spec),
        max_steps=spec["steps"],
        callbacks=[probe],
        # pdist/* keys are logged on logged steps only; logging every step keeps "logged_comm_bytes_total" (read in
        # on_train_end) the loop's total, and every strategy pays the same for it.
        log_every_n_steps=1,
    )
    fit_t0 = time.perf_counter()
    trainer.fit(module, datamodule=data)
    fit_s = time.perf_counter() - fit_t0
    tx["after_fit"] = read_tx(ifname)
    if trainer.world_size != spec["world_size"]:
        raise RuntimeError(
            f"worker: the Trainer formed world_size={trainer.world_size}, the spec says {spec['world_size']}; "
            "launch one process per rank with RANK/WORLD_SIZE/LOCAL_RANK/NODE_RANK set"
        )
    val_acc, val_samples = evaluate(module, data.val_set)
    meter = trainer.strategy.comm_meter
    result = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "spec": spec,
        "train_steps": trainer.global_step,
        "samples_seen": trainer.global_step * spec["batch_size"],
        "val_acc": val_acc,
        "val_samples": val_samples,
        "comm_bytes": meter.total_bytes,
        "comm_by_kind": dict(meter.by_kind),
        "logged_comm_bytes_total": probe.logged,
        "loop_comm_bytes": probe.loop_comm_bytes,
        "loop_s": probe.loop_s,
        "loop_cpu_s": probe.loop_cpu_s,
        "fit_s": fit_s,
        "param_digest": param_digest(module),
        "model_params": sum(p.numel() for p in module.parameters()),
        "tx": {k: v[0] for k, v in tx.items()} if all(tx.values()) else None,
        "tx_packets": {k: v[1] for k, v in tx.items()} if all(tx.values()) else None,
    }
    return result


if __name__ == "__main__":
    raise SystemExit(worker_main("lightning_pdist.bench.worker", __doc__, check_spec, run))
