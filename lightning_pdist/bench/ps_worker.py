"""One process of a parameter-server benchmark run: ``python -m lightning_pdist.bench.ps_worker --spec JSON
--hosts IP,IP,... --out-dir DIR``.

:func:`~lightning_pdist.bench.netns.launch_ranks` starts ``servers + workers`` copies of this module, one
per emulated host, and numbers them by ``RANK``. The role follows from it:

* ``RANK < servers``: a parameter server (:class:`~lightning_pdist.parameter_server.server.ShardServer`, the same
  request loop the strategy forks) bound to its own host's address at ``spec["server_port"]``, accepting
  the emulated subnet only. It exits when every worker has gone and writes ``server<i>.json``
  (``bytes_in``, ``bytes_out``: every framed message it received and sent).
* otherwise: worker ``RANK - servers``, a real Lightning ``Trainer(num_nodes=workers, devices=1)`` with
  ``ParameterServerStrategy(server_addresses=...)`` training ``ClassifierModule(vgg16_scaled(width))`` on
  synthetic 32x32 images. Its environment is renumbered first (``RANK``, ``NODE_RANK``, ``WORLD_SIZE``,
  ``MASTER_ADDR`` = the first worker's host), so the workers' own gloo group never touches the servers.
  It times ``steps`` optimizer steps after ``warmup_steps`` untimed ones and writes ``worker<r>.json``::

      {"worker", "steps", "loop_s", "steps_per_s", "compute_ms_per_step", "wait_s",
       "server_bytes_in", "server_bytes_out", "params", "slow_delay_s"}

  ``server_bytes_in/out[s]`` are server ``s``'s bytes during the timed steps as its replies to this
  worker report them (all workers' traffic, not just this one's). Worker ``spec["slow_worker"]``
  sleeps ``spec["slow_delay_s"]`` before every batch: the straggler of the async benchmark.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from lightning_pdist.bench.launch import WorkerSpec, bench_trainer, worker_main

MODES = ("sync", "async", "ssp")
SHARDINGS = ("layer", "memory")
NONFINITE = ("raise", "skip_step", "propagate")  # lightning_pdist.core.nonfinite.NONFINITE_POLICIES (no torch here)


@dataclass(frozen=True)
class Spec(WorkerSpec):
    """One parameter-server run: ``servers`` servers and ``workers`` workers, timed ``steps`` after ``warmup_steps``."""

    WHO: ClassVar[str] = "ps_worker"
    workers: int
    servers: int
    sharding: str
    mode: str
    width: float
    batch_size: int
    warmup_steps: int
    steps: int
    server_port: int
    slow_worker: int | None
    slow_delay_s: float
    seed: int
    subnet: str
    chunk_bytes: int | None = None
    chunks_in_flight: int | None = None  # the strategy's default (DEFAULT_CHUNKS_IN_FLIGHT; not imported: no torch here)
    reply_buffer_bytes: int | None = None  # the strategy's default (DEFAULT_REPLY_BUFFER_BYTES: kernel autotuning)
    nonfinite: str = "raise"  # the strategy's default; "propagate": no per-step agreement among sync workers

    def __post_init__(self) -> None:
        self.one_of("mode", MODES)
        self.one_of("sharding", SHARDINGS)
        self.ints("workers", "servers", "batch_size", "steps", "server_port")
        self.ints("warmup_steps", why=" (the clock starts after it)")
        self.ints("seed", low=0)
        if not isinstance(self.width, float) or not 0 < self.width <= 1:
            raise self.bad("width", "width must be a float in (0, 1]")
        if self.slow_worker is not None and not (isinstance(self.slow_worker, int) and 0 <= self.slow_worker < self.workers):
            raise self.bad("slow_worker", f"slow_worker must be None or in [0, {self.workers})")
        if self.chunks_in_flight is not None and (not isinstance(self.chunks_in_flight, int) or self.chunks_in_flight < 1):
            raise self.bad("chunks_in_flight", "chunks_in_flight must be None or an int >= 1")
        self.one_of("nonfinite", NONFINITE)
        if self.reply_buffer_bytes is not None and (not isinstance(self.reply_buffer_bytes, int) or self.reply_buffer_bytes < 1):
            raise self.bad("reply_buffer_bytes", "reply_buffer_bytes must be None or an int >= 1")
        if not isinstance(self.slow_delay_s, (int, float)) or self.slow_delay_s < 0:
            raise self.bad("slow_delay_s", "slow_delay_s must be >= 0")


check_spec = Spec.check


def run_server(spec: dict[str, Any], index: int, host: str, out_dir: Path) -> dict[str, Any]:
    """Serve until every worker has gone; write ``server<index>.json``."""
    import socket

    from lightning_pdist.parameter_server.server import ShardServer

    listener = socket.create_server((host, spec["server_port"]), backlog=128)
    server = ShardServer(index, listener, None, allowed_networks=spec["subnet"], idle_timeout=120.0)
    server.serve()
    listener.close()
    result = {"server": index, "bytes_in": server.bytes_in, "bytes_out": server.bytes_out}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"server{index}.json").write_text(json.dumps(result))
    return result


def run_worker(spec: dict[str, Any], worker: int, hosts: list[str], out_dir: Path) -> dict[str, Any]:
    """Train as worker ``worker`` of ``spec["workers"]``; write ``worker<worker>.json``."""
    import torch
    from lightning.pytorch import Callback
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pdist.models.classifier import ClassifierModule
    from lightning_pdist.models.vgg import vgg16_scaled
    from lightning_pdist.parameter_server.strategy import ParameterServerStrategy

    servers, workers = spec["servers"], spec["workers"]
    os.environ.update(RANK=str(worker), NODE_RANK=str(worker), WORLD_SIZE=str(workers), MASTER_ADDR=hosts[servers])
    torch.manual_seed(spec["seed"])
    net = vgg16_scaled(width=spec["width"])
    num_classes = net.classifier[-1].out_features
    model = ClassifierModule(model=net, num_classes=num_classes, optimizer="sgd", lr=0.01)
    total = spec["warmup_steps"] + spec["steps"]
    g = torch.Generator().manual_seed(1000 + worker)
    n = spec["batch_size"] * total * workers  # the sampler hands each worker its 1/workers
    data = TensorDataset(torch.randn(n, 3, net.in_size, net.in_size, generator=g), torch.randint(0, num_classes, (n,), generator=g))

    compute_ms = _compute_ms(model, data, spec["batch_size"])
    slow = spec["slow_delay_s"] if spec["slow_worker"] == worker else 0.0

    class Timer(Callback):
        def __init__(self) -> None:
            self.t0: float | None = None
            self.t1 = 0.0
            self.wait = 0.0
            self.seen_in = [0.0] * servers
            self.seen_out = [0.0] * servers

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if slow:
                time.sleep(slow)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            step = trainer.global_step
            if step == spec["warmup_steps"]:
                self.t0, self.cpu0, self.ticks0 = time.perf_counter(), time.process_time(), machine_cpu_ticks()
            elif step > spec["warmup_steps"]:
                self.cpu1, self.ticks1 = time.process_time(), machine_cpu_ticks()
                metrics = trainer.callback_metrics
                self.wait += float(metrics.get("pdist/ps/wait_s", 0.0))
                for s in range(servers):
                    self.seen_in[s] += float(metrics.get(f"pdist/ps/server{s}_bytes_in", 0.0))
                    self.seen_out[s] += float(metrics.get(f"pdist/ps/server{s}_bytes_out", 0.0))
                self.t1 = time.perf_counter()

    timer = Timer()
    strategy = ParameterServerStrategy(
        sharding=spec["sharding"], mode=spec["mode"], allowed_networks=spec["subnet"],
        server_addresses=[f"{hosts[s]}:{spec['server_port']}" for s in range(servers)], server_timeout=120.0,
        chunk_bytes=spec.get("chunk_bytes"), chunks_in_flight=spec["chunks_in_flight"],
        reply_buffer_bytes=spec.get("reply_buffer_bytes"), nonfinite=spec.get("nonfinite", "raise"),
    )  # fmt: skip
    trainer = bench_trainer(
        devices=1, num_nodes=workers, strategy=strategy, max_steps=total, callbacks=[timer],
        log_every_n_steps=1,  # pdist/ps/* are the figures since the last logged step: every step, each step's own
    )  # fmt: skip
    trainer.fit(model, DataLoader(data, batch_size=spec["batch_size"]))
    loop_s = timer.t1 - timer.t0
    (busy0, total0), (busy1, total1) = timer.ticks0, timer.ticks1
    result = {
        "worker": worker,
        "steps": spec["steps"],
        "loop_s": loop_s,
        "t0": timer.t0,  # perf_counter (CLOCK_MONOTONIC, one clock for every process here): the timed window
        "t1": timer.t1,
        "steps_per_s": spec["steps"] / loop_s,
        "compute_ms_per_step": compute_ms,
        "wait_s": timer.wait,
        "cpu_s": timer.cpu1 - timer.cpu0,  # this worker's process, all threads, during the timed steps
        "machine_cpu_busy": (busy1 - busy0) / (total1 - total0),  # every core of the machine, the same window
        "server_bytes_in": timer.seen_in,
        "server_bytes_out": timer.seen_out,
        "params": sum(p.numel() for p in net.parameters()),
        "slow_delay_s": slow,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"worker{worker}.json").write_text(json.dumps(result))
    return result


def machine_cpu_ticks() -> tuple[int, int]:
    """``(busy, total)`` clock ticks of all cores since boot, from ``/proc/stat`` (not namespaced: every emulated
    host's processes, the kernel's softirq work for the emulated links, and anything else running here)."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in f.readline().split()[1:9])
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait


def _compute_ms(model: Any, data: Any, batch_size: int) -> float:
    """Forward + backward of one batch on this core, without any communication (mean of 3 after 1)."""
    from torch.nn import functional as F

    x, y = data.tensors[0][:batch_size], data.tensors[1][:batch_size]
    times = []
    for _ in range(4):
        t0 = time.perf_counter()
        F.cross_entropy(model(x), y).backward()
        times.append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    return 1000 * sum(times[1:]) / 3


def run(spec: dict[str, Any], hosts: list[str], out_dir: Path) -> None:
    """One process of the launch: a server (``RANK < servers``) or a worker."""
    rank = int(os.environ["RANK"])
    if rank < spec["servers"]:
        run_server(spec, rank, hosts[rank], out_dir)
    else:
        run_worker(spec, rank - spec["servers"], hosts, out_dir)


if __name__ == "__main__":
    raise SystemExit(worker_main("lightning_pdist.bench.ps_worker", __doc__, check_spec, run, hosts=True))
