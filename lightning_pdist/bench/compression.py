"""Compression suite: our compressors against fp32 DDP and torch's fp16/PowerSGD DDP hooks, on the digits CNN and a
byte-level Transformer LM.

``python -m lightning_pdist.bench compression [--quick] --out DIR [--network loopback|emulated|both]
[--rates 100mbit [1gbit ...]] [--world-size 2 [4 ...]] [--models cnn lm] [--methods ...]`` trains every method
(:data:`~lightning_pdist.bench.compression_worker.METHODS`: ``ddp``, the peers ``fp16_hook`` and ``powersgd_hook``
(torch's hooks, in the same run), our ``topk``, ``dgc`` (no warm-up), ``dgc_warmup`` (the paper's exponential
sparsity warm-up over the first ``--dgc-warmup`` of the steps), ``qsgd``, ``terngrad``, ``sign``, ``ef_sign``,
``bmuf_topk``, and ``local_only``, which communicates nothing in the loop) for the same samples from the same seed,
each rank a real process on gloo, on each model of ``--models``: ``cnn`` (the digits CNN) and ``lm`` (the DiLoCo
suite's byte-level Transformer LM on the standard library's source, :mod:`~lightning_pdist.bench.text_lm`). One
launch per network, world size and model runs every method in turn in the same processes
(:mod:`~lightning_pdist.bench.compression_worker`). It writes ``DIR/compression.json`` (one row per model, network,
world size and method), ``DIR/compression.png`` and ``DIR/docs_section.md``.

Per row:

* ``bytes_per_step``: what each rank sends per optimizer step, mean over ranks and steps: our strategies' own
  :class:`~lightning_pdist.core.accounting.CommMeter` count (``logged_bytes_per_step``); for torch's hooks, which
  nothing of ours counts, the byte model. ``model_bytes_per_step`` is the byte model (:func:`model_bytes`):
  exact where the payload's size does not depend on the data (DDP, fp16, PowerSGD, TernGrad, sign), the payload
  with raw int32 indices / raw int8 levels where a Zstandard code makes it data-dependent (top-k, DGC, QSGD).
* ``compression``: DDP's bytes per step over the row's.
* ``kernel_bytes_per_step`` (emulated links): the host's kernel ``tx_bytes`` in the training loop per step, less
  what ``local_only`` sent per step on the same network (Lightning's own per-step traffic); ``kernel_ratio`` is
  that over ``bytes_per_step`` (TCP/IP headers and ACKs make it > 1).
* ``ms_per_step``: training time (loop wall time minus the evaluations) per step, slowest rank.
* ``val_acc`` / ``val_loss``: the accuracy and mean cross-entropy of the model ``fit`` leaves on the 359 held-out
  digits (CNN), or the next-byte accuracy and nats per byte on the held-out windows (LM); ``time_to_ddp_acc_s``: the
  training time at which rank 0's model first reached DDP's final value of the row's ``target`` on the same network
  and model (``val_acc`` for the CNN, ``val_loss`` for the LM; evaluated every ``eval_every`` steps; ``None``: never
  within the run).

``doc["goals"]`` checks the issue's goals against the rows (:func:`goals`).

``--parts long`` (with or without ``main``) runs the **long part**, DGC's accuracy goal over more steps: the CNN on 2
ranks over loopback for ``--long-scale`` times the main launch's steps, ``--long-methods`` (``ddp topk dgc
dgc_warmup``), the same data order, so the main run's steps are its first and, for every method whose schedule does not
depend on the run's length (all but ``dgc_warmup``), its evaluation after step ``s`` is what a run of ``s`` steps ends
with. ``doc["long"]`` holds its rows (each with ``acc_at``: the accuracy and the points against DDP at the main run's
length and each doubling; ``within_from_step``), its own command, date, load and wall time; :func:`long_goal` judges
DGC's goal on it.

``--keep-from OLD.json`` (:mod:`~lightning_pdist.bench.compression_keep`) makes only the launches asked for and keeps
every other launch's rows from ``OLD.json`` with their provenance (``doc["kept"]``), and its long part unless this run
makes one; ``OLD.json`` made with other settings is refused before anything runs.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from lightning_pdist.bench.cli import SuiteCli, SuiteRules
from lightning_pdist.bench.compression_worker import (BMUF_PERIOD, DGC_RATIO, DGC_WARMUP_STAGES, LM_CLIP, METHODS, MODELS,
                                                      PEERS, TEXT_BYTES)  # fmt: skip
from lightning_pdist.bench.compression_keep import check_keep, keep_launches, kept_lines
from lightning_pdist.bench.launch import SuiteRun
from lightning_pdist.bench.netns import LOOPBACK, parse_rate
from lightning_pdist.bench.report import (check_rows, documented_run, goal_lines, host_info, markdown_table,
                                          network_lines, not_run_lines, run_lines, save_figure, subplots, utc_now,
                                          write_json)  # fmt: skip

SUITE = "compression"
NETWORKS = ("loopback", "emulated")
OURS = ("topk", "dgc", "dgc_warmup", "qsgd", "terngrad", "sign", "ef_sign", "bmuf_topk")
ROW_KEYS = ("model", "method", "network", "world_size", "bytes_per_step", "ms_per_step", "val_acc", "val_loss")
MODEL_NAMES = {"cnn": "CNN", "lm": "LM"}
#: What "reaching DDP" means per model: (row key, higher is better).
TARGET = {"cnn": ("val_acc", True), "lm": ("val_loss", False)}
QUICK = {"networks": NETWORKS, "rates": ("100mbit",), "world_sizes": (2,)}
FULL = {"networks": ("emulated",), "rates": ("100mbit", "1gbit"), "world_sizes": (2, 4)}
MAX_WORLD_SIZE = 8
PARTS = ("main", "long")
LONG_METHODS = ("ddp", "topk", "dgc", "dgc_warmup")
LONG_WORLD_SIZE = 2
#: "within 0.5 points of DDP": the goal's accuracy gap, as a fraction.
GAP = 0.005
FIRST_BUCKET_BYTES = 1 << 20  # DDP's first gradient bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)


def lm_params(width: int, layers: int, context: int) -> int:
    """Parameters of the LM: embeddings ``(256 + context)·w``, per block ``12w² + 13w``, final norm, head ``256w + 256``."""
    return (256 + context) * width + layers * (12 * width**2 + 13 * width) + 2 * width + 256 * width + 256


@dataclass(frozen=True)
class SuiteConfig(SuiteRules):
    """Everything that decides what the suite runs; validated on construction (``ValueError`` names the option)."""

    networks: tuple[str, ...] = NETWORKS
    """loopback (127.0.0.1), emulated (netns + tbf links at each of --rates, needs root) or both"""
    rates: tuple[str, ...] = QUICK["rates"]
    """emulated link rates each way, tc syntax, one network each"""
    world_sizes: tuple[int, ...] = QUICK["world_sizes"]
    """ranks per run, one or more"""
    models: tuple[str, ...] = MODELS
    """models to train: cnn (the digits CNN), lm (the byte-level Transformer LM on the standard library's source)"""
    methods: tuple[str, ...] = tuple(METHODS)
    """methods to run (local_only is the kernel check's baseline)"""
    samples: int = 6144
    """training samples per run, over all ranks (digits, or LM windows)"""
    batch_size: int = 32
    """per rank (digits, or LM windows)"""
    lr: float = 0.05
    """SGD learning rate of the CNN"""
    momentum: float = 0.9
    """SGD momentum of both models (0 for dgc and dgc_warmup, whose momentum correction replaces it)"""
    width: int = 64
    """SmallCNN width"""
    lm_lr: float = 0.2
    """SGD learning rate of the LM"""
    lm_width: int = 64
    """LM width (4 heads, feed-forward 4x width)"""
    lm_layers: int = 2
    """LM Transformer blocks"""
    lm_context: int = 64
    """LM window length in bytes"""
    dgc_warmup: float = 0.25
    """fraction of the steps over which dgc_warmup's sparsity warms up (4 stages: 0.75, 0.9375, 0.984, 0.996, then 0.999)"""
    seed: int = 0
    """seed of weights and data"""
    eval_every: int = 8
    """steps between evaluations (time to accuracy)"""
    timeout: float = 900.0
    """seconds per launch (every method of one model, network and world size)"""
    budget: float = 0.0
    """seconds the suite may take (0: no limit): a launch that would end past it, judged by the last launch of the
    same model, is skipped and listed under "not run"; launches go by network, then world size, then model"""
    parts: tuple[str, ...] = ("main",)
    """main: one launch per network, world size and model (the tables); long: DGC's accuracy goal over --long-scale
    times the steps (the CNN on 2 ranks over loopback, --long-methods)"""
    long_scale: int = 8
    """the long part trains this many times the steps of the main part's 2-rank CNN launch"""
    long_methods: tuple[str, ...] = LONG_METHODS
    """methods of the long part (ddp and at least one of dgc, dgc_warmup)"""
    keep_from: str | None = None
    """an earlier compression.json: the rows of its launches this run does not make (by network, world size and model)
    are kept with their provenance, and its long part unless this run has one (it must have the same settings)"""
    quick: bool = True
    SUITE: ClassVar[str] = SUITE
    FLAGS: ClassVar[dict[str, str]] = {"networks": "--network", "world_sizes": "--world-size"}

    def __post_init__(self) -> None:
        self.distinct("networks", NETWORKS)
        self.distinct("rates")
        for rate in self.rates:
            parse_rate(rate)  # raises with the rule
        self.distinct("world_sizes")
        for ws in self.world_sizes:
            if isinstance(ws, bool) or not isinstance(ws, int) or not 2 <= ws <= MAX_WORLD_SIZE:
                raise self.bad("world_sizes", ws, f"world_size must be an int in [2, {MAX_WORLD_SIZE}]")
        self.distinct("models", MODELS)
        self.distinct("methods", tuple(METHODS))
        if "ddp" not in self.methods:
            raise self.bad("methods", self.methods, "must include ddp (every row is compared with it)")
        self.ints("batch_size", "width", "eval_every", "lm_width", "lm_layers", "lm_context")
        if self.lm_width % 4:
            raise self.bad("lm_width", self.lm_width, "must be a multiple of 4 (the LM's attention heads)")
        self.ints("seed", low=0)
        self.positive("lr", "lm_lr")
        if not 0 <= self.dgc_warmup < 1:
            raise self.bad("dgc_warmup", self.dgc_warmup, "must be a fraction of the steps in [0, 1)")
        params = lm_params(self.lm_width, self.lm_layers, self.lm_context)
        if "lm" in self.models and 4 * params > FIRST_BUCKET_BYTES:
            raise self.bad("lm_width", self.lm_width, f"with --lm-layers={self.lm_layers} the LM has {params:,} parameters; "
                           f"the byte model needs its fp32 gradients in DDP's first bucket (<= {FIRST_BUCKET_BYTES:,} B)")  # fmt: skip
        if not 0 <= self.momentum < 1:
            raise self.bad("momentum", self.momentum, "must be in [0, 1)")
        self.distinct("parts", PARTS)
        self.ints("long_scale")
        self.distinct("long_methods", tuple(METHODS))
        if "ddp" not in self.long_methods or not {"dgc", "dgc_warmup"} & set(self.long_methods):
            raise self.bad("long_methods", self.long_methods, "must include ddp and dgc or dgc_warmup (the goal compares them)")
        self.earlier()
        self.positive("timeout", unit=" seconds")
        if not self.budget >= 0:
            raise self.bad("budget", self.budget, "must be >= 0 seconds (0: no limit)")
        largest = max(self.world_sizes) * self.batch_size
        if not isinstance(self.samples, int) or self.samples < largest:
            raise self.bad("samples", self.samples, f"must be an int >= world_size * batch_size = {largest}")

    def steps(self, world_size: int) -> int:
        return self.samples // (world_size * self.batch_size)

    def dgc_warmup_steps(self, world_size: int, scale: int = 1) -> int:
        """dgc_warmup's warm-up in steps of a run of ``scale`` times the steps (at least one per stage when the
        fraction is not 0)."""
        return 0 if not self.dgc_warmup else max(DGC_WARMUP_STAGES, round(self.dgc_warmup * scale * self.steps(world_size)))


def worker_spec(config: SuiteConfig, world_size: int, model: str = "cnn") -> dict[str, Any]:
    """The spec of one launch: every method of ``config`` on ``world_size`` ranks, training ``model``."""
    lm = model == "lm"
    return {"model": model, "methods": list(config.methods), "world_size": world_size,
            "steps": config.steps(world_size), "batch_size": config.batch_size, "lr": config.lm_lr if lm else config.lr,
            "momentum": config.momentum, "width": config.lm_width if lm else config.width, "layers": config.lm_layers,
            "context": config.lm_context, "seed": config.seed, "eval_every": config.eval_every,
            "dgc_warmup_steps": config.dgc_warmup_steps(world_size)}  # fmt: skip


def long_spec(config: SuiteConfig) -> dict[str, Any]:
    """The long part's launch: the CNN on :data:`LONG_WORLD_SIZE` ranks for ``--long-scale`` times the main launch's
    steps (the same data order: the main run's steps are its first), ``--long-methods``, the warm-up scaled too."""
    ws, scale = LONG_WORLD_SIZE, config.long_scale
    return {**worker_spec(config, ws, "cnn"), "methods": list(config.long_methods), "steps": scale * config.steps(ws),
            "dgc_warmup_steps": config.dgc_warmup_steps(ws, scale)}  # fmt: skip


# -- byte models --------------------------------------------------------------------------------


def model_bytes(method: str, shapes: Sequence[Sequence[int]], world_size: int, step: int, dgc_warmup_steps: int = 0) -> int:
    """Bytes one rank sends in optimizer step ``step`` (1-based) of ``method`` on a model of ``shapes`` (one DDP
    bucket: the digits CNN's 0.97 MB and the LM's 0.55 MB fit DDP's first 1 MiB bucket). Exact, or for top-k, DGC and
    QSGD the payload before its Zstandard code (raw int32 indices, raw int8 levels). ``dgc_warmup_steps``: the
    warm-up of ``dgc_warmup``."""
    from lightning_pdist.compression.exchange import gather_wire_bytes
    from lightning_pdist.compression.powersgd import powersgd_bytes
    from lightning_pdist.compression.sparse import keep_count
    from lightning_pdist.core.accounting import all_reduce_bytes

    numels = [math.prod(s) for s in shapes]
    p, t, n = sum(numels), len(numels), world_size
    flag = all_reduce_bytes(4 * n, n)  # the non-finite agreement of a step that all-reduces no gradient
    gathered = lambda body: gather_wire_bytes(body, n)  # noqa: E731
    if method == "ddp":
        return all_reduce_bytes(4 * p, n)
    if method == "fp16_hook":
        return all_reduce_bytes(2 * p, n)
    if method == "powersgd_hook":  # start_powerSGD_iter=2: steps 1-2 are a plain all-reduce
        return all_reduce_bytes(4 * p, n) if step <= 2 else powersgd_bytes([tuple(s) for s in shapes], 1, 2.0, n)
    if method in ("topk", "dgc", "dgc_warmup"):
        ks = [keep_count(density(method, step, dgc_warmup_steps), d) for d in numels]
        return gathered(4 + 8 * sum(ks))  # length prefix, raw int32 indices, fp32 values
    if method == "qsgd":
        return gathered(4 * t + 4 + p)  # scales, length prefix, int8 levels
    if method == "terngrad":
        return gathered(4 * t + math.ceil(2 * p / 8))
    if method in ("sign", "ef_sign"):
        return gathered(4 * t + math.ceil(p / 8))
    if method == "bmuf_topk":
        ks = [keep_count(0.01, d) for d in numels]
        return flag + (gathered(4 + 8 * sum(ks)) if step % BMUF_PERIOD == 0 else 0)
    if method == "local_only":
        return 0
    raise ValueError(f"model_bytes(method={method!r}): method must be one of {tuple(METHODS)}")


def density(method: str, step: int, dgc_warmup_steps: int = 0) -> float:
    """The fraction of entries top-k / DGC sends in step ``step`` (1-based)."""
    from lightning_pdist.compression.sparse import dgc_density

    if method == "topk":
        return 0.01
    return dgc_density(DGC_RATIO, step - 1, dgc_warmup_steps if method == "dgc_warmup" else 0, DGC_WARMUP_STAGES)


def exact_model(method: str) -> bool:
    """Whether :func:`model_bytes` is the exact count (not the uncoded payload)."""
    return method not in ("topk", "dgc", "dgc_warmup", "qsgd", "bmuf_topk")


# -- rows ---------------------------------------------------------------------------------------


def build_rows(ranks: Sequence[dict[str, Any]], network: str, detail: str) -> list[dict[str, Any]]:
    """One row per method from the ranks' results of one launch (then :func:`compare` against DDP).

    Raises:
        ValueError: the ranks are not 0..N-1 in order, or their fits differ in methods.
    """
    ws = ranks[0]["world_size"]
    spec = ranks[0].get("spec", {})
    model, warmup = spec.get("model", "cnn"), spec.get("dgc_warmup_steps", 0)
    if [r["rank"] for r in ranks] != list(range(ws)):
        raise ValueError(f"build_rows(ranks=[{len(ranks)} results]): need one result per rank 0..{ws - 1}, in order")
    methods = [f["method"] for f in ranks[0]["fits"]]
    if any([f["method"] for f in r["fits"]] != methods for r in ranks):
        raise ValueError("build_rows: the ranks ran different methods")
    rows = []
    for i, method in enumerate(methods):
        fits = [r["fits"][i] for r in ranks]
        steps = fits[0]["train_steps"]
        shapes = fits[0]["shapes"]
        modeled = [model_bytes(method, shapes, ws, s, warmup) for s in range(1, steps + 1)]
        logged = sum(f["loop_comm_bytes"] for f in fits) / ws / steps
        peer = method in PEERS
        tx = [f["tx"] for f in fits]
        row = {
            "model": model, "method": method, "what": METHODS[method].replace("=W", f"={warmup}"), "network": network,
            "network_detail": detail, "target": TARGET[model][0],
            "world_size": ws, "train_steps": steps, "model_params": sum(math.prod(s) for s in shapes),
            "logged_bytes_per_step": None if peer else round(logged, 1),
            "model_bytes_per_step": round(sum(modeled) / steps, 1), "model_exact": exact_model(method),
            "last_model_bytes_per_step": modeled[-1],
            "bytes_per_step": round(sum(modeled) / steps if peer else logged, 1),
            "ms_per_step": round(1000 * max(f["train_s"] for f in fits) / steps, 2),
            "val_acc": round(fits[0]["val_acc"], 4),
            "val_loss": None if fits[0].get("val_loss") is None else round(fits[0]["val_loss"], 4),
            "replicas_agree": len({f["param_digest"] for f in fits}) == 1,
            "evals": fits[0]["evals"],
            "kernel_loop_tx_per_step": (round(sum(x["train_end"] - x["train_start"] for x in tx) / ws / steps, 1)
                                        if all(tx) else None),  # fmt: skip
        }  # fmt: skip
        if method in ("topk", "dgc", "dgc_warmup"):
            row["coded_index_ratio"] = coded_index_ratio(method, shapes, ws, logged, steps, warmup)
        rows.append(row)
    return rows


def coded_index_ratio(method: str, shapes: Sequence[Sequence[int]], world_size: int, logged_per_step: float,
                      steps: int = 1, dgc_warmup_steps: int = 0) -> float:  # fmt: skip
    """The coded indices' bytes over raw int32 indices (``4k``), from the logged bytes per step of one bucket:
    payload = logged / (N − 1) − 16 (the length/flag header); indices = payload − 4 (prefix) − 4k (fp32 values),
    ``k`` the mean over the ``steps`` steps (DGC's warm-up changes it)."""
    from lightning_pdist.compression.sparse import keep_count

    numels = [math.prod(s) for s in shapes]
    k = sum(keep_count(density(method, t, dgc_warmup_steps), d) for t in range(1, steps + 1) for d in numels) / steps
    payload = logged_per_step / (world_size - 1) - 16
    return round((payload - 4 - 4 * k) / (4 * k), 4)


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fill each row's comparison with DDP and ``local_only`` of the same network and world size (in place)."""
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row.get("model", "cnn"), row["network"], row["world_size"]), []).append(row)
    for (model, _, _), group in groups.items():
        by = {r["method"]: r for r in group}
        ddp, base = by["ddp"], by.get("local_only")
        key, higher = TARGET[model]
        target = ddp[key]
        reached = (lambda v: v >= target) if higher else (lambda v: v <= target)  # noqa: E731
        for row in group:
            row["compression"] = round(ddp["bytes_per_step"] / row["bytes_per_step"], 1) if row["bytes_per_step"] else None
            row["acc_vs_ddp"] = round(row["val_acc"] - ddp["val_acc"], 4)
            row["loss_vs_ddp"] = None if row.get("val_loss") is None else round(row["val_loss"] - ddp["val_loss"], 4)
            value = 2 if higher else 3  # evals: [step, train_s, acc, loss]
            row["time_to_ddp_acc_s"] = next(  # at the rows' 4 decimals: DDP reaches its own final value
                (e[1] for e in row["evals"] if e[value] is not None and reached(round(e[value], 4))), None)
            kernel = row["kernel_loop_tx_per_step"]
            row["kernel_bytes_per_step"] = row["kernel_ratio"] = None
            if kernel is not None and base is not None and base["kernel_loop_tx_per_step"] is not None:
                net = kernel - base["kernel_loop_tx_per_step"]
                row["kernel_bytes_per_step"] = round(net, 1)
                row["kernel_ratio"] = round(net / row["bytes_per_step"], 3) if row["bytes_per_step"] else None
        ddp_tta = ddp["time_to_ddp_acc_s"]
        for row in group:
            tta = row["time_to_ddp_acc_s"]
            row["tta_speedup"] = round(ddp_tta / tta, 2) if tta and ddp_tta else None
    return rows


