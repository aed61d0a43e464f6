"""Averaging suite: DDP vs local SGD vs BMUF vs EASGD (vs one-shot averaging) on the digits.

``python -m lightning_pdist.bench averaging [--quick] --out DIR [--network loopback|emulated|both]
[--rate 100mbit] [--world-size 2 [4 ...]]`` trains every strategy for the same number of samples
(same seed, data order, model and optimizer), each rank a real process on gloo, and writes:

* ``DIR/averaging.json``: one row per run, ``{"strategy", "world_size", "period", "val_acc",
  "comm_bytes_per_rank", "wall_s", "network", ...}`` plus, for emulated links, the kernel's
  ``tx_bytes`` of every rank's veth and the check of the logged byte count against it;
* ``DIR/averaging.png``: validation accuracy against bytes sent per rank, and training time per run;
* ``doc["overhead"]`` in the JSON (``--overhead yes``, the default, or ``only``): ``pdist_ddp`` against Lightning's
  own ``ddp`` on the same module, loopback, per-step time at the CNN's default width and at width 64, both in the
  same processes, interleaved, several repeats (:mod:`lightning_pdist.bench.overhead`); the target is a ratio
  within 1.05. ``--overhead only`` runs just that row (about a minute and a half on 2 busy cores).

Networks: ``loopback`` runs the ranks on 127.0.0.1 (unshaped; bandwidth is effectively free);
``emulated`` runs each rank in its own network namespace behind a veth shaped by ``tc tbf`` at
``--rate`` both ways (:mod:`lightning_pdist.bench.netns`). Without root/iproute2 the emulated part
is skipped with the reason, never replaced by loopback figures.

Measured quantities:

* ``val_acc``: accuracy on the whole validation split (359 digits) of the model each rank holds
  after ``fit`` (the strategy's output), evaluated in-process; ``replicas_agree`` says whether
  every rank holds bit-identical weights then.
* ``comm_bytes_per_rank``: the strategy's own :class:`~lightning_pdist.core.accounting.CommMeter`
  total (what ``pdist/comm_bytes_total`` logs, plus one-shot averaging's final average), mean over
  ranks.
* ``wall_s``: the training loop, ``on_train_start`` to ``on_train_end``, slowest rank. Process
  start-up, imports and the rendezvous are in ``process_wall_s`` instead.

Model: ``SmallCNN(width=64)`` (242,570 parameters, 0.97 MB fp32) rather than the default width 16
(19k parameters, 77 kB): one step costs ~24 ms of compute on one core, and one all-reduce of its
gradients costs ~85 ms at 100 Mbit/s, so on emulated links communication is the larger part of a
DDP step and the algorithms' savings show in wall time, while the run still takes seconds.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from lightning_pdist.bench import overhead as overhead_bench
from lightning_pdist.bench.cli import SuiteCli, SuiteRules
from lightning_pdist.bench.launch import Launched, Launcher, SuiteRun
from lightning_pdist.bench.netns import parse_rate
from lightning_pdist.bench.report import (check_rows, command_line, markdown_table, network_lines, save_figure, subplots,
                                          write_json)  # fmt: skip
from lightning_pdist.bench.worker import PERIODIC, STRATEGIES

SUITE = "averaging"
ROW_KEYS = ("strategy", "world_size", "period", "val_acc", "comm_bytes_per_rank", "wall_s", "network")
NETWORKS = ("loopback", "emulated")
OVERHEAD_CHOICES = ("yes", "no", "only")  # the pdist_ddp-vs-ddp row: with the runs, not at all, or alone
# Defaults in one place. Quick: one world size, one period, five runs per network.
QUICK = {"world_sizes": (2,), "periods": (8,)}
FULL = {"world_sizes": (2, 4), "periods": (2, 8, 32)}
DEFAULTS = {
    "rate": "100mbit",
    "samples": 6144,  # 96 steps at 2 x 32: about 4.3 epochs of the 1438 training digits
    "batch_size": 32,
    "lr": 0.05,
    "momentum": 0.9,
    "width": 64,
    "seed": 0,
    "timeout": 600.0,
}
MAX_WORLD_SIZE = 16


@dataclass(frozen=True)
class SuiteConfig(SuiteRules):
    """Everything that decides what the suite runs; validated on construction (``ValueError`` names the option)."""

    networks: tuple[str, ...] = NETWORKS
    """loopback (127.0.0.1), emulated (netns + tbf links, needs root) or both"""
    rate: str = DEFAULTS["rate"]
    """emulated link rate each way, tc syntax"""
    world_sizes: tuple[int, ...] = QUICK["world_sizes"]
    """ranks per run, one or more"""
    periods: tuple[int, ...] = QUICK["periods"]
    """periods of local_sgd/bmuf/easgd"""
    strategies: tuple[str, ...] = STRATEGIES
    """strategies to run, from pdist_ddp local_sgd bmuf easgd simuparallel_sgd"""
    samples: int = DEFAULTS["samples"]
    """training samples per run, over all ranks"""
    batch_size: int = DEFAULTS["batch_size"]
    """per rank"""
    lr: float = DEFAULTS["lr"]
    """SGD learning rate"""
    momentum: float = DEFAULTS["momentum"]
    """SGD momentum"""
    width: int = DEFAULTS["width"]
    """SmallCNN width"""
    seed: int = DEFAULTS["seed"]
    """seed of weights and data"""
    timeout: float = DEFAULTS["timeout"]
    """seconds per run"""
    repeats: int = 1
    """runs per strategy and network; rows keep the fastest"""
    quick: bool = True
    overhead: str = "yes"
    """the pdist_ddp-vs-ddp step-time row on loopback: yes, no, or only (just that row, about a minute and a half; written to averaging_overhead.json)"""
    SUITE: ClassVar[str] = SUITE
    FLAGS: ClassVar[dict[str, str]] = {"networks": "--network", "world_sizes": "--world-size"}

    def __post_init__(self) -> None:
        bad = self.bad
        if self.overhead not in OVERHEAD_CHOICES:
            raise bad("overhead", self.overhead, f"must be one of {OVERHEAD_CHOICES}")
        if not self.networks or any(n not in NETWORKS for n in self.networks):
            raise bad("networks", self.networks, f"each network must be one of {NETWORKS}")
        parse_rate(self.rate)  # raises with the rule
        if not self.world_sizes:
            raise bad("world_sizes", self.world_sizes, "give at least one world size")
        for ws in self.world_sizes:
            if not isinstance(ws, int) or not 2 <= ws <= MAX_WORLD_SIZE:
                raise bad("world_sizes", ws, f"world_size must be an int in [2, {MAX_WORLD_SIZE}] (averaging needs 2+ ranks)")
        if len(set(self.world_sizes)) != len(self.world_sizes):
            raise bad("world_sizes", self.world_sizes, "world sizes must not repeat")
        if not self.strategies or any(s not in STRATEGIES for s in self.strategies):
            raise bad("strategies", self.strategies, f"each strategy must be one of {STRATEGIES}")
        if len(set(self.strategies)) != len(self.strategies):
            raise bad("strategies", self.strategies, "strategies must not repeat")
        if any(s in PERIODIC for s in self.strategies):
            if not self.periods:
                raise bad("periods", self.periods, f"{PERIODIC} need at least one period")
            for p in self.periods:
                if not isinstance(p, int) or p < 1:
                    raise bad("periods", p, "a period must be an int >= 1")
            if len(set(self.periods)) != len(self.periods):
                raise bad("periods", self.periods, "periods must not repeat")
        self.ints("batch_size", "width", "repeats")
        self.ints("seed", low=0)
        self.positive("lr")
        if not 0 <= self.momentum < 1:
            raise bad("momentum", self.momentum, "must be in [0, 1)")
        self.positive("timeout", unit=" seconds")
        largest = max(self.world_sizes) * self.batch_size
        if not isinstance(self.samples, int) or self.samples < largest:
            raise bad("samples", self.samples,
                      f"must be an int >= world_size * batch_size = {largest}, so every run takes at least one step")  # fmt: skip

    def steps(self, world_size: int) -> int:
        """Optimizer steps that process ``samples`` samples with ``world_size`` ranks of ``batch_size``."""
        return self.samples // (world_size * self.batch_size)


def plan_runs(config: SuiteConfig) -> list[dict[str, Any]]:
    """The worker specs to run, per world size: DDP, each periodic strategy at each period, one-shot."""
    specs = []
    for ws in config.world_sizes:
        common = {
            "world_size": ws,
            "steps": config.steps(ws),
            "batch_size": config.batch_size,
            "lr": config.lr,
            "momentum": config.momentum,
            "width": config.width,
            "seed": config.seed,
        }
        for name in config.strategies:
            if name in PERIODIC:
                specs += [{"strategy": name, "period": p, **common} for p in config.periods]
            else:
                specs.append({"strategy": name, "period": 1 if name == "pdist_ddp" else None, **common})
    return specs



# -- rows ---------------------------------------------------------------------------------------


def build_row(
    spec: dict[str, Any],
    ranks: Sequence[dict[str, Any]],
    network: str,
    network_detail: str,
    timing: Launched,
    rate: str | None = None,
    kernel_tx: Sequence[int] | None = None,
) -> dict[str, Any]:
    """One JSON row from a run's spec and its per-rank worker results (and kernel counters, if emulated).

    Raises:
        ValueError: ``network`` is unknown, the ranks do not match the spec's world size, or
            ``kernel_tx`` has not one entry per rank.
    """
    if network not in NETWORKS:
        raise ValueError(f"build_row(network={network!r}): network must be one of {NETWORKS}")
    ws = spec["world_size"]
    if len(ranks) != ws or [r["rank"] for r in ranks] != list(range(ws)):
        raise ValueError(f"build_row(ranks=[{len(ranks)} results]): need one result per rank 0..{ws - 1}, in order")
    if kernel_tx is not None and len(kernel_tx) != ws:
        raise ValueError(f"build_row(kernel_tx={list(kernel_tx)!r}): need one counter per rank ({ws})")
    comm = [int(r["comm_bytes"]) for r in ranks]
    steps = ranks[0]["train_steps"]
    wall = max(r["loop_s"] for r in ranks)
    params = ranks[0]["model_params"]
    row: dict[str, Any] = {
        "strategy": spec["strategy"],
        "world_size": ws,
        "period": spec["period"],
        "val_acc": round(ranks[0]["val_acc"], 4),
        "val_samples": ranks[0]["val_samples"],
        "comm_bytes_per_rank": round(sum(comm) / ws),
        "wall_s": round(wall, 3),
        "network": network,
        "network_detail": network_detail,
        "rate": rate,
        "train_steps": steps,
        "samples": steps * spec["batch_size"] * ws,
        "batch_size_per_rank": spec["batch_size"],
        "seed": spec["seed"],
        "model": f"SmallCNN(width={spec['width']})",
        "model_params": params,
        "model_bytes": 4 * params,
        "comm_bytes_by_rank": comm,
        "comm_by_kind": ranks[0]["comm_by_kind"],
        "logged_comm_bytes_total_by_rank": [r["logged_comm_bytes_total"] for r in ranks],
        "step_ms": round(1000 * wall / steps, 2) if steps else None,
        "loop_cpu_s": round(sum(r["loop_cpu_s"] for r in ranks) / ws, 3),
        "fit_s": round(max(r["fit_s"] for r in ranks), 3),
        "process_wall_s": round(timing.wall_s, 3),
        "ranks_cpu_s": round(timing.ours_cpu_s, 2),
        "other_cpu_s": None if timing.other_cpu_s is None else round(timing.other_cpu_s, 2),
        "other_load_cores": timing.other_load_cores,
        "replicas_agree": len({r["param_digest"] for r in ranks}) == 1,
        "kernel_tx_bytes_per_rank": None,
        "kernel_tx_phases_by_rank": None,
        "kernel_tx_ratio": None,
    }
    if kernel_tx is not None:
        row["kernel_tx_bytes_per_rank"] = [int(t) for t in kernel_tx]
        row["kernel_tx_phases_by_rank"] = [_phases(r, int(t)) for r, t in zip(ranks, kernel_tx)]
        row["kernel_tx_ratio"] = round(sum(kernel_tx) / sum(comm), 4) if sum(comm) else None
    return row


def _phases(rank: dict[str, Any], total: int) -> dict[str, int | None] | None:
    """Split one rank's kernel tx bytes by the worker's counter reads: set-up, loop, wind-down."""
    tx, packets = rank.get("tx"), rank.get("tx_packets")
    if not tx or not packets:
        return None
    setup = tx["train_start"] - tx["start"]
    loop = tx["train_end"] - tx["train_start"]
    return {
        "setup": setup,
        "loop": loop,
        "wind_down": total - setup - loop,
        "loop_packets": packets["train_end"] - packets["train_start"],
        "loop_logged": int(rank["loop_comm_bytes"]),
        "logged": int(rank["comm_bytes"]),
    }


def comm_check(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Compare the logged bytes with the kernel's ``tx_bytes`` for every emulated row (issue 2, item 3).

    Per rank, the kernel bytes split into set-up (rendezvous, DDP's broadcast of rank 0's weights),
    training loop and wind-down (the consensus exchange at the end of ``fit``, teardown). In the
    loop, Lightning adds its own traffic every batch (a broadcast of its SIGTERM flag from rank 0);
    the one-shot run (``simuparallel_sgd``, no training communication in the loop) of the same world
    size measures that per step, and what is left after subtracting it is the training traffic on
    the wire:

    * ``loop_net_ratio`` = (loop tx − baseline bytes/step × steps) / logged loop bytes;
    * ``loop_overhead_bytes_per_packet`` = (that − logged loop bytes) / (loop packets − baseline
      packets/step × steps): the bytes each frame adds to the logged payload (Ethernet, IP and TCP
      headers, and whole frames for ACKs), to set against the 66 bytes of headers of a TCP segment
      with timestamps on Ethernet.
    """
    baselines = {}
    for row in rows:
        if row["strategy"] == "simuparallel_sgd" and row["kernel_tx_phases_by_rank"]:
            phases = row["kernel_tx_phases_by_rank"]
            steps = row["train_steps"]
            baselines[row["world_size"]] = (
                sum(p["loop"] for p in phases) / len(phases) / steps,
                sum(p["loop_packets"] for p in phases) / len(phases) / steps,
            )
    checks = []
    for row in rows:
        phases = row.get("kernel_tx_phases_by_rank")
        if not row.get("kernel_tx_bytes_per_rank") or not phases:
            continue
        ws, steps = row["world_size"], row["train_steps"]
        mean = lambda key: sum(p[key] for p in phases) / len(phases)  # noqa: E731
        logged, loop_logged, loop, packets = mean("logged"), mean("loop_logged"), mean("loop"), mean("loop_packets")
        kernel = sum(row["kernel_tx_bytes_per_rank"]) / ws
        base = baselines.get(ws)
        net = net_packets = None
        if base is not None:
            net, net_packets = loop - base[0] * steps, packets - base[1] * steps
        checks.append(
            {
                "strategy": row["strategy"],
                "period": row["period"],
                "world_size": ws,
                "network_detail": row["network_detail"],
                "logged_bytes_per_rank": round(logged),
                "kernel_tx_bytes_per_rank": round(kernel),
                "ratio": round(kernel / logged, 4) if logged else None,
                "setup_tx_bytes_by_rank": [p["setup"] for p in phases],
                "wind_down_tx_bytes_per_rank": round(mean("wind_down")),
                "loop_tx_bytes_per_rank": round(loop),
                "loop_logged_bytes_per_rank": round(loop_logged),
                "loop_tx_packets_per_rank": round(packets),
                "lightning_loop_bytes_per_step": round(base[0], 1) if base else None,
                "loop_net_ratio": round(net / loop_logged, 4) if net is not None and loop_logged else None,
                "loop_overhead_bytes_per_packet": (
                    round((net - loop_logged) / net_packets, 1) if net is not None and loop_logged and net_packets > 0
                    else None
                ),
            }
        )
    return checks


