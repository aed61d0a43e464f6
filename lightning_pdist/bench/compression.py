"""Compression suite: our compressors against fp32 DDP and torch's fp16/PowerSGD DDP hooks, on the digits CNN.

``python -m lightning_pdist.bench compression [--quick] --out DIR [--network loopback|emulated|both]
[--rates 100mbit [1gbit ...]] [--world-size 2 [4 ...]] [--methods ...]`` trains every method
(:data:`~lightning_pdist.bench.compression_worker.METHODS`: ``ddp``, the peers ``fp16_hook`` and ``powersgd_hook``
(torch's hooks, in the same run), our ``topk``, ``dgc``, ``qsgd``, ``terngrad``, ``sign``, ``ef_sign``,
``bmuf_topk``, and ``local_only``, which communicates nothing in the loop) for the same samples from the same seed,
each rank a real process on gloo. One launch per network and world size runs every method in turn in the same
processes (:mod:`~lightning_pdist.bench.compression_worker`). It writes ``DIR/compression.json`` (one row per
network, world size and method), ``DIR/compression.png`` and ``DIR/docs_section.md``.

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
* ``val_acc``: the accuracy on the 359 held-out digits of the model ``fit`` leaves; ``time_to_ddp_acc_s``: the
  training time at which rank 0's model first reached DDP's final ``val_acc`` on the same network (evaluated every
  ``eval_every`` steps; ``None``: never within the run).

``doc["goals"]`` checks the issue's goals against the rows (:func:`goals`).
"""

from __future__ import annotations

import math
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

from lightning_pdist.bench.cli import SuiteCli, SuiteRules
from lightning_pdist.bench.compression_worker import BMUF_PERIOD, METHODS, PEERS
from lightning_pdist.bench.launch import Launcher, emulated_network
from lightning_pdist.bench.netns import LOOPBACK, parse_rate
from lightning_pdist.bench.report import (check_rows, finish_suite, markdown_table, network_lines, new_document,
                                          output_dir, run_documented_suite, run_lines)  # fmt: skip

SUITE = "compression"
NETWORKS = ("loopback", "emulated")
OURS = ("topk", "dgc", "qsgd", "terngrad", "sign", "ef_sign", "bmuf_topk")
ROW_KEYS = ("method", "network", "world_size", "bytes_per_step", "ms_per_step", "val_acc")
QUICK = {"rates": ("100mbit",), "world_sizes": (2,)}
FULL = {"rates": ("100mbit", "1gbit"), "world_sizes": (2, 4)}
MAX_WORLD_SIZE = 8


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
    methods: tuple[str, ...] = tuple(METHODS)
    """methods to run (local_only is the kernel check's baseline)"""
    samples: int = 6144
    """training samples per run, over all ranks"""
    batch_size: int = 32
    """per rank"""
    lr: float = 0.05
    """SGD learning rate"""
    momentum: float = 0.9
    """SGD momentum (0 for dgc, whose momentum correction replaces it)"""
    width: int = 64
    """SmallCNN width"""
    seed: int = 0
    """seed of weights and data"""
    eval_every: int = 8
    """steps between evaluations (time to accuracy)"""
    timeout: float = 900.0
    """seconds per launch (every method of one network)"""
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
        self.distinct("methods", tuple(METHODS))
        if "ddp" not in self.methods:
            raise self.bad("methods", self.methods, "must include ddp (every row is compared with it)")
        self.ints("batch_size", "width", "eval_every")
        self.ints("seed", low=0)
        self.positive("lr")
        if not 0 <= self.momentum < 1:
            raise self.bad("momentum", self.momentum, "must be in [0, 1)")
        self.positive("timeout", unit=" seconds")
        largest = max(self.world_sizes) * self.batch_size
        if not isinstance(self.samples, int) or self.samples < largest:
            raise self.bad("samples", self.samples, f"must be an int >= world_size * batch_size = {largest}")

    def steps(self, world_size: int) -> int:
        return self.samples // (world_size * self.batch_size)


def worker_spec(config: SuiteConfig, world_size: int) -> dict[str, Any]:
    """The spec of one launch: every method of ``config`` on ``world_size`` ranks."""
    return {"methods": list(config.methods), "world_size": world_size, "steps": config.steps(world_size),
            "batch_size": config.batch_size, "lr": config.lr, "momentum": config.momentum, "width": config.width,
            "seed": config.seed, "eval_every": config.eval_every}  # fmt: skip


# -- byte models --------------------------------------------------------------------------------


