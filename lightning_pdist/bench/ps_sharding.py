"""Parameter-server suite: paper 000 Fig. 2 (layer-wise vs memory-balanced sharding) and the async straggler test.

``python -m lightning_pdist.bench ps_sharding [--quick] --out DIR [--parts sharding straggler]
[--workers 1 2 4 8] [--rate 100mbit] [--width 0.0625]`` writes:

* ``DIR/ps_sharding.json``: ``rows`` (Part A, one per run: ``{"workers", "servers", "sharding", "mode",
  "samples_per_s", "speedup_vs_1_worker", "max_server_bytes_per_step", "mean_server_bytes_per_step",
  "network", "bound_samples_per_s", ...}``), ``ratios`` (memory / layer throughput at each worker count,
  next to the paper's 1.20 at 4 and 1.66 at 8 workers) and ``straggler`` (Part B rows
  ``{"mode", "slowed", "worker", "steps_per_s", ...}`` and the summary per mode);
* ``DIR/ps_sharding.png``: throughput vs workers per sharding with the communication bounds, the
  busiest server's bytes per step, and each worker's step rate with and without a straggler.

Every process is a host of its own in an :class:`~lightning_pdist.bench.netns.EmulatedNetwork`: links of
``--rate`` both ways (``tc tbf``), one switch. Servers first (``servers = ceil(workers / 2)``, the
paper's ratio), then the workers, each a real Lightning ``Trainer`` with ``ParameterServerStrategy``
pointed at the servers' addresses (:mod:`~lightning_pdist.bench.ps_worker`). The model is
``vgg16_scaled(width)``: VGG-16's layer shapes scaled down, ``fc6`` still 74.2% of the weights, so the
``layer`` plan leaves one server with ~74% of the bytes as in the paper. The link rate is chosen so that
moving the shards, not the 2 cores, sets the pace; each row carries the compute share that shows it.

Communication bound of a sync step: every worker pushes its gradient (``P`` bytes, cut by the plan) and
pulls the new parameters, so each direction of the busiest link carries ``max(P, W·f_max·P)`` bytes per
step, where ``f_max`` is the busiest server's share of the bytes (``1/S`` for ``memory``). Links are full
duplex, so the bound is ``W·B·rate / max(P, W·f_max·P)`` samples/s (``bound_balanced``: ``f_max = 1/S``).
It is reachable only where one worker's push overlaps another's pull. In sync mode a server replies only
once every push of the step has arrived, so on a server's link the pushes and then the pulls take turns and
a step takes about twice the bound's time (a lone worker, too, pushes, waits and then pulls).

Part A's ``chunked`` rows run the memory plan with ``ParameterServerStrategy(chunk_bytes=...)`` (BytePS-style chunked
steps: pushes in and pulls out overlap, so the bound above is reachable in principle). Every Part A row also records
the machine's CPU busy during the timed steps and every host's TCP retransmissions and shaper drops, which tell a
link-bound run from a CPU-bound or a lossy one; ``--repeats N`` runs the plan N times (median run, spread).

Without network namespaces (not root, no ``ip``/``tc``) the suite says why and stops with exit
status 1: loopback figures are never passed off as network figures.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from lightning_pdist.bench.cli import SuiteCli, SuiteRules
from lightning_pdist.bench.launch import Launcher, SuiteRun
from lightning_pdist.bench.linkload import LinkSampler, link_activity
from lightning_pdist.bench.netns import parse_rate
from lightning_pdist.bench.report import documented_run, markdown_table, run_lines, save_figure, subplots

SUITE = "ps_sharding"
PARTS = ("sharding", "straggler")
SHARDINGS = ("layer", "memory")  # the server plans
# Part A's rows: "chunked" is the memory plan with chunk_bytes (BytePS steps), each worker pushing its chunks as fast as
# its link takes them (chunks_in_flight=None, the strategy's default); "paced" the same with chunks_in_flight=m
ROW_SHARDINGS = (*SHARDINGS, "chunked", "paced")
CHUNKED = ("chunked", "paced")
DEFAULT_IN_FLIGHT = None  # ParameterServerStrategy's DEFAULT_CHUNKS_IN_FLIGHT (the suite's process imports no torch)
PACED_IN_FLIGHT = 4
ROW_KEYS = ("workers", "servers", "sharding", "mode", "samples_per_s", "speedup_vs_1_worker",
            "max_server_bytes_per_step", "mean_server_bytes_per_step", "network")  # fmt: skip
PAPER_RATIOS = {4: 1.20, 8: 1.66}  # paper 000 Fig. 2: memory-based over layer-wise sharding, VGG-16
QUICK = {"width": 0.0625, "steps": 6, "straggler_steps": 8, "slow_delay_s": 1.0}
FULL = {"width": 0.125, "steps": 12, "straggler_steps": 16, "slow_delay_s": 3.0}  # 4x the bytes: slower steps
SERVER_PORT = 29400
LINK_SAMPLE_S, LINK_BIN_S = 0.005, 0.02  # the server links' counters every 5 ms, judged in 20 ms bins (linkload.py)


@dataclass(frozen=True)
class SuiteConfig(SuiteRules):
    """Everything that decides what the suite runs; validated on construction.

    Raises:
        ValueError: a value breaks its rule; the message names the option, the value and the rule.
    """

    parts: tuple[str, ...] = PARTS
    """sharding (Part A), straggler (Part B) or both"""
    workers: tuple[int, ...] = (1, 2, 4, 8)
    """worker counts"""
    shardings: tuple[str, ...] = ("layer", "memory", "chunked")
    """any of layer, memory, chunked (the memory plan pushed and pulled in chunk_bytes pieces, BytePS-style), paced
    (chunked, each worker at most chunks_in_flight chunks per server ahead of their replies)"""
    workers_per_server: int = 2
    """servers = ceil(workers / this)"""
    rate: str = "100mbit"
    """every link's rate, both ways"""
    width: float = QUICK["width"]
    """vgg16_scaled width"""
    batch_size: int = 32
    """batch per worker"""
    warmup_steps: int = 2
    """untimed steps"""
    steps: int = QUICK["steps"]
    """timed steps of Part A"""
    straggler_workers: int = 4
    """workers in Part B"""
    straggler_steps: int = QUICK["straggler_steps"]
    """timed steps of Part B"""
    slow_delay_s: float = 1.0
    """the straggler's sleep per batch, s"""
    repeats: int = 1
    """runs of Part A's plan, one after the other; each row is the run with the median samples/s and lists every
    run's figure (the spread)"""
    chunk_bytes: int = 131072
    """the workers' ParameterServerStrategy(chunk_bytes=...) in Part A's chunked runs, raised where a run's servers
    would hold more than the strategy's 64 chunks each (the row records the value used)"""
    chunks_in_flight: int = PACED_IN_FLIGHT
    """the workers' ParameterServerStrategy(chunks_in_flight=...) in Part A's paced runs"""
    reply_buffer_bytes: int = 0
    """the workers' ParameterServerStrategy(reply_buffer_bytes=...) in Part A's runs: the servers' send buffer per
    worker connection; 0: None, the kernel autotunes it (the strategy's default)"""
    nonfinite: str = "raise"
    """the workers' ParameterServerStrategy(nonfinite=...): raise (the default) and skip_step make sync workers agree
    on every step's gradient check before pushing (a meeting of all workers between a step's pull and the next push);
    propagate checks nothing"""
    timeout: float = 600.0
    """seconds per run"""
    quick: bool = True
    SUITE: ClassVar[str] = SUITE
    FLAGS: ClassVar[dict[str, str]] = {"slow_delay_s": "--slow-delay"}

    def __post_init__(self) -> None:
        self.distinct("parts", PARTS)
        self.distinct("shardings", ROW_SHARDINGS)
        self.distinct("workers")
        if any(isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= 16 for w in self.workers):
            raise self.bad("workers", self.workers, "each worker count must be an int in [1, 16]")
        self.ints("workers_per_server", "batch_size", "warmup_steps", "steps", "straggler_steps", "repeats")
        if isinstance(self.straggler_workers, bool) or not isinstance(self.straggler_workers, int) or not 2 <= self.straggler_workers <= 16:
            raise self.bad("straggler_workers", self.straggler_workers, "must be an int in [2, 16] (one straggler and others)")
        try:
            parse_rate(self.rate)
        except ValueError:
            raise self.bad("rate", self.rate, "must look like '100mbit' or '1gbit'") from None
        if not 0 < self.width <= 1:
            raise self.bad("width", self.width, "must be in (0, 1] (1 is the full VGG-16)")
        self.positive("slow_delay_s", "timeout", unit=" seconds")
        if isinstance(self.chunk_bytes, bool) or not isinstance(self.chunk_bytes, int) or self.chunk_bytes < 8 or self.chunk_bytes % 8:
            raise self.bad("chunk_bytes", self.chunk_bytes, "must be a multiple of 8 bytes, at least 8")
        self.ints("chunks_in_flight")
        if self.nonfinite not in ("raise", "skip_step", "propagate"):
            raise self.bad("nonfinite", self.nonfinite, "must be one of raise, skip_step, propagate")
        if isinstance(self.reply_buffer_bytes, bool) or not isinstance(self.reply_buffer_bytes, int) or not (
                self.reply_buffer_bytes == 0 or 4096 <= self.reply_buffer_bytes <= 1 << 26):
            raise self.bad("reply_buffer_bytes", self.reply_buffer_bytes, "must be 0 (kernel autotuning) or an int in "
                                                                          "[4096, 67108864]")  # fmt: skip

    def servers_for(self, workers: int) -> int:
        return math.ceil(workers / self.workers_per_server)