# -- running ------------------------------------------------------------------------------------


def _describe(row: dict[str, Any]) -> str:
    period = "" if row["period"] is None else f" period={row['period']}"
    kernel = ""
    if row["kernel_tx_ratio"] is not None:
        tx = row["kernel_tx_bytes_per_rank"]
        kernel = f", kernel tx {sum(tx) / len(tx) / 1e6:.2f} MB/rank"
    load = "" if row["other_load_cores"] is None else f", other load {row['other_load_cores']:.2f} cores"
    return (
        f"{row['network']} {row['strategy']}{period} world_size={row['world_size']}: val_acc {row['val_acc']:.4f}, "
        f"{row['comm_bytes_per_rank'] / 1e6:.2f} MB/rank logged{kernel}, loop {row['wall_s']:.2f} s "
        f"(cpu {row['loop_cpu_s']:.2f} s/rank; whole run {row['process_wall_s']:.1f} s{load})"
    )


def launch(run: SuiteRun, network: str, net: Any, spec: dict[str, Any], rate: str) -> dict[str, Any]:
    """Launch ``spec`` on ``network`` (``net``); return its row."""
    ws, emulated = spec["world_size"], network == "emulated"
    got = run.launcher.run("lightning_pdist.bench.worker", spec, ws, net, kernel_hosts=ws if emulated else 0)
    detail = run.doc["networks"][network]["detail"]
    if not emulated:
        return build_row(spec, got.results, network, detail, got)
    return build_row(spec, got.results, network, detail, got, rate=rate, kernel_tx=[tx for _, tx in got.kernel])


