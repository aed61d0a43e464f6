"""One rank of the DiLoCo suite: ``python -m lightning_pdist.bench.diloco_worker --spec JSON --out-dir DIR``.

Every run trains the same byte-level Transformer language model (:mod:`~lightning_pdist.bench.text_lm`, shared with
the compression suite) on the same text — the Python standard library's own ``*.py`` files, concatenated in name
order (ships with the interpreter, no download) — with the same inner optimizer (AdamW), seed and per-rank
batches, then evaluates the model it holds at the end on the same held-out windows (the last ``VAL_BYTES`` of the
text). Strategies:

* ``ddp``: Lightning Fabric's own ``DDPStrategy`` (synchronous baseline: every step all-reduces the gradients);
* ``local_sgd`` / ``bmuf``: ours, :class:`~lightning_pdist.averaging.LocalSGDFabricStrategy` (period ``H``) /
  :class:`~lightning_pdist.averaging.BMUFFabricStrategy` (period ``H``, Nesterov block momentum ``1 − 1/N``,
  block lr 1), ``load_consensus()`` at the end;
* ``diloco`` / ``streaming_diloco``: ours, :class:`~lightning_pdist.diloco.fabric.DiLoCoFabricStrategy` /
  :class:`~lightning_pdist.diloco.fabric.StreamingDiLoCoFabricStrategy` (``optimizer.step()`` runs the rounds;
  ``load_global_model()`` at the end);
* ``torchft_diloco``: torchft's own ``torchft.local_sgd.DiLoCo`` on a plain torch loop, each rank one torchft
  replica group: its own ``TCPStore`` (``is_master=True``), ``ProcessGroupGloo`` and ``Manager`` (synchronous
  quorum); rank 0 also serves the lighthouse on ``MASTER_PORT`` (the port the launcher picked free for this spec;
  nothing else in a torchft run binds it, while ``MASTER_PORT + 1`` was never checked and was once taken).

Writes ``DIR/rank<r>.json``: ``{"rank", "strategy", "train_steps", "loop_s", "step_s", "loop_cpu_s",
"val_loss", "val_acc", "train_loss_last", "comm_bytes", "step_bytes", "fragment_numels", "model_params",
"loop_tx_bytes", "param_digest", "text_bytes", "text_sha", "losses", "step_end_s", "step_tx_bytes"}``
(``comm_bytes``/``step_bytes``: our strategies' own :class:`~lightning_pdist.core.accounting.CommMeter`, ``None``
for the others; ``loop_tx_bytes``: the kernel's ``tx_bytes`` of this rank's emulated link over the training loop,
``None`` on loopback; ``losses``: this rank's training loss at each step; ``step_end_s``: seconds from the loop's
start to the end of each step; ``step_tx_bytes``: the link's ``tx_bytes`` during each step, ``None`` on loopback).
"""

from __future__ import annotations

import hashlib
import os
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

from lightning_pdist.bench.launch import WorkerSpec, worker_main
from lightning_pdist.bench.text_lm import VAL_BYTES, Data, evaluate, loss_of, make_model
from lightning_pdist.bench.worker import read_tx

STRATEGIES = ("ddp", "local_sgd", "bmuf", "diloco", "streaming_diloco", "torchft_diloco")
BALANCE = ("layers", "params")
QUANTIZE = (None, "int8", "int4")


@dataclass(frozen=True)
class Spec(WorkerSpec):
    """One run: a strategy, ``steps`` AdamW steps of ``batch_size`` windows of ``context`` bytes per rank."""

    WHO: ClassVar[str] = "diloco_worker"
    strategy: str
    world_size: int
    steps: int
    sync_every: int | None
    num_fragments: int
    overlap_steps: int
    quantize: str | None
    balance: str
    batch_size: int
    context: int
    width: int
    layers: int
    lr: float
    text_bytes: int
    seed: int

    def __post_init__(self) -> None:
        self.one_of("strategy", STRATEGIES)
        self.one_of("quantize", QUANTIZE)
        self.one_of("balance", BALANCE)
        self.ints("world_size", "steps", "num_fragments", "batch_size", "context", "width", "layers")
        self.ints("overlap_steps", "seed", low=0)
        self.ints("text_bytes", low=2 * VAL_BYTES)
        if self.strategy != "ddp":
            self.ints("sync_every")
            if self.steps % self.sync_every:
                raise self.bad("steps", "steps must be a multiple of sync_every (the run ends on a round boundary)")
        if not self.lr > 0:
            raise self.bad("lr", "lr must be > 0")


