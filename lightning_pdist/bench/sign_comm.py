"""Part B of the sign suite: bytes and time per step of DDP comm hooks, on loopback and on emulated links.

Every run is ``world_size`` real processes (:mod:`lightning_pdist.bench.sign_worker`) running
plain DDP on gloo with one hook of :data:`~lightning_pdist.bench.sign_worker.HOOKS`. On an emulated
network each rank sits in its own namespace behind a ``tbf``-shaped veth
(:class:`~lightning_pdist.bench.netns.EmulatedNetwork`), one network per rate, built once and
reused by all its runs; the kernel's ``tx_bytes`` of each veth during the timed steps is set
against the logged bytes. Loopback rows carry no kernel figure (``lo`` is shared by all ranks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_pdist.bench.launch import SuiteRun
from lightning_pdist.bench.sign_worker import HOOKS, check_spec

def comm_plan(config: Any) -> list[dict[str, Any]]:
    """The worker specs of ``config`` (a :class:`~lightning_pdist.bench.sign.SuiteConfig`), world size by hook."""
    specs = []
    for ws in config.world_sizes:
        for hook in config.hooks:
            spec = {"hook": hook, "world_size": ws, "warmup_steps": config.warmup_steps, "steps": config.steps,
                    "batch_size": config.batch_size, "in_features": config.in_features, "hidden": config.comm_hidden,
                    "seed": 0, "powersgd_rank": config.powersgd_rank, "it_warmup_rounds": 2}  # fmt: skip
            specs.append(check_spec(spec))
    return specs


def network_key(network: str, rate: str | None) -> str:
    """``"loopback"`` or ``"emulated 100mbit"``: the key of a network in the document and in speedups."""
    return network if rate is None else f"{network} {rate}"


def build_comm_row(
    spec: dict[str, Any],
    ranks: Sequence[dict[str, Any]],
    network: str,
    rate: str | None,
    detail: str,
    other_load_cores: float | None = None,
) -> dict[str, Any]:
    """One JSON row from a run's spec and its per-rank results.

    Raises:
        ValueError: the ranks do not match the spec's world size, or an emulated row lacks kernel counters.
    """
    ws, steps = spec["world_size"], spec["steps"]
    if len(ranks) != ws or [r["rank"] for r in ranks] != list(range(ws)):
        raise ValueError(f"build_comm_row(ranks=[{len(ranks)} results]): need one result per rank 0..{ws - 1}")
    tx = [r["tx_bytes"] for r in ranks]
    if network == "emulated" and any(t is None for t in tx):
        raise ValueError(f"build_comm_row(network='emulated'): every rank must report tx_bytes, got {tx}")
    logged = sum(r["logged_bytes"] for r in ranks) / ws / steps
    kernel = None if network != "emulated" else sum(tx) / ws / steps
    kinds = {
        k: round(sum(r["logged_by_kind"].get(k, 0) for r in ranks) / ws / steps) for k in ranks[0]["logged_by_kind"]
    }
    return {
        "hook": spec["hook"],
        "world_size": ws,
        "network": network,
        "rate": rate,
        "network_detail": detail,
        "params": ranks[0]["params"],
        "bytes_per_rank_per_step": round(logged),
        "kernel_tx_bytes_per_rank_per_step": None if kernel is None else round(kernel),
        "kernel_tx_ratio": None if kernel is None or not logged else round(kernel / logged, 4),
        "kernel_tx_packets_per_rank_per_step": (
            None if kernel is None else round(sum(r["tx_packets"] for r in ranks) / ws / steps, 1)
        ),
        "ms_per_step": round(max(r["ms_per_step"] for r in ranks), 2),
        "compute_ms_per_step": round(sum(r["compute_ms_per_step"] for r in ranks) / ws, 2),
        "loop_cpu_s_per_rank": round(sum(r["loop_cpu_s"] for r in ranks) / ws, 3),
        "steps": steps,
        "warmup_steps": spec["warmup_steps"],
        "batch_size_per_rank": spec["batch_size"],
        "bytes_source": ranks[0]["bytes_source"],
        "logged_by_kind_per_step": kinds,
        "other_load_cores": other_load_cores,
        "speedup_vs_fp32": None,
    }


def add_speedups(rows: list[dict[str, Any]]) -> None:
    """Set every row's ``speedup_vs_fp32`` (fp32 all-reduce's ms/step over the row's, same network, rate and ranks)."""
    ref = {(r["network"], r["rate"], r["world_size"]): r for r in rows if r["hook"] == "fp32_allreduce"}
    for row in rows:
        base = ref.get((row["network"], row["rate"], row["world_size"]))
        row["speedup_vs_fp32"] = round(base["ms_per_step"] / row["ms_per_step"], 3) if base else None


def run_comm(config: Any, run: SuiteRun) -> list[dict[str, Any]]:
    """Run Part B: every spec on loopback and on each emulated rate requested (recorded in ``run.doc``); the rows.

    Without root/iproute2 the emulated part is recorded as skipped with the reason; loopback rows
    are never relabelled as network figures.
    """
    specs = comm_plan(config)
    rows: list[dict[str, Any]] = []
    total = len(specs) * (("loopback" in config.networks) + len(config.rates) * ("emulated" in config.networks))
    for name, net, rate in run.networks(config.networks, config.rates, max(config.world_sizes)):
        network, detail = name.split(" ")[0], run.doc["networks"]["loopback"]["detail"] if rate is None else net.describe()
        for spec in specs:
            got = run.launcher.run("lightning_pdist.bench.sign_worker", spec, spec["world_size"], net)
            row = build_comm_row(spec, got.results, network, rate, detail, got.other_load_cores)
            rows.append(row)
            kernel = row["kernel_tx_bytes_per_rank_per_step"]
            run.log(f"[B {len(rows)}/{total}] {name} {spec['hook']} n={spec['world_size']}: "
                    f"{row['ms_per_step']:.1f} ms/step, {row['bytes_per_rank_per_step'] / 1e6:.3f} MB/rank/step logged"
                    + ("" if kernel is None else f", kernel tx {kernel / 1e6:.3f} MB "
                       f"({row['kernel_tx_ratio']:.3f}x)"))  # fmt: skip
    add_speedups(rows)
    return rows


def check_failures(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Rows whose kernel bytes are far from the logged bytes (outside 0.9–1.2×): each named, for the report."""
    return [
        f"{network_key(r['network'], r['rate'])} {r['hook']} n={r['world_size']}: kernel/logged {r['kernel_tx_ratio']}"
        for r in rows
        if r["kernel_tx_ratio"] is not None and not 0.9 <= r["kernel_tx_ratio"] <= 1.2
    ]


__all__ = ["HOOKS", "add_speedups", "build_comm_row", "check_failures", "comm_plan", "network_key", "run_comm"]