def worker_spec(config: SuiteConfig, workers: int, sharding: str, mode: str = "sync", steps: int | None = None,
                slow_worker: int | None = None, subnet: str = "10.0.0.0/8") -> dict[str, Any]:  # fmt: skip
    """The :mod:`~lightning_pdist.bench.ps_worker` spec of one run (validated); ``sharding`` one of :data:`ROW_SHARDINGS`."""
    from lightning_pdist.bench.ps_worker import check_spec

    servers = config.servers_for(workers)
    return check_spec({
        "workers": workers, "servers": servers, "sharding": "memory" if sharding in CHUNKED else sharding, "mode": mode,
        "width": float(config.width), "batch_size": config.batch_size, "warmup_steps": config.warmup_steps,
        "steps": steps or config.steps, "server_port": SERVER_PORT, "slow_worker": slow_worker,
        "slow_delay_s": config.slow_delay_s if slow_worker is not None else 0.0, "seed": 0, "subnet": subnet,
        "chunk_bytes": run_chunk_bytes(config, servers) if sharding in CHUNKED else None,
        # without chunks the strategy takes only its default; "chunked" rows push unpaced (None)
        "chunks_in_flight": {"chunked": None, "paced": config.chunks_in_flight}.get(sharding, DEFAULT_IN_FLIGHT),
        "reply_buffer_bytes": config.reply_buffer_bytes if mode == "sync" and config.reply_buffer_bytes else None,
        "nonfinite": config.nonfinite,
    })  # fmt: skip