def model_bytes(method: str, shapes: Sequence[Sequence[int]], world_size: int, step: int) -> int:
    """Bytes one rank sends in optimizer step ``step`` (1-based) of ``method`` on a model of ``shapes`` (one DDP
    bucket: the digits CNN's 0.97 MB fits DDP's first 1 MiB bucket). Exact, or for top-k, DGC and QSGD the payload
    before its Zstandard code (raw int32 indices, raw int8 levels)."""
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
    if method in ("topk", "dgc"):
        ks = [keep_count(0.01 if method == "topk" else 0.001, d) for d in numels]
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


def exact_model(method: str) -> bool:
    """Whether :func:`model_bytes` is the exact count (not the uncoded payload)."""
    return method not in ("topk", "dgc", "qsgd", "bmuf_topk")


# -- rows ---------------------------------------------------------------------------------------


def build_rows(ranks: Sequence[dict[str, Any]], network: str, detail: str) -> list[dict[str, Any]]:
    """One row per method from the ranks' results of one launch (then :func:`compare` against DDP).

    Raises:
        ValueError: the ranks are not 0..N-1 in order, or their fits differ in methods.
    """
    ws = ranks[0]["world_size"]
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
        modeled = [model_bytes(method, shapes, ws, s) for s in range(1, steps + 1)]
        logged = sum(f["loop_comm_bytes"] for f in fits) / ws / steps
        peer = method in PEERS
        tx = [f["tx"] for f in fits]
        row = {
            "method": method, "what": METHODS[method], "network": network, "network_detail": detail,
            "world_size": ws, "train_steps": steps, "model_params": sum(math.prod(s) for s in shapes),
            "logged_bytes_per_step": None if peer else round(logged, 1),
            "model_bytes_per_step": round(sum(modeled) / steps, 1), "model_exact": exact_model(method),
            "bytes_per_step": round(sum(modeled) / steps if peer else logged, 1),
            "ms_per_step": round(1000 * max(f["train_s"] for f in fits) / steps, 2),
            "val_acc": round(fits[0]["val_acc"], 4),
            "replicas_agree": len({f["param_digest"] for f in fits}) == 1,
            "evals": fits[0]["evals"],
            "kernel_loop_tx_per_step": (round(sum(x["train_end"] - x["train_start"] for x in tx) / ws / steps, 1)
                                        if all(tx) else None),  # fmt: skip
        }  # fmt: skip
        if method in ("topk", "dgc") and not peer:
            row["coded_index_ratio"] = coded_index_ratio(method, shapes, ws, logged)
        rows.append(row)
    return rows