check_spec = Spec.check


def own_address() -> str:
    """This host's address towards host 0 (emulated links: the veth's; loopback: 127.0.0.1)."""
    master = os.environ["MASTER_ADDR"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((master, 9))
        return sock.getsockname()[0]


def fabric_strategy(spec: dict[str, Any]) -> Any:
    if spec["strategy"] == "ddp":
        from lightning.fabric.strategies import DDPStrategy

        return DDPStrategy(process_group_backend="gloo")
    if spec["strategy"] == "local_sgd":
        from lightning_pdist.averaging import LocalSGDFabricStrategy

        return LocalSGDFabricStrategy(period=spec["sync_every"], process_group_backend="gloo")
    if spec["strategy"] == "bmuf":
        from lightning_pdist.averaging import BMUFFabricStrategy

        return BMUFFabricStrategy(period=spec["sync_every"], process_group_backend="gloo")
    from lightning_pdist.diloco.fabric import DiLoCoFabricStrategy, StreamingDiLoCoFabricStrategy

    if spec["strategy"] == "diloco":
        return DiLoCoFabricStrategy(sync_every=spec["sync_every"], process_group_backend="gloo")
    return StreamingDiLoCoFabricStrategy(sync_every=spec["sync_every"], num_fragments=spec["num_fragments"],
                                         overlap_steps=spec["overlap_steps"], quantize=spec["quantize"],
                                         balance=spec["balance"], process_group_backend="gloo")  # fmt: skip


def train_ours(spec: dict[str, Any], data: Data, clock: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``ddp``/``local_sgd``/``bmuf``/``diloco``/``streaming_diloco`` under Lightning Fabric; the model each rank
    holds at the end (the consensus or global model for ours)."""
    import torch
    import torch.distributed as dist
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, num_nodes=spec["world_size"], strategy=fabric_strategy(spec))
    fabric.launch()
    model = make_model(spec)
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=spec["lr"]))
    strategy = fabric.strategy
    meter = getattr(strategy, "comm_meter", None)
    if meter is not None:
        meter.end_step()
    step_bytes, losses = [], []
    dist.barrier()
    clock.start()
    for _ in range(spec["steps"]):
        x, y = data.next()
        loss, _ = loss_of(model, x, y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        clock.lap()
        if meter is not None:
            step_bytes.append(meter.end_step())
    clock.stop()
    extra: dict[str, Any] = {"comm_bytes": None, "step_bytes": None, "fragment_numels": None}
    if meter is not None:
        rounds = getattr(strategy, "rounds", None)
        if rounds is not None:
            strategy.load_global_model()
        else:
            strategy.load_consensus()
        extra = {"comm_bytes": meter.total_bytes, "step_bytes": step_bytes, "by_kind": dict(meter.by_kind),
                 "fragment_numels": None if rounds is None else [p.global_params.numel() for p in rounds.parts]}  # fmt: skip
    extra["train_loss_last"] = sum(losses[-10:]) / len(losses[-10:])
    extra["losses"] = losses
    return model.module if hasattr(model, "module") else model, extra


def train_torchft(spec: dict[str, Any], data: Data, clock: Any) -> tuple[Any, dict[str, Any]]:
    """torchft's own DiLoCo: one replica group per rank, lighthouse in rank 0 (see the module docstring)."""
    import torch
    from torch.distributed import TCPStore
    from torchft.checkpointing.http_transport import HTTPTransport
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    rank, host = int(os.environ["RANK"]), own_address()
    port = int(os.environ["MASTER_PORT"])  # no torch.distributed group here: the lighthouse takes the rendezvous port
    lighthouse = None
    if rank == 0:
        from torchft._torchft import LighthouseServer

        lighthouse = LighthouseServer(bind=f"[::]:{port}", min_replicas=spec["world_size"], join_timeout_ms=10000)
    timeout = timedelta(seconds=120)

    class Transport(HTTPTransport):
        """torchft's checkpoint server, advertised at this host's address: it names ``socket.gethostname()``,
        which is the same name in every emulated host's namespace and reaches none of the others."""

        def address(self) -> str:
            return super().address().replace(f"//{socket.gethostname()}:", f"//{host}:", 1)

    store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
    model = make_model(spec)
    inner = torch.optim.AdamW(model.parameters(), lr=spec["lr"])
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), load_state_dict=lambda s: model.load_state_dict(s["model"]),
        state_dict=lambda: {"model": model.state_dict()}, min_replica_size=spec["world_size"], use_async_quorum=False,
        timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout, rank=0, world_size=1, store_addr=host,
        store_port=store.port, lighthouse_addr=f"http://{os.environ['MASTER_ADDR']}:{port}",
        replica_id=f"bench{rank}", hostname=host, checkpoint_transport=Transport(timeout=timeout, num_chunks=0),
    )  # fmt: skip
    losses = []
    try:
        with DiLoCo(manager, [model], inner, outer, sync_every=spec["sync_every"]) as diloco:
            del diloco
            clock.start()
            for _ in range(spec["steps"]):
                x, y = data.next()
                loss, _ = loss_of(model, x, y)
                inner.zero_grad()
                loss.backward()
                inner.step()  # DiLoCo's post-hook runs the quorum and the sync on schedule
                losses.append(float(loss.detach()))
                clock.lap()
            clock.stop()
    finally:
        manager.shutdown(wait=False)
        if lighthouse is not None:
            time.sleep(1.0)  # let the other replica's last calls finish
            lighthouse.shutdown()
    numel = sum(p.numel() for p in model.parameters())
    return model, {"comm_bytes": None, "step_bytes": None, "fragment_numels": [numel], "losses": losses,
                   "train_loss_last": sum(losses[-10:]) / len(losses[-10:])}  # fmt: skip