def run_chunk_bytes(config: SuiteConfig, servers: int) -> int:
    """``config.chunk_bytes``, raised to the least size that keeps each of ``servers`` servers at 64 chunks or fewer.

    Partitions go round-robin to the servers, so ``k``-byte chunks make ``ceil(ceil(P / k) / S)`` per server for a
    ``P``-byte model: ``k >= P / (64 S)`` keeps that at 64 (the strategy's own rule and message).
    """
    from lightning_pdist.parameter_server.chunks import MAX_CHUNKS

    nbytes = plan_shares(config.width, servers)["memory"]["bytes"]
    return max(config.chunk_bytes, 8 * math.ceil(nbytes / (MAX_CHUNKS * servers * 8)))


def plan_shares(width: float, servers: int) -> dict[str, dict[str, float]]:
    """Busiest server's share of the bytes under each plan, for ``vgg16_scaled(width)`` on ``servers`` servers."""
    from lightning_pdist.parameter_server.sharding import param_specs, plan_sharding
    from lightning_pdist.models.vgg import vgg16_scaled

    specs = param_specs(vgg16_scaled(width=width, device="meta"))
    out = {}
    for sharding in SHARDINGS:
        plan = plan_sharding(specs, servers, sharding)
        out[sharding] = {"max_share": plan.max_bytes / plan.nbytes, "bytes": plan.nbytes}
    return out


def bound_samples_per_s(workers: int, batch_size: int, param_bytes: int, max_share: float, rate_bits: int) -> float:
    """Samples/s of a sync step whose busiest link carries its bytes at line rate in each direction at once."""
    step_s = max(1.0, workers * max_share) * param_bytes * 8 / rate_bits
    return workers * batch_size / step_s