def result_name(config: SuiteConfig) -> str:
    """The JSON's file name: ``averaging.json``, or ``averaging_overhead.json`` for ``--overhead only`` (so that the
    overhead row alone never overwrites a whole suite's figures)."""
    return f"{SUITE}_overhead.json" if config.overhead == "only" else f"{SUITE}.json"


def run_overhead(config: SuiteConfig, out_dir: Path, log: Callable[[str], None] = print, steps: int | None = None,
                 repeats: int | None = None, warmup_steps: int | None = None) -> dict[str, Any]:  # fmt: skip
    """The overhead row (:mod:`lightning_pdist.bench.overhead`): one loopback launch of the smallest world size.

    Returns ``{"spec", "rows", "wall_s", "other_load_cores"}``; ``steps``, ``repeats`` and ``warmup_steps`` override
    the timed steps per fit, the repeats and the untimed steps (tests).
    """
    spec = overhead_bench.overhead_spec(world_size=min(config.world_sizes), seed=config.seed,
                                        repeats=repeats or overhead_bench.OVERHEAD["repeats"])  # fmt: skip
    if steps is not None:
        spec["steps"] = {k: steps for k in spec["steps"]}
    if warmup_steps is not None:
        spec["warmup_steps"] = warmup_steps

    got = Launcher(SUITE, out_dir, config.timeout).run("lightning_pdist.bench.overhead", spec, spec["world_size"],
                                                     files=[("overhead", spec["world_size"])])  # fmt: skip
    rows = overhead_bench.overhead_rows(got.results)
    for row in rows:
        log(f"overhead, width {row['width']}: ddp {row['ddp_ms_per_step']:.3f} ms/step, pdist_ddp "
            f"{row['pdist_ddp_ms_per_step']:.3f} ms/step, ratio {row['ratio']:.3f} (20th percentiles "
            f"{row['ratio_p20']:.3f}, CPU time {row['ratio_cpu']:.3f}; ddp against itself {row['control_ratio']:.3f}; "
            f"by repeat {row['ratio_by_repeat']})")
    return {"spec": spec, "rows": rows, "wall_s": round(got.wall_s, 1), "other_load_cores": got.other_load_cores}