def coded_index_ratio(method: str, shapes: Sequence[Sequence[int]], world_size: int, logged_per_step: float) -> float:
    """The coded indices' bytes over raw int32 indices (``4k``), from the logged bytes per step of one bucket:
    payload = logged / (N − 1) − 16 (the length/flag header); indices = payload − 4 (prefix) − 4k (fp32 values)."""
    from lightning_pdist.compression.sparse import keep_count

    k = sum(keep_count(0.01 if method == "topk" else 0.001, math.prod(s)) for s in shapes)
    payload = logged_per_step / (world_size - 1) - 16
    return round((payload - 4 - 4 * k) / (4 * k), 4)


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fill each row's comparison with DDP and ``local_only`` of the same network and world size (in place)."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["network"], row["world_size"]), []).append(row)
    for group in groups.values():
        by = {r["method"]: r for r in group}
        ddp, base = by["ddp"], by.get("local_only")
        target = ddp["val_acc"]
        for row in group:
            row["compression"] = round(ddp["bytes_per_step"] / row["bytes_per_step"], 1) if row["bytes_per_step"] else None
            row["acc_vs_ddp"] = round(row["val_acc"] - target, 4)
            row["time_to_ddp_acc_s"] = next((t for _, t, acc in row["evals"] if acc >= target), None)
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
    """The issue's goals, each ``{"goal", "met", "measured"}`` (``met`` None where the rows cannot tell).

    ``slow``: the network of the 100 Mbit/s runs (None when it did not run).
    """
    out = []
    two = [r for r in rows if r["world_size"] == min(x["world_size"] for x in rows)]
    by = {(r["network"], r["method"]): r for r in two}
    dgc = [r for r in two if r["method"] == "dgc"]
    if dgc:
        r = dgc[0]
        met = r["compression"] >= 100 and r["acc_vs_ddp"] >= -0.005
        out.append({"goal": "DGC >= 100x smaller than fp32 DDP, final accuracy within 0.5 points of DDP (CNN)",
                    "met": met, "measured": f"DGC sends {r['compression']}x fewer bytes per step than DDP; val_acc "
                    f"{r['val_acc']:.4f} against DDP's {r['val_acc'] - r['acc_vs_ddp']:.4f} ({100 * r['acc_vs_ddp']:+.2f} points)"})  # fmt: skip
    if slow is not None and (slow, "ddp") in by:
        ours = [by[(slow, m)] for m in OURS if (slow, m) in by]
        reached = [r for r in ours if r["time_to_ddp_acc_s"] is not None]
        ddp, power = by[(slow, "ddp")], by.get((slow, "powersgd_hook"))
        if reached:
            best = min(reached, key=lambda r: r["time_to_ddp_acc_s"])
            speed = best["tta_speedup"] or 0.0
            beats = power is None or power["time_to_ddp_acc_s"] is None or best["time_to_ddp_acc_s"] < power["time_to_ddp_acc_s"]
            power_s = "never" if power is None or power["time_to_ddp_acc_s"] is None else f"{power['time_to_ddp_acc_s']:.2f} s"
            measured = (f"{best['method']} reached DDP's final val_acc {ddp['val_acc']:.4f} after {best['time_to_ddp_acc_s']:.2f} s "
                        f"of training, DDP after {ddp['time_to_ddp_acc_s']:.2f} s ({speed:.2f}x sooner), torch's PowerSGD hook "
                        f"{power_s}")  # fmt: skip
            met = speed >= 5 and beats
        else:
            measured, met = f"none of {', '.join(r['method'] for r in ours)} reached DDP's final val_acc {ddp['val_acc']:.4f}", False
        if (slow, "local_only") in by:  # no communication at all: the most any compressor can save per step
            free = by[(slow, "local_only")]["ms_per_step"]
            measured += (f"; a step without any communication (local_only) took {free:.1f} ms against DDP's "
                         f"{ddp['ms_per_step']:.1f} ms, so no compressor could be more than "
                         f"{ddp['ms_per_step'] / free:.2f}x faster per step here")  # fmt: skip
        out.append({"goal": "at 100 Mbit/s our best compressor reaches DDP's final accuracy >= 5x sooner than DDP "
                    "and sooner than torch's PowerSGD hook", "met": met, "measured": measured})  # fmt: skip
    topk = [r for r in two if r["method"] == "topk" and r.get("coded_index_ratio") is not None]
    if topk:
        ratio = topk[0]["coded_index_ratio"]
        out.append({"goal": "coded indices <= 60% of raw int32 indices at ratio 0.01", "met": ratio <= 0.6,
                    "measured": f"TopK(0.01): the coded indices take {100 * ratio:.1f}% of 4 B per index"})  # fmt: skip
    return out


# -- running ------------------------------------------------------------------------------------