# -- running ------------------------------------------------------------------------------------


class Runner:
    """Launches runs on one emulated network (servers on the first hosts, workers after them)."""

    def __init__(self, net: Any, config: SuiteConfig, launcher: Launcher, log: Callable[[str], None]) -> None:
        self.net, self.config, self.launcher, self.log = net, config, launcher, log

    def launch(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Run ``spec``; return workers' and servers' results, wall time and the servers' kernel bytes."""
        servers, workers = spec["servers"], spec["workers"]
        hosts = ",".join(self.net.host_ip(i) for i in range(servers + workers))
        lossy = lambda: [(self.net.tcp_retransmits(i), self.net.shaper_drops(i), self.net.shaper_drops(i, "ingress"))  # noqa: E731
                         for i in range(servers + workers)]  # fmt: skip
        before = lossy()
        with LinkSampler(self.net, range(servers), LINK_SAMPLE_S) as links:
            got = self.launcher.run("lightning_pdist.bench.ps_worker", spec, servers + workers, self.net,
                                    files=[("worker", workers), ("server", servers)], extra_argv=["--hosts", hosts],
                                    kernel_hosts=servers)  # fmt: skip
        after = lossy()
        ws = got.results[:workers]
        window = (max(w["t0"] for w in ws), min(w["t1"] for w in ws))
        return {"workers": ws, "servers": got.results[workers:], "wall_s": got.wall_s,
                "links": link_activity(links.samples, *window, parse_rate(self.config.rate), LINK_BIN_S),
                "kernel_server_bytes": [rx + tx for rx, tx in got.kernel],
                # every host's TCP retransmissions and shaper drops over the whole launch (warm-up included)
                "tcp_retransmits": sum(a[0] - b[0] for a, b in zip(after, before)),
                "shaper_drops": sum(a[1] - b[1] for a, b in zip(after, before)),
                # of which at the bridge's shapers toward the servers (pushes converging: incast) and the workers
                "drops_into_servers": sum(a[2] - b[2] for a, b in zip(after[:servers], before[:servers])),
                "drops_into_workers": sum(a[2] - b[2] for a, b in zip(after[servers:], before[servers:]))}  # fmt: skip


def build_row(spec: dict[str, Any], result: dict[str, Any], config: SuiteConfig, network: str) -> dict[str, Any]:
    """One Part A row from a sync run's results; a chunked run's row says ``sharding: "chunked"`` or ``"paced"``."""
    ws, steps, batch = spec["workers"], spec["steps"], spec["batch_size"]
    per_worker = result["workers"]
    samples_per_s = sum(w["steps_per_s"] for w in per_worker) * batch
    # Every reply carries the server's running totals, so any worker sees all workers' traffic; worker 0's view.
    loads = [(i + o) / steps for i, o in zip(per_worker[0]["server_bytes_in"], per_worker[0]["server_bytes_out"])]
    params = per_worker[0]["params"]
    shares = plan_shares(config.width, spec["servers"])
    rate_bits = parse_rate(config.rate)
    served = sum(s["bytes_in"] + s["bytes_out"] for s in result["servers"])
    step_s = ws * batch / samples_per_s
    per_step = lambda n: None if n is None else round(n / (spec["warmup_steps"] + steps), 1)  # noqa: E731
    compute_s = ws * max(w["compute_ms_per_step"] for w in per_worker) / 1000 / 2  # all workers' compute on 2 cores
    return {
        "workers": ws,
        "servers": spec["servers"],
        "sharding": ("paced" if spec["chunks_in_flight"] else "chunked") if spec["chunk_bytes"] else spec["sharding"],
        "mode": spec["mode"],
        "chunk_bytes": spec["chunk_bytes"],
        "chunks_in_flight": spec["chunks_in_flight"] if spec["chunk_bytes"] else None,
        "reply_buffer_bytes": spec.get("reply_buffer_bytes"),
        "nonfinite": spec.get("nonfinite"),
        "samples_per_s": round(samples_per_s, 2),
        "speedup_vs_1_worker": None,
        "max_server_bytes_per_step": round(max(loads)),
        "mean_server_bytes_per_step": round(sum(loads) / len(loads)),
        "network": network,
        "rate": config.rate,
        "params": params,
        "plan_max_share": round(shares[spec["sharding"]]["max_share"], 4),
        "bound_samples_per_s": round(bound_samples_per_s(ws, batch, 4 * params, shares[spec["sharding"]]["max_share"], rate_bits), 2),
        "bound_balanced_samples_per_s": round(bound_samples_per_s(ws, batch, 4 * params, 1 / spec["servers"], rate_bits), 2),
        "step_s": round(step_s, 4),
        "compute_share": round(compute_s / step_s, 3),
        "wait_share": round(sum(w["wait_s"] for w in per_worker) / sum(w["loop_s"] for w in per_worker), 3),
        # the machine's cores during the timed steps: all of it, and the workers' own processes' part of it
        "machine_cpu_busy": round(sum(w["machine_cpu_busy"] for w in per_worker) / ws, 3),
        "workers_cpu_share": round(sum(w["cpu_s"] for w in per_worker) / (os.cpu_count() * sum(w["loop_s"] for w in per_worker) / ws), 3),
        "kernel_server_ratio": round(sum(result["kernel_server_bytes"]) / served, 4) if served else None,
        "tcp_retransmits_per_step": round(result["tcp_retransmits"] / (spec["warmup_steps"] + steps), 1),
        "shaper_drops_per_step": round(result["shaper_drops"] / (spec["warmup_steps"] + steps), 1),
        "drops_into_servers_per_step": per_step(result.get("drops_into_servers")),
        "drops_into_workers_per_step": per_step(result.get("drops_into_workers")),
        "process_wall_s": round(result["wall_s"], 1),
        **server_links(result.get("links") or []),
    }


def server_links(links: list[dict[str, dict[str, float]]]) -> dict[str, float | None]:
    """The servers' links in the timed steps, mean over servers: ``in`` (pushes arriving), ``out`` (pulls leaving)."""
    out: dict[str, float | None] = {}
    for way, name in (("down", "in"), ("up", "out")):
        for key in ("utilization", "idle_share"):
            values = [h[way][key] for h in links if h[way][key] is not None]
            out[f"server_{name}_{key}"] = round(sum(values) / len(values), 3) if values else None
    return out


def add_speedups(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Fill ``speedup_vs_1_worker`` per sharding; return memory/layer (and chunked/memory) ratios per worker count."""
    for row in rows:
        base = next((r for r in rows if r["workers"] == 1 and r["sharding"] == row["sharding"]), None)
        row["speedup_vs_1_worker"] = round(row["samples_per_s"] / base["samples_per_s"], 3) if base else None
    ratios = {}
    for ws in sorted({r["workers"] for r in rows}):
        by = {r["sharding"]: r for r in rows if r["workers"] == ws}
        if "layer" in by and "memory" in by:
            ratios[str(ws)] = {
                "measured": round(by["memory"]["samples_per_s"] / by["layer"]["samples_per_s"], 3),
                "bound": round(by["memory"]["bound_samples_per_s"] / by["layer"]["bound_samples_per_s"], 3),
                "paper": PAPER_RATIOS.get(ws),
            }
        for kind in CHUNKED:
            if kind in by and "memory" in by:
                ratios.setdefault(str(ws), {})[f"{kind}_vs_memory"] = round(by[kind]["samples_per_s"] / by["memory"]["samples_per_s"], 3)
    return ratios


def run_sharding(runner: Runner, config: SuiteConfig, network: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Part A: every worker count under every sharding, sync mode; the whole plan ``repeats`` times over."""
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    total, done = config.repeats * len(config.workers) * len(config.shardings), 0
    for _ in range(config.repeats):
        for ws in config.workers:
            for sharding in config.shardings:
                spec = worker_spec(config, ws, sharding, subnet=str(runner.net.subnet))
                row = build_row(spec, runner.launch(spec), config, network)
                runs.setdefault((ws, sharding), []).append(row)
                done += 1
                runner.log(f"[A {done}/{total}] {ws} workers, {row['servers']} servers, {sharding}: "
                           f"{row['samples_per_s']:.1f} samples/s (bound {row['bound_samples_per_s']:.1f}), busiest "
                           f"server {row['max_server_bytes_per_step'] / 1e6:.2f} MB/step, CPU busy {row['machine_cpu_busy']:.2f}, "
                           f"retransmits/step {row['tcp_retransmits_per_step']}, run {row['process_wall_s']} s")  # fmt: skip
    rows = [median_run(r) for r in runs.values()]
    return rows, add_speedups(rows)


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median samples/s (the lower of the middle two), with every run's samples/s in order."""
    row = sorted(runs, key=lambda r: r["samples_per_s"])[(len(runs) - 1) // 2]
    return {**row, "samples_per_s_runs": [r["samples_per_s"] for r in runs]}


def run_straggler(runner: Runner, config: SuiteConfig, network: str) -> dict[str, Any]:
    """Part B: sync and async, with and without worker 0 sleeping ``slow_delay_s`` before every batch."""
    rows = []
    ws = config.straggler_workers
    for mode in ("sync", "async"):
        for slow in (None, 0):
            spec = worker_spec(config, ws, "memory", mode, config.straggler_steps, slow, str(runner.net.subnet))
            result = runner.launch(spec)
            for w in result["workers"]:
                rows.append({"mode": mode, "slowed": slow is not None, "worker": w["worker"],
                             "straggler": slow == w["worker"], "steps_per_s": round(w["steps_per_s"], 3),
                             "slow_delay_s": w["slow_delay_s"], "workers": ws, "servers": spec["servers"],
                             "network": network, "rate": config.rate})  # fmt: skip
            rates = ", ".join(f"{w['steps_per_s']:.2f}" for w in result["workers"])
            runner.log(f"[B] {mode}, {'worker 0 slowed by ' + str(config.slow_delay_s) + ' s' if slow is not None else 'no straggler'}: "
                       f"steps/s per worker {rates}")  # fmt: skip
    summary = []
    for mode in ("sync", "async"):
        def others(slowed: bool, m: str = mode) -> float:
            rates = [r["steps_per_s"] for r in rows if r["mode"] == m and r["slowed"] == slowed and r["worker"] != 0]
            return sum(rates) / len(rates)

        summary.append({"mode": mode, "others_steps_per_s": round(others(False), 3),
                        "others_steps_per_s_with_straggler": round(others(True), 3),
                        "ratio": round(others(True) / others(False), 3),
                        "straggler_steps_per_s": next(r["steps_per_s"] for r in rows
                                                      if r["mode"] == mode and r["straggler"])})  # fmt: skip
    return {"rows": rows, "summary": summary}


def run_suite(config: SuiteConfig, out: Path, command: str, log: Callable[[str], None] = print) -> dict[str, Any] | None:
    """Run the requested parts on an emulated network; write ``out/ps_sharding.{json,png}``; return the document.

    Returns ``None`` (and writes nothing) when network namespaces are not available here.
    """
    from lightning_pdist.bench.netns import EmulatedNetwork

    if Path(out).exists() and not Path(out).is_dir():
        raise ValueError(f"{SUITE}(--out={str(out)!r}): --out must be a directory, and this is a file")
    ok, reason = EmulatedNetwork.available()
    if not ok:
        log(f"{SUITE}: cannot build emulated links here ({reason}); this suite measures communication and does "
            "not run on loopback. Run it as root on a machine with iproute2 (ip, tc).")  # fmt: skip
        return None
    hosts = max([config.servers_for(w) + w for w in config.workers] + [config.servers_for(config.straggler_workers) + config.straggler_workers])
    with SuiteRun(SUITE, config, out, command, log) as run:
        doc, network = run.doc, f"emulated {config.rate}"
        runner = Runner(run.emulated(network, hosts, config.rate), config, run.launcher, log)
        doc["ratios"], doc["straggler"] = {}, None
        if "sharding" in config.parts:
            doc["rows"], doc["ratios"] = run_sharding(runner, config, network)
        if "straggler" in config.parts:
            doc["straggler"] = run_straggler(runner, config, network)
    return run.finish(plot)


# -- output -------------------------------------------------------------------------------------

def spread(runs: list[float] | None) -> str:
    """``min–max (n runs)`` of a row's runs; ``–`` for one run (or a file from before repeats)."""
    if not runs or len(runs) < 2:
        return "–"
    return f"{min(runs):.1f}–{max(runs):.1f} ({len(runs)} runs)"


ROW_COLUMNS = (
    ("workers", "workers", None), ("servers", "servers", None), ("sharding", "sharding", None),
    ("chunk bytes", "chunk_bytes", None), ("chunks in flight", "chunks_in_flight", None),
    ("reply buffer bytes", "reply_buffer_bytes", None), ("nonfinite", "nonfinite", None),
    ("samples/s", "samples_per_s", ".1f"),
    ("runs (min–max)", "samples_per_s_runs", spread), ("speedup vs 1", "speedup_vs_1_worker", ".2f"),
    ("bound samples/s", "bound_samples_per_s", ".1f"), ("of bound", "of_bound", ".0%"), ("busiest server MB/step", "max_server_bytes_per_step", lambda v: f"{v / 1e6:.2f}"),
    ("mean server MB/step", "mean_server_bytes_per_step", lambda v: f"{v / 1e6:.2f}"),
    ("plan max share", "plan_max_share", ".3f"), ("compute share", "compute_share", ".2f"),
    ("wait share", "wait_share", ".2f"), ("CPU busy", "machine_cpu_busy", ".0%"),
    ("workers' CPU", "workers_cpu_share", ".0%"), ("retransmits/step", "tcp_retransmits_per_step", ".1f"),
    ("drops/step", "shaper_drops_per_step", ".1f"), ("drops into servers/step", "drops_into_servers_per_step", ".1f"),
    ("server in use", "server_in_utilization", ".0%"),
    ("server in idle", "server_in_idle_share", ".0%"), ("server out use", "server_out_utilization", ".0%"),
    ("server out idle", "server_out_idle_share", ".0%"), ("kernel/served", "kernel_server_ratio", ".3f"),
)  # fmt: skip
STRAGGLER_COLUMNS = (
    ("mode", "mode", None), ("others' steps/s", "others_steps_per_s", ".3f"),
    ("others' steps/s, worker 0 slowed", "others_steps_per_s_with_straggler", ".3f"), ("ratio", "ratio", ".3f"),
    ("straggler steps/s", "straggler_steps_per_s", ".3f"),
)  # fmt: skip


def shown_columns(rows: list[dict[str, Any]]) -> tuple:
    """:data:`ROW_COLUMNS` less those no row fills (figures a file from an older run or a one-run plan lacks)."""
    empty = lambda key: all(spread(r.get(key)) == "–" if key == "samples_per_s_runs" else r.get(key) is None  # noqa: E731
                            for r in rows)  # fmt: skip
    return tuple(c for c in ROW_COLUMNS if c[1] == "of_bound" or not empty(c[1]))


def ratio_lines(ratios: dict[str, Any]) -> list[str]:
    lines = []
    for ws, r in ratios.items():
        said = []
        if "measured" in r:
            said.append(f"memory / layer = {r['measured']:.2f} measured, {r['bound']:.2f} by the communication bounds"
                        + (f", {r['paper']:.2f} in the paper" if r["paper"] else ""))  # fmt: skip
        for kind in CHUNKED:
            if f"{kind}_vs_memory" in r:
                said.append(f"{kind} / memory = {r[f'{kind}_vs_memory']:.2f} measured")
        lines.append(f"- {ws} workers: " + "; ".join(said))
    return lines


def docs_section(doc: dict[str, Any], json_path: str) -> str:
    """The figures of a suite document as markdown for docs/benchmarks.md; everything is read from ``doc``."""
    cfg = doc["config"]
    (name, net), = doc["networks"].items()
    first = doc["rows"][0] if doc["rows"] else {}
    lines = [
        *run_lines(doc, json_path), "",
        f"Network: {net['detail']} (TCP goodput host 0 → 1 measured at {net['measured_tcp_goodput_bytes_per_s'] * 8 / 1e6:.1f} "
        "Mbit/s). Every server and every worker is a host of its own.", "",
    ]  # fmt: skip
    if doc["rows"]:
        lines += [
            "### Part A: paper 000 Fig. 2, layer-wise vs memory-balanced sharding (sync)", "",
            *(["`chunked`: the memory plan cut into `chunk_bytes` partitions, each pushed, closed and pulled on its own "
               "(`ParameterServerStrategy(chunk_bytes=...)`, BytePS-style), so pushes in and pulls out overlap.", ""]
              if any(r["sharding"] in CHUNKED for r in doc["rows"]) else []),
            *(["`paced`: the same chunks, each worker pushing a server's chunk `j` only once chunk `j − m` came back "
               "(`chunks_in_flight=m`, the row's chunks in flight), so no worker runs ahead of the others.", ""]
              if any(r["sharding"] == "paced" for r in doc["rows"]) else []),
            f"`vgg16_scaled(width={cfg['width']})` = {first.get('params', 0):,} parameters, batch {cfg['batch_size']} of "
            f"synthetic 32x32 images per worker, plain SGD; one server per {cfg['workers_per_server']} workers; "
            f"{cfg['steps']} timed steps after {cfg['warmup_steps']}. Server bytes per step: in + out, from the servers' own "
            "counters in their replies; kernel/served: the server hosts' veth rx + tx over the whole run against the bytes "
            "the servers framed. Compute share: the workers' forward + backward on 2 cores over the step time. CPU busy: the "
            "machine's cores busy during the timed steps (`/proc/stat`: servers, workers, the kernel's emulated links); "
            "workers' CPU: the worker processes' part of the cores. Retransmits and drops: every host's TCP "
            "retransmitted segments and the link shapers' dropped packets per step (the launch's, warm-up included).", "",
            markdown_table([{**r, "of_bound": r["samples_per_s"] / r["bound_samples_per_s"]} for r in doc["rows"]],
                           shown_columns(doc["rows"])),
            "", *ratio_lines(doc["ratios"]),
        ]  # fmt: skip
    if doc.get("straggler"):
        lines += [
            "", "### Part B: a straggler in sync and async mode", "",
            f"{cfg['straggler_workers']} workers, memory sharding, {cfg['straggler_steps']} timed steps; worker 0 sleeps "
            f"{cfg['slow_delay_s']} s before every batch in the slowed runs.", "",
            markdown_table(doc["straggler"]["summary"], STRAGGLER_COLUMNS),
        ]  # fmt: skip
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: str | Path) -> Path:
    """Throughput vs workers, the busiest server's bytes, and the straggler runs' step rates."""
    fig, axes = subplots(1, 3, figsize=(15, 4.2))
    colors = {"layer": "tab:red", "memory": "tab:blue", "chunked": "tab:green", "paced": "tab:purple"}
    for sharding in ROW_SHARDINGS:
        rows = sorted((r for r in doc["rows"] if r["sharding"] == sharding), key=lambda r: r["workers"])
        if not rows:
            continue
        x = [r["workers"] for r in rows]
        axes[0].plot(x, [r["samples_per_s"] for r in rows], "o-", color=colors[sharding], label=f"{sharding} (measured)")
        axes[0].plot(x, [r["bound_samples_per_s"] for r in rows], "--", color=colors[sharding], alpha=0.6, label=f"{sharding} (bound)")
        axes[1].plot(x, [r["max_server_bytes_per_step"] / 1e6 for r in rows], "o-", color=colors[sharding], label=f"{sharding}: busiest")
        axes[1].plot(x, [r["mean_server_bytes_per_step"] / 1e6 for r in rows], ":", color=colors[sharding], label=f"{sharding}: mean")
    net = next(iter(doc["networks"]), "")
    axes[0].set(xlabel="workers", ylabel="samples/s", title=f"sync PS throughput ({net})")
    axes[1].set(xlabel="workers", ylabel="MB per step", title="server bytes per step (in + out)")
    for ax in axes[:2]:
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=8)
    straggler = doc.get("straggler")
    if straggler:
        labels, values, bar_colors = [], [], []
        for mode in ("sync", "async"):
            for slowed in (False, True):
                for r in (r for r in straggler["rows"] if r["mode"] == mode and r["slowed"] == slowed):
                    labels.append(f"{mode}{' slow' if slowed else ''} w{r['worker']}")
                    values.append(r["steps_per_s"])
                    bar_colors.append("tab:gray" if r["straggler"] else ("tab:orange" if mode == "sync" else "tab:green"))
        axes[2].bar(range(len(values)), values, color=bar_colors)
        axes[2].set_xticks(range(len(values)), labels, rotation=90, fontsize=7)
        axes[2].set(ylabel="steps/s", title="per-worker step rate (gray: the straggler)")
    else:
        axes[2].axis("off")
    return save_figure(fig, path)


# -- command line -------------------------------------------------------------------------------

CLI = SuiteCli(config=SuiteConfig, quick=QUICK, full=FULL, out="ps_sharding.json and ps_sharding.png")

run = documented_run(SUITE, run_suite, docs_section)