class Clock:
    """Wall and CPU time, and this host's kernel tx bytes, over the training loop and at the end of each step."""

    def __init__(self) -> None:
        self.ifname = os.environ.get("GLOO_SOCKET_IFNAME")
        self.step_end_s: list[float] = []
        self.step_tx: list[int] | None = []

    def start(self) -> None:
        self.tx0, self.t0, self.cpu0 = read_tx(self.ifname), time.perf_counter(), time.process_time()
        self.last_tx = self.tx0

    def lap(self) -> None:
        """The end of a step: its time since the loop's start, and the bytes the link sent during it."""
        self.step_end_s.append(time.perf_counter() - self.t0)
        tx = read_tx(self.ifname)
        if tx is None or self.last_tx is None or self.step_tx is None:
            self.step_tx = None
        else:
            self.step_tx.append(tx[0] - self.last_tx[0])
            self.last_tx = tx

    def stop(self) -> None:
        self.loop_s, self.loop_cpu_s = time.perf_counter() - self.t0, time.process_time() - self.cpu0
        tx1 = read_tx(self.ifname)
        self.loop_tx = None if tx1 is None or self.tx0 is None else tx1[0] - self.tx0[0]


def run(spec: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """Train one rank as ``spec`` says; return its result dict."""
    import torch

    rank = int(os.environ["RANK"])
    data, clock = Data(spec, rank), Clock()
    train = train_torchft if spec["strategy"] == "torchft_diloco" else train_ours
    model, extra = train(spec, data, clock)
    val_loss, val_acc = evaluate(model, data)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {
        "rank": rank, "strategy": spec["strategy"], "train_steps": spec["steps"], "loop_s": clock.loop_s,
        "step_s": clock.loop_s / spec["steps"], "loop_cpu_s": clock.loop_cpu_s, "val_loss": val_loss,
        "val_acc": val_acc, "model_params": flat.numel(), "loop_tx_bytes": clock.loop_tx,
        "param_digest": hashlib.sha256(flat.double().numpy().tobytes()).hexdigest()[:16], "text_bytes": spec["text_bytes"],
        "text_sha": data.sha, "step_end_s": clock.step_end_s, "step_tx_bytes": clock.step_tx, **extra,
    }  # fmt: skip


if __name__ == "__main__":
    sys.exit(worker_main("lightning_pdist.bench.diloco_worker", __doc__, check_spec, run))