def run_suite(config: SuiteConfig, out: Path, command: str, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every world size on every network (one launch each); write ``out/compression.{json,png}``."""
    out = output_dir(SUITE, out)
    doc = new_document(SUITE, command, asdict(config))
    started = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix="pdist-bench-"))
    launcher = Launcher(SUITE, scratch, config.timeout)
    slow = None
    networks = (["loopback"] if "loopback" in config.networks else []) + (
        list(config.rates) if "emulated" in config.networks else [])  # fmt: skip
    try:
        for name in networks:
            with ExitStack() as stack:
                if name == "loopback":
                    doc["networks"]["loopback"] = {"detail": "loopback: " + LOOPBACK.describe()}
                    net: Any = LOOPBACK
                else:  # one emulated network at a time, built for the largest world size
                    net = stack.enter_context(emulated_network(SUITE, doc, name, max(config.world_sizes), name, log))
                    if net is None:
                        continue
                    slow = name if parse_rate(name) == parse_rate("100mbit") else slow
                for ws in config.world_sizes:
                    got = launcher.run("lightning_pdist.bench.compression_worker", worker_spec(config, ws), ws, net)
                    rows = compare(build_rows(got.results, name, doc["networks"][name]["detail"]))
                    for row in rows:
                        row["other_load_cores"] = got.other_load_cores
                        log(f"{name} n={ws} {row['method']}: {row['bytes_per_step']:.0f} B/step, "
                            f"{row['ms_per_step']:.1f} ms/step, val_acc {row['val_acc']:.4f}")
                    doc["rows"] += rows
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    check_rows(doc["rows"], ROW_KEYS, SUITE)
    doc["goals"] = goals(doc["rows"], slow)
    doc["not_run"] = [NOT_RUN[0], onebit_adam_status()]
    return finish_suite(doc, out, SUITE, started, plot)


#: What the issue's benchmark names that this suite does not run, and why (DeepSpeed's line: :func:`onebit_adam_status`).
NOT_RUN = [
    "the Transformer LM: not in this suite; the digits CNN alone keeps one run within minutes on 2 shared cores",
]


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
    ("s to DDP's acc", "time_to_ddp_acc_s", ".2f"),
    ("× sooner", "tta_speedup", ".2f"),
    ("other load", "other_load_cores", ".2f"),
)


def results_table(rows: Sequence[dict[str, Any]]) -> str:
    return markdown_table(rows, TABLE_COLUMNS)


def goal_lines(doc: dict[str, Any]) -> list[str]:
    """The goals as markdown bullets: met / not met / not measured, with the measured figures."""
    verdict = {True: "met", False: "**not met**", None: "not measured"}
    return [f"- {g['goal']}: {verdict[g['met']]}. {g['measured']}." for g in doc.get("goals", [])]


def docs_section(doc: dict[str, Any], json_path: str) -> str:
    """The suite's section of docs/benchmarks.md, everything read from ``doc``."""
    first = doc["rows"][0] if doc["rows"] else {}
    lines = [*run_lines(doc, json_path), "",
             f"Model: digits CNN ({first.get('model_params', 0):,} parameters), {first.get('train_steps')} steps of "
             f"{doc['config']['batch_size']} per rank, SGD lr {doc['config']['lr']} momentum {doc['config']['momentum']} "
             f"(0 for dgc), seed {doc['config']['seed']}; evaluated every {doc['config']['eval_every']} steps.", "",
             "Networks:", "", *network_lines(doc, named=False, goodput="short"), "",
             results_table(doc["rows"]), "", "Goals (issue 20):", "", *goal_lines(doc)]  # fmt: skip
    if doc.get("not_run"):
        lines += ["", "Not in this run:", "", *[f"- {n}" for n in doc["not_run"]]]
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: str | Path) -> Path:
    """Accuracy against training time on the slowest network (left); ms per step per method and network (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lightning_pdist.bench.report import save_figure

    rows = doc["rows"]
    nets = list(dict.fromkeys(r["network"] for r in rows))
    slowest = min((n for n in nets if n != "loopback"), key=parse_rate, default=nets[0] if nets else None)
    fig, (ax_acc, ax_time) = plt.subplots(1, 2, figsize=(14, 5.5))
    for row in rows:
        if row["network"] == slowest and row["world_size"] == rows[0]["world_size"] and row["evals"]:
            ax_acc.plot([e[1] for e in row["evals"]], [e[2] for e in row["evals"]], marker=".",
                        label=row["method"], linestyle="--" if row["method"] in PEERS or row["method"] == "ddp" else "-")  # fmt: skip
    ax_acc.set_xlabel(f"training time (s, rank 0) on {slowest}")
    ax_acc.set_ylabel("validation accuracy")
    ax_acc.grid(True, alpha=0.3)
    ax_acc.legend(fontsize=7)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    height = 0.8 / max(1, len(nets))
    for k, net in enumerate(nets):
        by = {r["method"]: r["ms_per_step"] for r in rows if r["network"] == net and r["world_size"] == rows[0]["world_size"]}
        ax_time.barh([i + k * height for i, m in enumerate(methods) if m in by], [by[m] for m in methods if m in by],
                     height=height, label=net)  # fmt: skip
    ax_time.set_yticks([i + 0.4 - height / 2 for i in range(len(methods))], methods, fontsize=8)
    ax_time.invert_yaxis()
    ax_time.set_xlabel("ms per training step (slowest rank)")
    ax_time.grid(True, axis="x", alpha=0.3)
    ax_time.legend(fontsize=8)
    fig.suptitle(f"compression suite, {doc['created']}", fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path, dpi=110)


# -- command line -------------------------------------------------------------------------------

CLI = SuiteCli(config=SuiteConfig, quick=QUICK, full=FULL, out="compression.json and compression.png",
               either={"networks": NETWORKS})  # fmt: skip


def run(config: SuiteConfig, out: Path, argv: Sequence[str]) -> int:
    """Run the suite (``argv`` is recorded as the command); write and print its docs section."""
    return run_documented_suite(SUITE, config, out, argv, run_suite, docs_section)