def goals(rows: Sequence[dict[str, Any]], slow: str | None, long: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The issue's goals, each ``{"goal", "met", "measured"}`` (``met`` None where the rows cannot tell), judged on the
    smallest world size: DGC's on the CNN (either DGC row), the time goal per model, the coded indices per model; then
    DGC's again on the long part's rows (``long``, :func:`long_goal`).

    ``slow``: the network of the 100 Mbit/s runs (None when it did not run).
    """
    out: list[dict[str, Any]] = []
    if not rows:
        return long_goal(long)
    small = min(x["world_size"] for x in rows)
    two = [r for r in rows if r["world_size"] == small]
    models = list(dict.fromkeys(r.get("model", "cnn") for r in two))
    dgc = [r for r in two if r.get("model", "cnn") == "cnn" and r["method"] in ("dgc", "dgc_warmup")]
    if dgc:
        variants = [r for r in dgc if r["network"] == dgc[0]["network"]]
        parts = []
        for r in variants:
            part = (f"{r['method']} sends {r['compression']}x fewer bytes per step than DDP; val_acc {r['val_acc']:.4f} "
                    f"against DDP's {r['val_acc'] - r['acc_vs_ddp']:.4f} ({100 * r['acc_vs_ddp']:+.2f} points)")  # fmt: skip
            if r["method"] == "dgc_warmup" and r.get("last_model_bytes_per_step"):
                ddp = r["bytes_per_step"] * r["compression"]
                part += f"; after its warm-up its uncoded payload is {ddp / r['last_model_bytes_per_step']:.0f}x smaller"
            parts.append(part)
        met = any(r["compression"] >= 100 and r["acc_vs_ddp"] >= -GAP for r in variants)
        out.append({"goal": f"{DGC_GOAL} (CNN, {variants[0]['train_steps']} steps on {small} ranks)", "met": met,
                    "measured": "; ".join(parts)})  # fmt: skip
    for model in models if slow is not None else ():
        by = {r["method"]: r for r in two if r["network"] == slow and r.get("model", "cnn") == model}
        if "ddp" not in by:
            continue
        key = TARGET[model][0]
        ours = [by[m] for m in OURS if m in by]
        reached = [r for r in ours if r["time_to_ddp_acc_s"] is not None]
        ddp, power = by["ddp"], by.get("powersgd_hook")
        if reached:
            best = min(reached, key=lambda r: r["time_to_ddp_acc_s"])
            speed = best["tta_speedup"] or 0.0
            beats = power is None or power["time_to_ddp_acc_s"] is None or best["time_to_ddp_acc_s"] < power["time_to_ddp_acc_s"]
            power_s = "never" if power is None or power["time_to_ddp_acc_s"] is None else f"{power['time_to_ddp_acc_s']:.2f} s"
            measured = (f"{best['method']} reached DDP's final {key} {ddp[key]:.4f} after {best['time_to_ddp_acc_s']:.2f} s "
                        f"of training, DDP after {ddp['time_to_ddp_acc_s']:.2f} s ({speed:.2f}x sooner), torch's PowerSGD hook "
                        f"{power_s}")  # fmt: skip
            met = speed >= 5 and beats
        else:
            measured, met = f"none of {', '.join(r['method'] for r in ours)} reached DDP's final {key} {ddp[key]:.4f}", False
        if "local_only" in by:  # no communication at all: the most any compressor can save per step
            free = by["local_only"]["ms_per_step"]
            measured += (f"; a step without any communication (local_only) took {free:.1f} ms against DDP's "
                         f"{ddp['ms_per_step']:.1f} ms, so no compressor could be more than "
                         f"{ddp['ms_per_step'] / free:.2f}x faster per step here")  # fmt: skip
        out.append({"goal": "at 100 Mbit/s our best compressor reaches DDP's final accuracy >= 5x sooner than DDP "
                    f"and sooner than torch's PowerSGD hook ({MODEL_NAMES[model]}{', by val_loss' if model == 'lm' else ''})", "met": met, "measured": measured})  # fmt: skip
    topk = [r for r in two if r["method"] == "topk" and r.get("coded_index_ratio") is not None]
    firsts = {r.get("model", "cnn"): r for r in reversed(topk)}  # the first network's row of each model
    if firsts:
        ratios = [(m, firsts[m]["coded_index_ratio"]) for m in models if m in firsts]
        out.append({"goal": "coded indices <= 60% of raw int32 indices at ratio 0.01", "met": all(x <= 0.6 for _, x in ratios),
                    "measured": "; ".join(f"TopK(0.01) on the {MODEL_NAMES[m]}: the coded indices take {100 * x:.1f}% of 4 B "
                                          "per index" for m, x in ratios)})  # fmt: skip
    return out + long_goal(long)


DGC_GOAL = "DGC >= 100x smaller than fp32 DDP, final accuracy within 0.5 points of DDP"


def long_goal(long: dict[str, Any] | None) -> list[dict[str, Any]]:
    """DGC's goal judged on the long part's rows (none without them): per DGC row its compression, its final accuracy
    against DDP's, its gap at the main run's length, and the step from which it stayed within 0.5 points."""
    by = {r["method"]: r for r in (long or {}).get("rows", [])}
    variants = [by[m] for m in ("dgc", "dgc_warmup") if m in by]
    if "ddp" not in by or not variants:
        return []
    ddp, steps, first = by["ddp"], by["ddp"]["train_steps"], long["config"]["main_steps"]
    parts = []
    for r in variants:
        early = next((a for a in r["acc_at"] if a[0] == first), None)
        since = (f"within 0.5 points of DDP at every evaluation from step {r['within_from_step']} on" if r["within_from_step"]
                 else "more than 0.5 points below DDP at its last evaluation")  # fmt: skip
        parts.append(f"{r['method']} sends {r['compression']}x fewer bytes per step than DDP; after {steps} steps val_acc "
                     f"{r['val_acc']:.4f} against DDP's {ddp['val_acc']:.4f} ({100 * r['acc_vs_ddp']:+.2f} points)"
                     + (f", after {first} steps {100 * early[2]:+.2f} points" if early and first != steps else "") + f"; {since}")  # fmt: skip
    met = any(r["compression"] >= 100 and r["acc_vs_ddp"] >= -GAP for r in variants)
    return [{"goal": f"{DGC_GOAL} (CNN, {steps} steps on {ddp['world_size']} ranks, the long part)", "met": met,
             "measured": "; ".join(parts)}]  # fmt: skip


def long_checkpoints(row: dict[str, Any], ddp: dict[str, Any], main_steps: int) -> dict[str, Any]:
    """``acc_at``: ``[step, val_acc, val_acc − DDP's at that step]`` at ``main_steps`` and each doubling of it, and at
    the last step (the evaluations at those steps: without a schedule that depends on the run's length, what a run of
    that many steps ends with; not so for dgc_warmup, whose warm-up is a fraction of the run); ``within_from_step``:
    the first evaluation step from which every later one is within 0.5 points of DDP's at the same step (None when the
    last one is not)."""
    theirs = {e[0]: round(e[2], 4) for e in ddp["evals"]}  # at the rows' 4 decimals, as "vs DDP"
    mine = [(e[0], round(e[2], 4), round(round(e[2], 4) - theirs[e[0]], 4)) for e in row["evals"] if e[0] in theirs]
    steps, marks = row["train_steps"], []
    while main_steps < steps:
        marks.append(main_steps)
        main_steps *= 2
    at = {s: (a, g) for s, a, g in mine}
    within = None
    for s, _, g in reversed(mine):
        if round(g, 6) < -GAP:
            break
        within = s
    return {"acc_at": [[s, at[s][0], at[s][1]] for s in [*marks, steps] if s in at],
            "within_from_step": within}


# -- running ------------------------------------------------------------------------------------


def run_suite(config: SuiteConfig, out: Path, command: str, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The main part: every model at every world size on every network (one launch each; a failed launch becomes a
    line of ``doc["not_run"]``); the long part (:func:`run_long`); with ``--keep-from`` the earlier run's other
    launches and long part (:func:`assemble`). Writes ``out/compression.{json,png}`` (the JSON also after each launch,
    as far as it got)."""
    old = None
    if config.keep_from is not None:  # refused before anything runs
        old = json.loads(Path(config.keep_from).read_text())
        check_keep(old, config, f"{SUITE}(--keep-from={config.keep_from!r})")
    failed, last = [], {}
    with SuiteRun(SUITE, config, out, command, log) as run:
        doc = run.doc
        # one emulated network at a time, built for the largest world size
        main = config.networks if "main" in config.parts else ()
        for name, net, _ in run.networks(main, config.rates, max(config.world_sizes), key="{rate}"):
            for ws, model in [(ws, model) for ws in config.world_sizes for model in config.models]:
                spent = time.perf_counter() - run.started
                if config.budget and spent + last.get(model, 0.0) > config.budget:
                    failed.append(f"{model} on {name}, {ws} ranks: skipped, the suite had run {spent:.0f} s and its last "
                                  f"{model} launch took {last[model]:.0f} s (--budget {config.budget:.0f} s)")  # fmt: skip
                    log(failed[-1])
                    continue
                spec = worker_spec(config, ws, model)
                got = run.launcher.run("lightning_pdist.bench.compression_worker", spec, ws, net, errors=400)
                last[model] = got.wall_s
                if got.error:
                    failed.append(f"{model} on {name}, {ws} ranks: the launch failed after {got.wall_s:.0f} s: {got.error}")
                    log(failed[-1])
                    continue
                rows = compare(build_rows(got.results, name, doc["networks"][name]["detail"]))
                for row in rows:
                    row["other_load_cores"] = got.other_load_cores
                    log(f"{model} {name} n={ws} {row['method']}: {row['bytes_per_step']:.0f} B/step, "
                        f"{row['ms_per_step']:.1f} ms/step, val_acc {row['val_acc']:.4f}, val_loss {row['val_loss']}")
                doc["rows"] += rows
                write_json(assemble(doc, old, failed), run.out / f"{SUITE}.json")
        if "long" in config.parts:
            doc["long"] = run_long(run, config, command, log)
            if doc["long"]["error"]:
                failed.append(f"long part: {doc['long']['error']}")
    doc.update(assemble(doc, old, [*failed, onebit_adam_status()]))
    return run.finish(plot)


def assemble(doc: dict[str, Any], old: dict[str, Any] | None, not_run: Sequence[str]) -> dict[str, Any]:
    """``doc`` with ``not_run``, the launches and long part kept from ``old`` (an earlier compression.json, or None;
    :func:`~lightning_pdist.bench.compression_keep.keep_launches`; its long part where this run made none, or its
    own failed) and the goals of the whole; a new dict (``doc`` itself unchanged)."""
    whole = {**doc, "rows": list(doc["rows"]), "networks": dict(doc["networks"]), "not_run": list(not_run)}
    if old is not None:
        keep_launches(whole, old)
        if old.get("long") and (not whole.get("long") or whole["long"]["error"]):
            whole["long"] = old["long"]
    check_rows(whole["rows"], ROW_KEYS, SUITE)
    slow = next((n for n, info in whole["networks"].items()
                 if info.get("rate") and parse_rate(info["rate"]) == parse_rate("100mbit")), None)  # fmt: skip
    whole["goals"] = goals(whole["rows"], slow, whole.get("long"))
    return whole


def run_long(run: SuiteRun, config: SuiteConfig, command: str, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The long part (:func:`long_spec`, over loopback: accuracy does not depend on the link): its rows, each with its
    accuracy at the main run's length and its doublings (:func:`long_checkpoints`), and its own command, date, load
    and wall time (a later ``--keep-from`` run keeps the part whole)."""
    spec = long_spec(config)
    cfg = {"scale": config.long_scale, "world_size": LONG_WORLD_SIZE, "main_steps": config.steps(LONG_WORLD_SIZE),
           "dgc_warmup": config.dgc_warmup, **{k: spec[k] for k in ("steps", "methods", "batch_size", "lr", "momentum",
                                                                    "width", "seed", "eval_every", "dgc_warmup_steps")}}  # fmt: skip
    part = {"command": command, "created": utc_now(), "host": host_info(), "network": "loopback: " + LOOPBACK.describe(),
            "config": cfg, "rows": [], "error": None}  # fmt: skip
    log(f"long part: {', '.join(spec['methods'])}, {spec['steps']} steps on {LONG_WORLD_SIZE} ranks, loopback")
    got = run.launcher.run("lightning_pdist.bench.compression_worker", spec, LONG_WORLD_SIZE, LOOPBACK, errors=400)
    part["wall_s"] = round(got.wall_s, 1)
    if got.error:
        part["error"] = f"the launch failed after {got.wall_s:.0f} s: {got.error}"
        return part
    rows = compare(build_rows(got.results, "loopback", part["network"]))
    ddp = next(r for r in rows if r["method"] == "ddp")
    for row in rows:
        row["other_load_cores"] = got.other_load_cores
        row.update(long_checkpoints(row, ddp, cfg["main_steps"]))
        log(f"long {row['method']}: val_acc {row['val_acc']:.4f} ({100 * row['acc_vs_ddp']:+.2f} points), "
            f"within 0.5 points from step {row['within_from_step']}, {row['compression']}x fewer bytes")
    part["rows"] = rows
    return part


def onebit_adam_status() -> str:
    """Why DeepSpeed's 1-bit Adam is not among the peers here: the exact error of importing it, or its backends."""
    try:
        import deepspeed
        from deepspeed.runtime.fp16.onebit.adam import OnebitAdam  # noqa: F401
    except Exception as err:  # ImportError, or DeepSpeed's own set-up errors on this machine
        version = getattr(sys.modules.get("deepspeed"), "__version__", "not installed")
        return (f"DeepSpeed 1-bit Adam: not run; `from deepspeed.runtime.fp16.onebit.adam import OnebitAdam` fails "
                f"here (deepspeed {version}): {type(err).__name__}: {err}")
    return (f"DeepSpeed 1-bit Adam: not run; deepspeed {deepspeed.__version__} has it, but its compressed all-reduce "
            "takes comm_backend_name 'nccl', 'mpi' or 'hccl', and this machine trains on gloo/CPU")


# -- output -------------------------------------------------------------------------------------

TABLE_COLUMNS = (
    ("network", "network", None),
    ("ranks", "world_size", None),
    ("method", "method", None),
    ("B/step", "bytes_per_step", ",.0f"),
    ("model B/step", "model_bytes_per_step", ",.0f"),
    ("model", "model_exact", lambda e: "exact" if e else "uncoded"),
    ("× smaller than DDP", "compression", ".1f"),
    ("kernel B/step", "kernel_bytes_per_step", ",.0f"),
    ("kernel/B", "kernel_ratio", ".3f"),
    ("ms/step", "ms_per_step", ".1f"),
    ("val_acc", "val_acc", ".4f"),
    ("vs DDP", "acc_vs_ddp", "+.4f"),
    ("val_loss", "val_loss", ".4f"),
    ("loss vs DDP", "loss_vs_ddp", "+.4f"),
    ("s to DDP's final", "time_to_ddp_acc_s", ".2f"),
    ("× sooner", "tta_speedup", ".2f"),
    ("other load", "other_load_cores", ".2f"),
)


def results_table(rows: Sequence[dict[str, Any]]) -> str:
    return markdown_table(rows, TABLE_COLUMNS)


def model_line(doc: dict[str, Any], model: str) -> str:
    """What ``model``'s runs trained, from the config and its first row."""
    c = doc["config"]
    first = next((r for r in doc["rows"] if r.get("model", "cnn") == model), {})
    params, steps = first.get("model_params", 0), first.get("train_steps")
    if model == "cnn":
        what = (f"**Digits CNN** (width {c['width']}, {params:,} parameters): {steps} steps of {c['batch_size']} digits "
                f"per rank, SGD lr {c['lr']}")  # fmt: skip
        target = "val_acc (accuracy on the 359 held-out digits)"
    else:
        what = (f"**Byte-level Transformer LM** (width {c['lm_width']}, {c['lm_layers']} blocks, {params:,} parameters) "
                f"on the standard library's source ({TEXT_BYTES:,} bytes, the last 65,536 held out): {steps} steps of "
                f"{c['batch_size']} windows of {c['lm_context']} bytes per rank, SGD lr {c['lm_lr']}, the aggregated "
                f"gradient clipped to norm {LM_CLIP}, a step with non-finite gradients skipped")  # fmt: skip
        target = "val_loss (nats per byte on 64 held-out windows; val_acc is the next byte's)"
    return (f"{what}, momentum {c['momentum']} (0 for dgc and dgc_warmup), seed {c['seed']}; evaluated every "
            f"{c['eval_every']} steps; \"s to DDP's final\" is the time to DDP's final {target}.")  # fmt: skip


def docs_section(doc: dict[str, Any], json_path: str) -> str:
    """The suite's section of docs/benchmarks.md, everything read from ``doc``: one table per model."""
    c = doc["config"]
    warm = [r for r in doc["rows"] if r["method"] == "dgc_warmup"]
    kept = kept_lines(doc)
    lines = [*run_lines(doc, json_path), *([""] + kept if kept else [])]
    if doc["networks"]:
        lines += ["", "Networks:", "", *network_lines(doc, named=False, goodput="short")]
    if warm:
        lines += ["", f"dgc_warmup warms its sparsity up over the first {c['dgc_warmup']:.0%} of the steps in "
                  f"{DGC_WARMUP_STAGES} equal stages (density 0.001^((j+1)/5): 25.1 %, 6.3 %, 1.6 %, 0.4 %, then 0.1 %); "
                  f"{', '.join(sorted({r['what'] for r in warm}))}."]  # fmt: skip
    for model in dict.fromkeys(r.get("model", "cnn") for r in doc["rows"]):
        lines += ["", model_line(doc, model), "", results_table([r for r in doc["rows"] if r.get("model", "cnn") == model])]
    if doc.get("long", {}).get("rows"):
        lines += ["", *long_section(doc["long"])]
    lines += ["", "Goals (issue 20):", "", *goal_lines(doc.get("goals", [])), *not_run_lines(doc)]
    return "\n".join(lines)


LONG_COLUMNS = (
    ("method", "method", None),
    ("steps", "train_steps", None),
    ("B/step", "bytes_per_step", ",.0f"),
    ("× smaller than DDP", "compression", ".1f"),
    ("val_acc", "val_acc", ".4f"),
    ("vs DDP", "acc_vs_ddp", "+.4f"),
    ("val_loss", "val_loss", ".4f"),
    ("within 0.5 points of DDP from step", "within_from_step", None),
    ("ms/step", "ms_per_step", ".1f"),
    ("other load", "other_load_cores", ".2f"),
)


def long_section(long: dict[str, Any]) -> list[str]:
    """The long part's lines: what it trained, its own command and run, a table with the accuracy at the main run's
    length and its doublings (val_acc, then the points against DDP at that step)."""
    c, host = long["config"], long["host"]
    marks = [a[0] for a in long["rows"][0]["acc_at"]]
    columns = (*LONG_COLUMNS[:2], *((f"val_acc at {m} (vs DDP)", f"at_{m}", None) for m in marks), *LONG_COLUMNS[2:])
    ddp = {s: a for s, a, _ in next((r["acc_at"] for r in long["rows"] if r["method"] == "ddp"), [])}
    shown = [{**r, **{f"at_{s}": f"{a:.4f} ({100 * (a - ddp.get(s, a - g)):+.2f})" for s, a, g in r["acc_at"]}}
             for r in long["rows"]]  # the points from the accuracies shown, as "vs DDP"
    warm = next((r["what"] for r in long["rows"] if r["method"] == "dgc_warmup"), None)
    return [f"**Long part** (DGC's accuracy goal): the digits CNN (width {c['width']}) for {c['steps']} steps of "
            f"{c['batch_size']} digits per rank ({c['scale']}× the main run's {c['main_steps']}) on {c['world_size']} ranks "
            f"over loopback (accuracy does not depend on the link), SGD lr {c['lr']}, momentum {c['momentum']} (0 for dgc "
            f"and dgc_warmup), seed {c['seed']}, evaluated every {c['eval_every']} steps"
            + (f"; dgc_warmup: {warm}" if warm else "") + ". The first steps are the main run's (same data order): "
            "\"val_acc at s\" is the evaluation after step s, which for every method but dgc_warmup (its warm-up is a "
            "fraction of the run) is what a run of s steps ends with.  ",
            f"Command: `{long['command']}`  ",
            f"Run: {long['created']}, {long['wall_s']} s for the launch, on {host['cpus']} CPUs (1-min load average "
            f"{host['loadavg_1m_at_start']} at its start), torch {host['torch']}; {long['network']}.", "",
            markdown_table(shown, columns)]  # fmt: skip


def plot(doc: dict[str, Any], path: str | Path) -> Path:
    """Per model (one row of panels each): its target (CNN: val_acc, LM: val_loss) against training time on the
    slowest network (left); ms per step per method and network (right); at the smallest world size. With a long part,
    a last row: its val_acc against the step (left), and each method's points against DDP's at the same step (right)."""
    rows = doc["rows"]
    long = (doc.get("long") or {}).get("rows") or []
    models = list(dict.fromkeys(r.get("model", "cnn") for r in rows)) or ([] if long else ["cnn"])
    nets = list(dict.fromkeys(r["network"] for r in rows))
    slowest = min((n for n in nets if n != "loopback"), key=parse_rate, default=nets[0] if nets else None)
    small = min((r["world_size"] for r in rows), default=2)
    fig, axes = subplots(len(models) + bool(long), 2, figsize=(14, 5.5 * (len(models) + bool(long))), squeeze=False)
    for (ax_acc, ax_time), model in zip(axes, models):
        mine = [r for r in rows if r.get("model", "cnn") == model and r["world_size"] == small]
        key, _ = TARGET[model]
        value = 2 if key == "val_acc" else 3
        for row in mine:
            points = [(e[1], e[value]) for e in row["evals"] if e[value] is not None]
            if row["network"] == slowest and points:
                ax_acc.plot(*zip(*points), marker=".", label=row["method"],
                            linestyle="--" if row["method"] in PEERS or row["method"] == "ddp" else "-")  # fmt: skip
        ax_acc.set_xlabel(f"training time (s, rank 0) on {slowest}, {small} ranks")
        ax_acc.set_ylabel(f"{MODEL_NAMES[model]} {key}")
        ax_acc.grid(True, alpha=0.3)
        ax_acc.legend(fontsize=7)
        methods = list(dict.fromkeys(r["method"] for r in mine))
        height = 0.8 / max(1, len(nets))
        for k, net in enumerate(nets):
            by = {r["method"]: r["ms_per_step"] for r in mine if r["network"] == net}
            ax_time.barh([i + k * height for i, m in enumerate(methods) if m in by], [by[m] for m in methods if m in by],
                         height=height, label=net)  # fmt: skip
        ax_time.set_yticks([i + 0.4 - height / 2 for i in range(len(methods))], methods, fontsize=8)
        ax_time.invert_yaxis()
        ax_time.set_xlabel(f"{MODEL_NAMES[model]}: ms per training step (slowest rank)")
        ax_time.grid(True, axis="x", alpha=0.3)
        ax_time.legend(fontsize=8)
    if long:
        ax_acc, ax_gap = axes[-1]
        ddp = {e[0]: e[2] for e in next(r for r in long if r["method"] == "ddp")["evals"]}
        for i, row in enumerate(long):
            ax_acc.plot([e[0] for e in row["evals"]], [e[2] for e in row["evals"]], label=row["method"], linewidth=1, color=f"C{i}")
            gaps = [(e[0], 100 * (e[2] - ddp[e[0]])) for e in row["evals"] if e[0] in ddp]
            if row["method"] != "ddp":
                ax_gap.plot(*zip(*gaps), label=row["method"], linewidth=1, color=f"C{i}")
        ax_gap.axhline(-100 * GAP, color="gray", linestyle=":")
        ax_gap.set_ylim(-10, 5)  # the goal's band; the first evaluations lie far below
        ax_acc.set_xlabel(f"step (long part, {long[0]['world_size']} ranks, loopback)")
        ax_acc.set_ylabel("CNN val_acc")
        ax_gap.set_xlabel("step")
        ax_gap.set_ylabel("val_acc − DDP's at the same step (points)")
        for ax in (ax_acc, ax_gap):
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    return save_figure(fig, path, title=f"compression suite, {doc['created']}")


# -- command line -------------------------------------------------------------------------------

CLI = SuiteCli(config=SuiteConfig, quick=QUICK, full=FULL, out="compression.json and compression.png",
               either={"networks": NETWORKS})  # fmt: skip

run = documented_run(SUITE, run_suite, docs_section)
