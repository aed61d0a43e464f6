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
"""

from __future__ import annotations

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
from lightning_pdist.bench.launch import SuiteRun
from lightning_pdist.bench.netns import parse_rate
from lightning_pdist.bench.report import (check_rows, documented_run, markdown_table, network_lines, run_lines,
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
FIRST_BUCKET_BYTES = 1 << 20  # DDP's first gradient bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)


def lm_params(width: int, layers: int, context: int) -> int:
    """Parameters of the LM: embeddings ``(256 + context)·w``, per block ``12w² + 13w``, final norm, head ``256w + 256``."""
    return (256 + context) * width + layers * (12 * width**2 + 13 * width) + 2 * width + 256 * width + 256


@dataclass(frozen=True)
class SuiteConfig(SuiteRules):
    """Everything that decides what the suite runs; validated on construction.

    Raises:
        ValueError: a value breaks its rule; the message names the option, the value and the rule.
    """

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
        self.positive("timeout", unit=" seconds")
        if not self.budget >= 0:
            raise self.bad("budget", self.budget, "must be >= 0 seconds (0: no limit)")
        largest = max(self.world_sizes) * self.batch_size
        if not isinstance(self.samples, int) or self.samples < largest:
            raise self.bad("samples", self.samples, f"must be an int >= world_size * batch_size = {largest}")

    def steps(self, world_size: int) -> int:
        return self.samples // (world_size * self.batch_size)

    def dgc_warmup_steps(self, world_size: int) -> int:
        """dgc_warmup's warm-up in steps (at least one per stage when the fraction is not 0)."""
        return 0 if not self.dgc_warmup else max(DGC_WARMUP_STAGES, round(self.dgc_warmup * self.steps(world_size)))


def worker_spec(config: SuiteConfig, world_size: int, model: str = "cnn") -> dict[str, Any]:
    """The spec of one launch: every method of ``config`` on ``world_size`` ranks, training ``model``."""
    lm = model == "lm"
    return {"model": model, "methods": list(config.methods), "world_size": world_size,
            "steps": config.steps(world_size), "batch_size": config.batch_size, "lr": config.lm_lr if lm else config.lr,
            "momentum": config.momentum, "width": config.lm_width if lm else config.width, "layers": config.lm_layers,
            "context": config.lm_context, "seed": config.seed, "eval_every": config.eval_every,
            "dgc_warmup_steps": config.dgc_warmup_steps(world_size)}  # fmt: skip


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


def goals(rows: Sequence[dict[str, Any]], slow: str | None) -> list[dict[str, Any]]:
    """The issue's goals, each ``{"goal", "met", "measured"}`` (``met`` None where the rows cannot tell), judged on the
    smallest world size: DGC's on the CNN (either DGC row), the time goal per model, the coded indices per model.

    ``slow``: the network of the 100 Mbit/s runs (None when it did not run).
    """
    out: list[dict[str, Any]] = []
    if not rows:
        return out
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
        met = any(r["compression"] >= 100 and r["acc_vs_ddp"] >= -0.005 for r in variants)
        out.append({"goal": "DGC >= 100x smaller than fp32 DDP, final accuracy within 0.5 points of DDP (CNN)",
                    "met": met, "measured": "; ".join(parts)})  # fmt: skip
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
    return out


# -- running ------------------------------------------------------------------------------------


def run_suite(config: SuiteConfig, out: Path, command: str, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every model at every world size on every network (one launch each; a failed launch becomes a line of
    ``doc["not_run"]``); write ``out/compression.{json,png}`` (the JSON also after each launch, as far as it got)."""
    slow, failed, last = None, [], {}
    with SuiteRun(SUITE, config, out, command, log) as run:
        doc = run.doc
        # one emulated network at a time, built for the largest world size
        for name, net, rate in run.networks(config.networks, config.rates, max(config.world_sizes), key="{rate}"):
            slow = rate if rate and parse_rate(rate) == parse_rate("100mbit") else slow
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
                write_json(doc, run.out / f"{SUITE}.json")
    check_rows(doc["rows"], ROW_KEYS, SUITE)
    doc["goals"] = goals(doc["rows"], slow)
    doc["not_run"] = [*failed, onebit_adam_status()]
    return run.finish(plot)


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


def goal_lines(doc: dict[str, Any]) -> list[str]:
    """The goals as markdown bullets: met / not met / not measured, with the measured figures."""
    verdict = {True: "met", False: "**not met**", None: "not measured"}
    return [f"- {g['goal']}: {verdict[g['met']]}. {g['measured']}." for g in doc.get("goals", [])]


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
    lines = [*run_lines(doc, json_path), "", "Networks:", "", *network_lines(doc, named=False, goodput="short")]
    if warm:
        lines += ["", f"dgc_warmup warms its sparsity up over the first {c['dgc_warmup']:.0%} of the steps in "
                  f"{DGC_WARMUP_STAGES} equal stages (density 0.001^((j+1)/5): 25.1 %, 6.3 %, 1.6 %, 0.4 %, then 0.1 %); "
                  f"{', '.join(sorted({r['what'] for r in warm}))}."]  # fmt: skip
    for model in dict.fromkeys(r.get("model", "cnn") for r in doc["rows"]):
        lines += ["", model_line(doc, model), "", results_table([r for r in doc["rows"] if r.get("model", "cnn") == model])]
    lines += ["", "Goals (issue 20):", "", *goal_lines(doc)]
    if doc.get("not_run"):
        lines += ["", "Not in this run:", "", *[f"- {n}" for n in doc["not_run"]]]
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: str | Path) -> Path:
    """Per model (one row of panels each): its target (CNN: val_acc, LM: val_loss) against training time on the
    slowest network (left); ms per step per method and network (right); at the smallest world size."""
    from lightning_pdist.bench.report import pyplot, save_figure

    plt = pyplot()

    rows = doc["rows"]
    models = list(dict.fromkeys(r.get("model", "cnn") for r in rows)) or ["cnn"]
    nets = list(dict.fromkeys(r["network"] for r in rows))
    slowest = min((n for n in nets if n != "loopback"), key=parse_rate, default=nets[0] if nets else None)
    small = min((r["world_size"] for r in rows), default=2)
    fig, axes = plt.subplots(len(models), 2, figsize=(14, 5.5 * len(models)), squeeze=False)
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
    fig.suptitle(f"compression suite, {doc['created']}", fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path, dpi=110)


# -- command line -------------------------------------------------------------------------------

CLI = SuiteCli(config=SuiteConfig, quick=QUICK, full=FULL, out="compression.json and compression.png",
               either={"networks": NETWORKS})  # fmt: skip

run = documented_run(SUITE, run_suite, docs_section)