def merge_repeats(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One row for repeated runs of a spec on a network: the fastest run's row, plus every run's times.

    The minimum is the figure least disturbed by other work on the machine. Accuracy and logged
    bytes do not depend on timing; ``repeats_agree`` says whether they came out equal in every run.

    Raises:
        ValueError: ``rows`` is empty.
    """
    if not rows:
        raise ValueError("merge_repeats(rows=[]): need at least one run")
    best = dict(min(rows, key=lambda r: r["wall_s"]))
    best["repeats"] = len(rows)
    best["wall_s_repeats"] = [r["wall_s"] for r in rows]
    best["other_load_cores_repeats"] = [r["other_load_cores"] for r in rows]
    best["repeats_agree"] = len({(r["val_acc"], r["comm_bytes_per_rank"]) for r in rows}) == 1
    return best


def run_suite(config: SuiteConfig, out: Path, command: str, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every planned spec on every requested network; write ``out/averaging.{json,png}``; return the document.

    Each spec runs on the networks back to back (loopback, then emulated), so a change in the
    machine's background load between runs affects both networks' figures alike; with
    ``repeats > 1`` each row keeps the fastest run (:func:`merge_repeats`).
    """
    only = config.overhead == "only"
    with SuiteRun(SUITE, config, out, command, log) as run:
        doc, nets = run.doc, {}
        if config.overhead != "no":
            doc["overhead"] = run_overhead(config, run.scratch / "overhead", log)
        if "loopback" in config.networks or only:
            nets["loopback"] = run.loopback()
        if "emulated" in config.networks and not only:  # built once, for the largest world size
            if (net := run.emulated("emulated", max(config.world_sizes), config.rate)) is not None:
                nets["emulated"] = net
        specs = plan_runs(config) if not only else []
        total, done = len(specs) * len(nets) * config.repeats, 0
        for spec in specs:
            for network, net in nets.items():
                repeats = []
                for _ in range(config.repeats):
                    done += 1
                    repeats.append(launch(run, network, net, spec, config.rate))
                    log(f"[{done}/{total}] {_describe(repeats[-1])}")
                doc["rows"].append(merge_repeats(repeats))
    doc["rows"].sort(key=lambda r: NETWORKS.index(r["network"]))  # stable: plan order within a network
    doc["comm_check"] = comm_check(doc["rows"])
    doc["suite_wall_s"] = round(time.perf_counter() - run.started, 1)
    check_rows(doc["rows"], ROW_KEYS, "averaging")
    write_json(doc, run.out / result_name(config))
    if doc["rows"]:
        plot(doc["rows"], run.out / f"{SUITE}.png", title=_plot_title(doc))
    return doc


# -- output -------------------------------------------------------------------------------------

TABLE_COLUMNS = (
    ("network", "network", None),
    ("strategy", "strategy", None),
    ("ranks", "world_size", None),
    ("period", "period", None),
    ("val_acc", "val_acc", ".4f"),
    ("comm MB/rank", "comm_bytes_per_rank", lambda b: f"{b / 1e6:.2f}"),
    ("loop s", "wall_s", ".2f"),
    ("ms/step", "step_ms", ".1f"),
    ("loop cpu s/rank", "loop_cpu_s", ".2f"),
    ("run s", "process_wall_s", ".1f"),
    ("other load", "other_load_cores", ".2f"),
    ("kernel tx MB/rank", "kernel_tx_bytes_per_rank", lambda t: f"{sum(t) / len(t) / 1e6:.2f}"),
    ("tx/logged", "kernel_tx_ratio", ".3f"),
)
CHECK_COLUMNS = (
    ("strategy", "strategy", None),
    ("ranks", "world_size", None),
    ("period", "period", None),
    ("logged MB/rank", "logged_bytes_per_rank", lambda b: f"{b / 1e6:.3f}"),
    ("kernel tx MB/rank", "kernel_tx_bytes_per_rank", lambda b: f"{b / 1e6:.3f}"),
    ("ratio", "ratio", ".3f"),
    ("set-up kB (rank 0, 1..)", "setup_tx_bytes_by_rank", lambda xs: " / ".join(f"{x / 1e3:.0f}" for x in xs)),
    ("loop kB", "loop_tx_bytes_per_rank", lambda b: f"{b / 1e3:.0f}"),
    ("wind-down kB", "wind_down_tx_bytes_per_rank", lambda b: f"{b / 1e3:.0f}"),
    ("Lightning B/step", "lightning_loop_bytes_per_step", ".0f"),
    ("loop net ratio", "loop_net_ratio", ".3f"),
    ("overhead B/packet", "loop_overhead_bytes_per_packet", ".1f"),
)


OVERHEAD_COLUMNS = (
    ("model", "width", lambda w: f"SmallCNN(width={w})"),
    ("params", "model_params", ",d"),
    ("ddp ms/step", "ddp_ms_per_step", ".3f"),
    ("pdist_ddp ms/step", "pdist_ddp_ms_per_step", ".3f"),
    ("pdist_ddp / ddp (median of repeats)", "ratio", ".3f"),
    ("ratios by repeat (min–max)", "ratio_by_repeat", lambda rs: f"{min(rs):.3f}–{max(rs):.3f}"),
    ("same, 20th percentiles", "ratio_p20", ".3f"),
    ("same, CPU time", "ratio_cpu", ".3f"),
    ("control: ddp / ddp", "control_ratio", ".3f"),
)


def overhead_lines(over: dict[str, Any]) -> list[str]:
    """The overhead row as markdown: what ran, then :func:`overhead_table` (``over`` is ``doc["overhead"]``)."""
    spec = over["spec"]
    steps = ", ".join(f"{s} steps at width {w}" for w, s in spec["steps"].items())
    return [f"Overhead, `pdist_ddp` against Lightning's `ddp` (loopback, {spec['world_size']} ranks, both at their "
            f"defaults, digits CNN, {spec['batch_size']} per rank per step; {spec['repeats']} repeats of {steps}, "
            f"interleaved in the same processes, the first {spec['warmup_steps']} steps untimed; {over['wall_s']} s):",
            "", overhead_table(over["rows"])]  # fmt: skip


def overhead_table(rows: Sequence[dict[str, Any]]) -> str:
    """The overhead rows as a markdown table (per width: each strategy's median step time and the ratio)."""
    return markdown_table(rows, OVERHEAD_COLUMNS)


def results_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a markdown table (network, strategy, ranks, period, accuracy, bytes, times, kernel)."""
    return markdown_table(rows, TABLE_COLUMNS)


def check_table(checks: Sequence[dict[str, Any]]) -> str:
    """The kernel-vs-logged byte check as a markdown table."""
    return markdown_table(checks, CHECK_COLUMNS)


def _load_note(row: dict[str, Any], ref: dict[str, Any]) -> str:
    loads = (row.get("other_load_cores"), ref.get("other_load_cores"))
    if any(x is None for x in loads):
        return ""
    return f" (other processes used {loads[0]:.2f} / {loads[1]:.2f} cores during the two runs)"


def summary_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """One line per run comparing it with DDP on the same network and world size (bytes, loop time, accuracy)."""
    ddp = {(r["network"], r["world_size"]): r for r in rows if r["strategy"] == "pdist_ddp"}
    lines = []
    for row in rows:
        ref = ddp.get((row["network"], row["world_size"]))
        if ref is None or row is ref or not row["comm_bytes_per_rank"]:
            continue
        lines.append(
            f"- {row['network']}, {run_label(row)}: {ref['comm_bytes_per_rank'] / row['comm_bytes_per_rank']:.1f}x "
            f"fewer bytes than DDP, training loop {row['wall_s'] / ref['wall_s']:.2f}x DDP's time, "
            f"val_acc {row['val_acc'] - ref['val_acc']:+.4f} against DDP's"
            + _load_note(row, ref)
        )
    return lines


QUOTED_KEYS = (*ROW_KEYS, "rate", "train_steps", "samples", "kernel_tx_bytes_per_rank", "kernel_tx_ratio",
               "replicas_agree", "other_load_cores")  # fmt: skip


def docs_section(doc: dict[str, Any], json_path: str) -> str:
    """The figures of a suite document as markdown for docs/benchmarks.md: provenance, tables, quoted rows.

    Everything here is read from ``doc``; ``json_path`` only names where the file was written.
    """
    host = doc["host"]
    nets = "\n".join(network_lines(doc, named=False))
    first = doc["rows"][0] if doc["rows"] else {}
    lines = [
        f"Command: `{doc['command']}`  ",
        f"Run: {doc['created']}, {doc['suite_wall_s']} s for the whole suite, on {host['cpus']} CPUs "
        f"(1-min load average {host['loadavg_1m_at_start']} at the start), torch {host['torch']}, "
        f"lightning {host['lightning']}.  ",
        f"Model {first.get('model')} ({first.get('model_params'):,} parameters), {first.get('samples'):,} training "
        f"samples per run ({first.get('batch_size_per_rank')} per rank per step), seed {first.get('seed')}; "
        f"val_acc on {first.get('val_samples')} held-out digits.  " if first else "",
        f"Output: `{json_path}`",
        "",
        "Networks:",
        "",
        nets,
        "",
        results_table(doc["rows"]),
    ]
    if doc.get("overhead"):
        lines += ["", *overhead_lines(doc["overhead"])]
    if doc.get("comm_check"):
        lines += ["", "Kernel `tx_bytes` against logged bytes (emulated links, per rank, mean over ranks):", "",
                  check_table(doc["comm_check"])]  # fmt: skip
    if summary := summary_lines(doc["rows"]):
        lines += ["", "Against DDP (same network and ranks; computed from the rows):", "", *summary]
    quoted = [{k: row.get(k) for k in QUOTED_KEYS} for row in doc["rows"]]
    lines += [
        "",
        "<details><summary>rows as written to the JSON (selected keys)</summary>",
        "",
        "```json",
        "\n".join(json.dumps(q) for q in quoted),
        "```",
        "",
        "</details>",
    ]
    return "\n".join(lines)


def _plot_title(doc: dict[str, Any]) -> str:
    nets = [v.get("detail", f"{k} skipped") for k, v in doc["networks"].items()]
    return f"averaging suite, {doc['created']}\n" + "; ".join(nets)


_MARKERS = {"pdist_ddp": "s", "local_sgd": "o", "bmuf": "^", "easgd": "D", "simuparallel_sgd": "*"}
_STRATEGY_COLORS = {
    "pdist_ddp": "tab:gray", "local_sgd": "tab:blue", "bmuf": "tab:green", "easgd": "tab:orange",
    "simuparallel_sgd": "tab:purple",
}  # fmt: skip
_NETWORK_COLORS = {"loopback": "tab:blue", "emulated": "tab:red"}


def run_label(row: dict[str, Any]) -> str:
    """``local_sgd p=8 n=2``-style label of a run (period omitted for the one-shot average)."""
    period = "" if row["period"] is None else f" p={row['period']}"
    return f"{row['strategy']}{period} n={row['world_size']}"


def plot(rows: Sequence[dict[str, Any]], path: str | Path, title: str = "averaging suite") -> Path:
    """Write the suite's figure: accuracy vs bytes per rank (left), training-loop time per run (right).

    Left, one marker per run, coloured and shaped by strategy: filled for loopback, a ring for
    emulated links (accuracy and bytes do not depend on the network, so the ring sits around the
    dot); runs that land on the same point share one label. Right, one bar per run and network.

    Raises:
        ValueError: ``rows`` is empty or a row lacks a required key.
    """
    if not rows:
        raise ValueError("averaging.plot(rows=[]): there is nothing to plot; rows must hold at least one run")
    check_rows(rows, ROW_KEYS, "averaging.plot")
    labels = list(dict.fromkeys(run_label(r) for r in rows))
    networks = list(dict.fromkeys(r["network"] for r in rows))
    fig, (ax_acc, ax_time) = subplots(1, 2, figsize=(14, max(4.8, 0.32 * len(labels) + 2.5)))

    points: dict[tuple[float, float], list[str]] = {}
    seen = set()
    for row in rows:
        x, y = max(row["comm_bytes_per_rank"], 1) / 1e6, row["val_acc"]
        color = _STRATEGY_COLORS.get(row["strategy"], "black")
        loopback = row["network"] == "loopback"
        ax_acc.scatter(
            x, y,
            marker=_MARKERS.get(row["strategy"], "x"),
            s=70 if loopback else 260,
            facecolors=color if loopback else "none",
            edgecolors=color,
            linewidths=1.0 if loopback else 1.5,
            label=row["strategy"] if row["strategy"] not in seen else None,
            zorder=3 if loopback else 2,
        )  # fmt: skip
        seen.add(row["strategy"])
        names = points.setdefault((x, y), [])
        if run_label(row) not in names:
            names.append(run_label(row))
    for (x, y), names in points.items():
        ax_acc.annotate("\n".join(names), (x, y), textcoords="offset points", xytext=(9, -4), fontsize=7, va="top")
    ax_acc.set_xscale("log")
    ax_acc.set_xlabel("bytes sent per rank in training (MB, log scale, as logged by the strategy)")
    ax_acc.set_ylabel("validation accuracy of the final model")
    ax_acc.set_title("filled: loopback; ring: emulated links", fontsize=8)
    ax_acc.grid(True, which="both", alpha=0.3)
    ax_acc.margins(x=0.25, y=0.15)
    ax_acc.legend(fontsize=7, loc="lower left")

    height = 0.8 / len(networks)
    for k, network in enumerate(networks):
        by_label = {run_label(r): r["wall_s"] for r in rows if r["network"] == network}
        ys = [i + k * height for i, lab in enumerate(labels) if lab in by_label]
        ax_time.barh(ys, [by_label[lab] for lab in labels if lab in by_label], height=height,
                     color=_NETWORK_COLORS.get(network, "tab:gray"), label=network)  # fmt: skip
    ax_time.set_yticks([i + 0.4 - height / 2 for i in range(len(labels))], labels, fontsize=8)
    ax_time.invert_yaxis()
    ax_time.set_xlabel("training loop wall time (s, slowest rank; same samples for every run)")
    ax_time.grid(True, axis="x", alpha=0.3)
    ax_time.legend(fontsize=8)
    return save_figure(fig, path, title=title)


# -- command line -------------------------------------------------------------------------------

CLI = SuiteCli(config=SuiteConfig, quick=QUICK, full=FULL, out="averaging.json and averaging.png",
               either={"networks": NETWORKS},
               parsers={"overhead": Literal["yes", "no", "only"]})  # fmt: skip


def run(config: SuiteConfig, out: Path, argv: Sequence[str]) -> int:
    """Run the suite (``argv`` is recorded as the command); print the tables."""
    doc = run_suite(config, out, command_line(SUITE, argv))
    print()
    if doc["rows"]:
        print(results_table(doc["rows"]))
    if doc.get("overhead"):
        print()
        print("pdist_ddp against Lightning's ddp, loopback:")
        print(overhead_table(doc["overhead"]["rows"]))
    if doc["comm_check"]:
        print()
        print("kernel tx_bytes vs logged bytes (emulated links):")
        print(check_table(doc["comm_check"]))
    written = [Path(out) / result_name(config)] + ([Path(out) / f"{SUITE}.png"] if doc["rows"] else [])
    print(f"\nwrote {' and '.join(str(w) for w in written)}", end="")
    print(f" in {doc['suite_wall_s']} s")
    if not doc["rows"] and not doc.get("overhead"):
        print("averaging: no run was possible on the requested network(s)", file=sys.stderr)
        return 1
    return 0
