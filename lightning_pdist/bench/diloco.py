"""DiLoCo suite: our DiLoCo and Streaming DiLoCo against DDP and torchft's own DiLoCo, on loopback and slow links.

``python -m lightning_pdist.bench diloco [--quick] --out DIR [--network loopback|emulated|both]
[--rate 100mbit 1gbit]`` trains every run for the same steps on the same byte-level Transformer LM, text (the
standard library's ``*.py`` files), seed, per-rank batches and inner optimizer (AdamW), each rank a real process on
gloo (:mod:`lightning_pdist.bench.diloco_worker`), on loopback and/or one emulated network per ``--rate`` (each spec
on every network back to back), and writes ``DIR/diloco.json``, ``DIR/diloco.png`` (loss against bytes and against
wall time, :mod:`lightning_pdist.bench.diloco_curves`) and ``DIR/docs_section.md``. Runs: ``ddp`` (Lightning
Fabric's DDP, the synchronous baseline), our ``local_sgd`` and ``bmuf`` (the averaging family's Fabric twins:
model average, and Nesterov block momentum ``1 − 1/N``, every H steps) at the largest ``--sync-every`` H, our
``diloco`` at each H, our ``streaming_diloco`` at each ``--fragments`` P (τ = ``--overlap`` steps, fragments cut by
``--balance``, fp32 and ``--quantize``), and ``torchft_diloco`` (``torchft.local_sgd.DiLoCo`` with torchft's Manager, lighthouse and
``ProcessGroupGloo``; needs ``pip install 'lightning_pdist[ft]'``, else its row records the import error) at each
H, every DiLoCo with the outer step Nesterov SGD(lr 0.7, momentum 0.9).

Per row: bytes per rank per step three ways — ``model`` (the byte model below, from the parameter count and the
schedule), ``logged`` (our strategies' :class:`~lightning_pdist.core.accounting.CommMeter`) and ``kernel`` (the
``tx_bytes`` of each rank's emulated veth over the training loop: payload plus TCP/IP headers, ACKs and, for
torchft, its quorum/commit RPCs); peak bytes per rank in one step (one synchronization); step time (training
loop, slowest rank, over the steps); final validation loss (nats/byte) and next-byte accuracy of the model every
rank holds. Byte model, ``d`` parameters, ``n`` ranks, ring all-reduce ``AR(b) = 2(n−1)/n·b``, all-gather
``AG(b) = (n−1)·b``: DDP ``AR(4d)`` per step; DiLoCo and torchft's DiLoCo ``AR(4d)`` per ``H`` steps; Streaming
DiLoCo ``Σ_p AR(4 d_p)`` (fp32) or ``Σ_p AG(codes_p + 4·blocks_p)`` (int8: 1 byte, int4: ½ byte per value of
``d_p`` padded to blocks of 64) per ``H`` steps, the peak being the largest fragment's; local SGD and BMUF like
DiLoCo. Per row also (:mod:`~lightning_pdist.bench.diloco_curves`): the loss curve (rank-mean training loss, trailing
mean of 20 steps) against the cumulative model bytes and the slowest rank's wall time, the step, seconds and bytes
at which it first comes within 2% of DDP's final value on the same network with as many ranks, and the peak kernel
bytes per second (the most one rank's link sent in one step, over that step's duration; emulated links only).

``--rounds R`` runs every spec ``R`` times, all specs in turn per round (in reverse order every other round: ours,
torchft's, torchft's, ours, ...), so that the runs compared sample the same stretches of the machine's load; a row's
timings (ms/step, steps/s, loop seconds and CPU) are the medians of its rounds, each round's kept in
``round_steps_per_s``/``round_loop_cpu_s``, and the steps/s goal compares ours and torchft's round by round (the
median of the per-round ratios). ``--keep-from OLD.json`` keeps the rows of an earlier run of this suite that this run
does not make again (another world size, network or run; :func:`keep_rows`), so a short run can add rows to a long one.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from lightning_pdist.bench.cli import SuiteCli, SuiteRules
from lightning_pdist.bench.diloco_curves import SMOOTH, add_reach, curve_fields, plot
from lightning_pdist.bench.launch import SuiteRun
from lightning_pdist.bench.netns import parse_rate
from lightning_pdist.bench.report import (check_rows, documented_run, failed_lines, markdown_table, network_lines,
                                          refuse_other_settings, run_lines)  # fmt: skip

SUITE = "diloco"
NETWORKS = ("loopback", "emulated")
RUNS = ("ddp", "local_sgd", "bmuf", "diloco", "streaming_diloco", "torchft_diloco")
EACH_H = ("diloco", "torchft_diloco")  # run at each H; local SGD and BMUF at the largest
ROW_KEYS = ("label", "strategy", "network", "world_size", "train_steps", "step_ms", "val_loss", "val_acc",
            "model_bytes_per_step", "peak_model_bytes")  # fmt: skip
QUICK = {"steps": 8, "sync_every": (4,), "fragments": (2,), "world_size": 2, "networks": NETWORKS, "rates": ("100mbit",)}
FULL = {"steps": 400, "sync_every": (10, 50, 100), "fragments": (2, 4), "world_size": 4, "networks": ("emulated",),
        "rates": ("100mbit", "1gbit")}  # fmt: skip
BLOCK = 64


@dataclass(frozen=True)
class SuiteConfig(SuiteRules):
    """Everything that decides what the suite runs; validated on construction (``ValueError`` names the option)."""

    networks: tuple[str, ...] = NETWORKS
    """loopback (127.0.0.1), emulated (netns + tbf links, needs root) or both"""
    rates: tuple[str, ...] = ("100mbit",)
    """emulated link rates each way, tc syntax: one emulated network per rate"""
    world_size: int = 2
    """ranks (replicas) per run"""
    runs: tuple[str, ...] = RUNS
    """what to run, from ddp local_sgd bmuf diloco streaming_diloco torchft_diloco"""
    steps: int = 8
    """inner (optimizer) steps per run; a multiple of every H"""
    sync_every: tuple[int, ...] = (4,)
    """H, one or more (diloco and torchft_diloco run at each; local_sgd, bmuf and streaming at the largest)"""
    fragments: tuple[int, ...] = (2,)
    """Streaming DiLoCo's P, one or more (each must divide the largest H)"""
    overlap: int = 1
    """Streaming DiLoCo's overlap τ in steps (< H/P)"""
    quantize: str = "int4"
    """Streaming DiLoCo's quantized variant (int4 or int8), run beside fp32 at the largest P"""
    balance: str = "params"
    """how Streaming DiLoCo cuts its fragments: layers (equal layer counts) or params (equal parameter counts)"""
    batch_size: int = 16
    """windows per rank per step"""
    context: int = 64
    """bytes per window"""
    width: int = 64
    """Transformer width"""
    layers: int = 2
    """Transformer blocks"""
    lr: float = 2e-3
    """AdamW learning rate (inner optimizer of every run)"""
    text_bytes: int = 1 << 20
    """bytes of standard-library source read (the last 64 KiB held out)"""
    seed: int = 0
    """seed of weights and batches"""
    timeout: float = 300.0
    """seconds per run"""
    rounds: int = 1
    """runs of every spec, the specs in turn each round (reversed every other round); a row's timings are the medians
    of its rounds and the steps/s goal compares ours and torchft's round by round"""
    keep_from: str | None = None
    """a diloco.json whose rows this run does not make again (same network, ranks and run) are kept beside this
    run's (its command, date and load are recorded with them; its model, data and optimizer settings must match)"""
    quick: bool = True
    SUITE: ClassVar[str] = SUITE
    FLAGS: ClassVar[dict[str, str]] = {"networks": "--network", "rates": "--rate"}

    def __post_init__(self) -> None:
        if not self.networks or any(n not in NETWORKS for n in self.networks):
            raise self.bad("networks", self.networks, f"each network must be one of {NETWORKS}")
        self.distinct("rates")
        for rate in self.rates:
            parse_rate(rate)
        self.distinct("runs", RUNS)
        self.distinct("sync_every")
        self.distinct("fragments")
        self.ints("world_size", low=2)
        self.ints("rounds")
        self.ints("steps", "batch_size", "context", "width", "layers")
        self.ints("overlap", "seed", low=0)
        self.ints("text_bytes", low=1 << 17)
        self.positive("lr")
        self.positive("timeout", unit=" seconds")
        for h in self.sync_every:
            if isinstance(h, bool) or not isinstance(h, int) or h < 1 or self.steps % h:
                raise self.bad("sync_every", h, f"each H must be an int >= 1 dividing --steps={self.steps}")
        H = max(self.sync_every)
        for p in self.fragments:
            if isinstance(p, bool) or not isinstance(p, int) or p < 1 or H % p:
                raise self.bad("fragments", p, f"each P must be an int >= 1 dividing the largest H={H}")
            if self.overlap >= H // p:
                raise self.bad("overlap", self.overlap, f"must be < H/P = {H // p} for P={p}")
        if self.quantize not in ("int4", "int8"):
            raise self.bad("quantize", self.quantize, "must be int4 or int8")
        if self.balance not in ("layers", "params"):
            raise self.bad("balance", self.balance, "must be layers or params")
        self.earlier()


def plan_runs(config: SuiteConfig) -> list[dict[str, Any]]:
    """The worker specs: DDP; local SGD and BMUF at the largest H; DiLoCo and torchft's at each H; Streaming at the
    largest H, each P fp32, largest P quantized too."""
    common = {"world_size": config.world_size, "steps": config.steps, "batch_size": config.batch_size,
              "context": config.context, "width": config.width, "layers": config.layers, "lr": config.lr,
              "text_bytes": config.text_bytes, "seed": config.seed, "num_fragments": 1, "overlap_steps": 0,
              "quantize": None, "sync_every": None, "balance": config.balance}  # fmt: skip
    specs = []
    H = max(config.sync_every)
    for run in config.runs:
        if run == "ddp":
            specs.append({"strategy": "ddp", **common})
        elif run in EACH_H:
            specs += [{**common, "strategy": run, "sync_every": h} for h in config.sync_every]
        elif run in ("local_sgd", "bmuf"):
            specs.append({**common, "strategy": run, "sync_every": H})
        else:
            for p in config.fragments:
                specs.append({**common, "strategy": run, "sync_every": H, "num_fragments": p,
                              "overlap_steps": config.overlap})  # fmt: skip
            specs.append({**specs[-1], "quantize": config.quantize})
    return specs


def label(spec: dict[str, Any]) -> str:
    """``diloco H=100``, ``streaming_diloco H=100 P=2 τ=1 int4``, ``ddp``."""
    if spec["strategy"] == "ddp":
        return "ddp"
    text = f"{spec['strategy']} H={spec['sync_every']}"
    if spec["strategy"] == "streaming_diloco":
        text += f" P={spec['num_fragments']} τ={spec['overlap_steps']}"
    return text + (f" {spec['quantize']}" if spec.get("quantize") else "")


# -- the byte model -------------------------------------------------------------------------------


def all_reduce(nbytes: int, n: int) -> float:
    return 2 * (n - 1) / n * nbytes


def sync_bytes(numel: int, quantize: str | None, n: int) -> float:
    """Bytes one rank sends to average ``numel`` fp32 values: a ring all-reduce, or an all-gather of the codes."""
    if quantize is None:
        return all_reduce(4 * numel, n)
    blocks = -(-numel // BLOCK)
    codes = blocks * BLOCK if quantize == "int8" else blocks * BLOCK // 2
    return (n - 1) * (codes + 4 * blocks)


def byte_model(spec: dict[str, Any], params: int, fragments: Sequence[int] | None) -> tuple[float, float]:
    """``(bytes per rank per step, peak bytes per rank in one step)`` of ``spec``'s run (module docstring)."""
    n = spec["world_size"]
    if spec["strategy"] == "ddp":
        per = all_reduce(4 * params, n)
        return per, per
    parts = list(fragments or [params])
    each = [sync_bytes(d, spec["quantize"], n) for d in parts]
    return sum(each) / spec["sync_every"], max(each)


def step_bytes(spec: dict[str, Any], params: int, fragments: Sequence[int] | None) -> list[float]:
    """Bytes one rank sends at each step ``1..steps`` by the byte model: DDP every step; fragment ``p`` of ``P``
    (one for all but Streaming) after steps ``t`` with ``t mod H = p·H/P``."""
    n, steps = spec["world_size"], spec["steps"]
    if spec["strategy"] == "ddp":
        return [all_reduce(4 * params, n)] * steps
    parts, H = list(fragments or [params]), spec["sync_every"]
    each = [sync_bytes(d, spec["quantize"], n) for d in parts]
    return [sum(b for p, b in enumerate(each) if t % H == p * (H // len(parts))) for t in range(1, steps + 1)]


# -- rows ------------------------------------------------------------------------------------------


def build_row(spec: dict[str, Any], got: Any, network: str, rate: str | None) -> dict[str, Any]:
    """One JSON row from a launch (``got``: :class:`~lightning_pdist.bench.launch.Launched`)."""
    row: dict[str, Any] = {"label": label(spec), "strategy": spec["strategy"], "network": network, "rate": rate,
                           "world_size": spec["world_size"], "train_steps": spec["steps"],
                           "sync_every": spec["sync_every"], "num_fragments": spec["num_fragments"],
                           "overlap_steps": spec["overlap_steps"], "quantize": spec["quantize"],
                           "balance": spec["balance"] if spec["strategy"] == "streaming_diloco" else None,
                           "other_load_cores": got.other_load_cores, "process_wall_s": round(got.wall_s, 2)}  # fmt: skip
    if got.error:
        return {**row, "error": got.error, **{k: None for k in ROW_KEYS if k not in row}}
    ranks, steps = got.results, spec["steps"]
    first = ranks[0]
    model, peak = byte_model(spec, first["model_params"], first["fragment_numels"])
    logged = None if first["comm_bytes"] is None else sum(r["comm_bytes"] for r in ranks) / len(ranks) / steps
    kernel = None
    if all(r["loop_tx_bytes"] is not None for r in ranks):
        kernel = sum(r["loop_tx_bytes"] for r in ranks) / len(ranks) / steps
    loop = max(r["loop_s"] for r in ranks)
    row.update({
        "model_params": first["model_params"], "fragment_numels": first["fragment_numels"],
        "step_ms": round(1000 * loop / steps, 2), "steps_per_s": round(steps / loop, 2), "loop_s": round(loop, 3),
        "loop_cpu_s": round(sum(r["loop_cpu_s"] for r in ranks) / len(ranks), 3),
        "val_loss": round(first["val_loss"], 4), "val_acc": round(first["val_acc"], 4),
        "train_loss_last10": round(sum(r["train_loss_last"] for r in ranks) / len(ranks), 4),
        "replicas_agree": len({r["param_digest"] for r in ranks}) == 1,
        "model_bytes_per_step": round(model), "peak_model_bytes": round(peak),
        "logged_bytes_per_step": None if logged is None else round(logged),
        "peak_logged_bytes": None if first["step_bytes"] is None else max(max(r["step_bytes"]) for r in ranks),
        "kernel_bytes_per_step": None if kernel is None else round(kernel),
        "kernel_over_model": None if kernel is None or not model else round(kernel / model, 3),
        "text_bytes": first["text_bytes"], "text_sha": first["text_sha"], "error": None,
        **curve_fields(ranks, step_bytes(spec, first["model_params"], first["fragment_numels"])),
    })  # fmt: skip
    return row


def pooled_row(spec: dict[str, Any], rounds: Sequence[Any], network: str, rate: str | None) -> dict[str, Any]:
    """One row from a spec's launches on one network, one per round: the first round's row (bytes, losses and
    curves are the same in every round) with the timings replaced by the medians of the rounds, each round's kept."""
    rows = [build_row(spec, got, network, rate) for got in rounds]
    row = rows[0]
    if len(rows) == 1:
        return row
    failed = next((r for r in rows if r["error"]), None)
    if failed is not None:
        return {**failed, "rounds": len(rows)}
    loops = [r["loop_s"] for r in rows]
    loop, steps = statistics.median(loops), spec["steps"]
    loads = [r["other_load_cores"] for r in rows if r["other_load_cores"] is not None]
    row.update({
        "rounds": len(rows), "loop_s": round(loop, 3), "step_ms": round(1000 * loop / steps, 2),
        "steps_per_s": round(steps / loop, 2), "loop_cpu_s": round(statistics.median(r["loop_cpu_s"] for r in rows), 3),
        "other_load_cores": round(statistics.mean(loads), 2) if loads else None,
        "process_wall_s": round(sum(r["process_wall_s"] for r in rows), 2),
        "replicas_agree": all(r["replicas_agree"] for r in rows),
        "round_steps_per_s": [r["steps_per_s"] for r in rows], "round_loop_cpu_s": [r["loop_cpu_s"] for r in rows],
        "round_other_load_cores": [r["other_load_cores"] for r in rows],
        "round_val_loss": [r["val_loss"] for r in rows],
    })  # fmt: skip
    return row


def goals(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 21's benchmark goals, per network and world size, checked on the rows (``met`` is ``None`` where a row
    is missing)."""
    out = []
    for network, world_size in dict.fromkeys((r["network"], r["world_size"]) for r in rows):
        ok = [r for r in rows if r["network"] == network and r["world_size"] == world_size and not r["error"]]
        start = len(out)
        ddp = next((r for r in ok if r["strategy"] == "ddp"), None)
        ours = [r for r in ok if r["strategy"] == "diloco"]
        top = max(ours, key=lambda r: r["sync_every"], default=None)
        if ddp and top:
            loss_ratio = top["val_loss"] / ddp["val_loss"]
            fewer = ddp["model_bytes_per_step"] / top["model_bytes_per_step"]
            reach = "its training loss never came within 2% of DDP's final"
            if top.get("reach_step") and ddp.get("reach_model_bytes"):
                reach = (f"training loss within 2% of DDP's final at step {top['reach_step']} (DDP: "
                         f"{ddp['reach_step']}) with {ddp['reach_model_bytes'] / top['reach_model_bytes']:.0f}x fewer "
                         "bytes")  # fmt: skip
            out.append({"network": network, "goal": f"DiLoCo H={top['sync_every']} within 2% of DDP's val loss with "
                        ">= 50x fewer bytes", "measured": f"val loss {loss_ratio:.3f}x DDP's, {fewer:.0f}x fewer bytes; "
                        f"{reach}", "met": loss_ratio <= 1.02 and fewer >= 50})  # fmt: skip
        for s in (r for r in ok if r["strategy"] == "streaming_diloco" and not r["quantize"]):
            ref = next((r for r in ours if r["sync_every"] == s["sync_every"]), None)
            if ref:
                cut = ref["peak_model_bytes"] / s["peak_model_bytes"]
                loss_ratio = s["val_loss"] / ref["val_loss"]
                kernel = ""
                if ref.get("peak_kernel_bytes_per_s") and s.get("peak_kernel_bytes_per_s"):
                    kernel = f" (kernel peak B/s {ref['peak_kernel_bytes_per_s'] / s['peak_kernel_bytes_per_s']:.2f}x)"
                out.append({"network": network, "goal": f"{s['label']}: peak bytes >= {s['num_fragments']}x below "
                            "DiLoCo's at equal loss (within 2%)",
                            "measured": f"peak {cut:.2f}x lower{kernel}, loss {loss_ratio:.3f}x DiLoCo's",
                            "met": cut >= s["num_fragments"] and loss_ratio <= 1.02})  # fmt: skip
        for ft in (r for r in ok if r["strategy"] == "torchft_diloco"):
            ref = next((r for r in ours if r["sync_every"] == ft["sync_every"]), None)
            if ref:
                out.append({"network": network, "goal": f"ours >= torchft's DiLoCo in steps/s at H={ft['sync_every']}",
                            **steps_goal(ref, ft)})  # fmt: skip
        for goal in out[start:]:
            goal["world_size"] = world_size
    return out


def steps_goal(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """``measured`` and ``met`` of "ours >= torchft's in steps/s": with rounds on both rows, the median of the
    per-round ratios ours/theirs (each round's two runs were launched one after the other, under the same load)."""
    a, b = ours.get("round_steps_per_s"), theirs.get("round_steps_per_s")
    if not a or not b or len(a) != len(b):
        return {"measured": f"{ours['steps_per_s']} vs {theirs['steps_per_s']} steps/s",
                "met": ours["steps_per_s"] >= theirs["steps_per_s"]}  # fmt: skip
    ratios = [x / y for x, y in zip(a, b)]
    middle = statistics.median(ratios)
    return {"measured": f"{ours['steps_per_s']} vs {theirs['steps_per_s']} steps/s (medians of {len(a)} alternating "
            f"rounds); ours/torchft's per round {', '.join(f'{r:.2f}' for r in ratios)}: median {middle:.2f}; loop CPU "
            f"per rank {ours['loop_cpu_s']} vs {theirs['loop_cpu_s']} s", "met": middle >= 1.0,
            "round_ratios": [round(r, 3) for r in ratios], "median_ratio": round(middle, 3)}  # fmt: skip


#: The settings every row's figures depend on that a row does not record: a kept row must share them.
KEEP_SETTINGS = ("steps", "batch_size", "context", "width", "layers", "lr", "text_bytes", "seed", "balance")


def keep_rows(doc: dict[str, Any], old: dict[str, Any], config: SuiteConfig) -> None:
    """Add to ``doc`` (this run) the rows of ``old`` (an earlier diloco.json) that this run did not make again — same
    network, world size and label — and ``doc["kept"]``: how many, and the earlier run's command, date, host, wall
    time and networks (``doc["networks"]`` stays this run's). Rows are ordered loopback first, then by network, then by world size.

    Raises:
        ValueError: ``old`` is another suite's, or was run with other :data:`KEEP_SETTINGS` (its rows would be
            described by this run's text wrongly).
    """
    if old.get("suite") != SUITE:
        raise ValueError(f"{SUITE}(--keep-from={config.keep_from!r}): holds suite {old.get('suite')!r}, not {SUITE!r}")
    now = json.loads(json.dumps(doc["config"]))  # tuples as the file's lists
    refuse_other_settings(f"{SUITE}(--keep-from={config.keep_from!r})", old["config"], now, KEEP_SETTINGS, "rows")
    made = {(r["network"], r["world_size"], r["label"]) for r in doc["rows"]}
    kept = [r for r in old["rows"] if (r["network"], r["world_size"], r["label"]) not in made]
    # doc["networks"]: this run's only; old's rows may hold networks of a run old itself kept rows from
    names = list(dict.fromkeys([*doc["networks"], *old["networks"], *(r["network"] for r in old["rows"])]))
    rows = doc["rows"] + kept
    rows.sort(key=lambda r: (r["network"] != "loopback", names.index(r["network"]), r["world_size"]))
    doc["rows"] = rows
    doc["kept"] = {"rows": len(kept), "from_command": old["command"], "from_created": old["created"],
                   "from_host": old["host"], "from_suite_wall_s": old.get("suite_wall_s"),
                   "from_networks": old["networks"], "from_kept": old.get("kept")}  # fmt: skip


def run_suite(config: SuiteConfig, out: Path, command: str, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every planned spec on every requested network; write ``out/diloco.{json,png}``; return the document."""
    specs = plan_runs(config)
    with SuiteRun(SUITE, config, out, command, log) as run:
        doc, nets = run.doc, {}
        if "loopback" in config.networks:
            nets["loopback"] = (run.loopback(), None)
        for rate in config.rates if "emulated" in config.networks else ():  # one emulated network per rate, all up at once
            if (net := run.emulated(f"emulated {rate}", config.world_size, rate)) is not None:
                nets[f"emulated {rate}"] = (net, rate)
        launched: dict[tuple[int, str], list[Any]] = {}  # (spec, network) -> its launches, one per round
        for round_ in range(config.rounds):
            turn = list(enumerate(specs))
            for i, spec in turn if round_ % 2 == 0 else turn[::-1]:  # ours before torchft's, then after, ...
                for name, (net, rate) in nets.items():  # each spec on every network back to back
                    got = run.launcher.run("lightning_pdist.bench.diloco_worker", spec, config.world_size, net, errors=400)
                    launched.setdefault((i, name), []).append(got)
                    row = build_row(spec, got, name, rate)
                    log(f"[{i + 1}/{len(specs)}{f' round {round_ + 1}/{config.rounds}' if config.rounds > 1 else ''}] "
                        f"{name} {row['label']}: " + (row["error"] or
                        f"{row['step_ms']} ms/step, val_loss {row['val_loss']}, {row['model_bytes_per_step']} B/step "
                        f"model, logged {row['logged_bytes_per_step']}, kernel {row['kernel_bytes_per_step']}, "
                        f"{row['process_wall_s']} s"))  # fmt: skip
        for i, spec in enumerate(specs):
            for name, (_, rate) in nets.items():
                doc["rows"].append(pooled_row(spec, launched[(i, name)], name, rate))
    order = list(nets)
    doc["rows"].sort(key=lambda r: order.index(r["network"]) if r["network"] in order else len(order))
    check_rows(doc["rows"], ROW_KEYS, SUITE)
    add_reach(doc["rows"])
    if config.keep_from is not None:
        keep_rows(doc, json.loads(Path(config.keep_from).read_text()), config)
    doc["goals"] = goals(doc["rows"])
    return run.finish(plot)


# -- output ----------------------------------------------------------------------------------------

_kb = lambda b: "—" if b is None else f"{b / 1e3:.1f}"  # noqa: E731
_mb = lambda b: "—" if b is None else f"{b / 1e6:.2f}"  # noqa: E731
TABLE_COLUMNS = (
    ("network", "network", None),
    ("ranks", "world_size", None),
    ("run", "label", None),
    ("ms/step", "step_ms", ".1f"),
    ("steps/s", "steps_per_s", ".2f"),
    ("val loss", "val_loss", ".4f"),
    ("val acc", "val_acc", ".4f"),
    ("model kB/step", "model_bytes_per_step", _kb),
    ("logged kB/step", "logged_bytes_per_step", _kb),
    ("kernel kB/step", "kernel_bytes_per_step", _kb),
    ("kernel/model", "kernel_over_model", ".3f"),
    ("peak model kB", "peak_model_bytes", _kb),
    ("peak logged kB", "peak_logged_bytes", _kb),
    ("peak kernel kB/s", "peak_kernel_bytes_per_s", _kb),
    ("reach step", "reach_step", None),
    ("reach s", "reach_s", ".1f"),
    ("MB to reach", "reach_model_bytes", _mb),
    ("loop CPU s", "loop_cpu_s", ".2f"),
    ("other load", "other_load_cores", ".2f"),
    ("rounds", "rounds", None),
)
GOAL_COLUMNS = (("network", "network", None), ("ranks", "world_size", None), ("goal", "goal", None), ("measured", "measured", None),
                ("met", "met", lambda m: "—" if m is None else ("yes" if m else "no")))  # fmt: skip


def kept_lines(k: dict[str, Any], lead: str) -> list[str]:
    """Where kept rows came from (``doc["kept"]``), and where that run's own kept rows came from, and so on."""
    host = k["from_host"]
    lines = [f"{lead}: {k['rows']} rows (those this run did not make again) from `{k['from_command']}`, run "
             f"{k['from_created']}, {k['from_suite_wall_s']} s, on {host['cpus']} CPUs (1-min load average "
             f"{host['loadavg_1m_at_start']} at its start); its networks:", "",
             *network_lines({"networks": k["from_networks"]}, named=True)]  # fmt: skip
    if k.get("from_kept"):
        lines += ["", *kept_lines(k["from_kept"], "That run itself kept")]
    return lines


def docs_section(doc: dict[str, Any], json_path: str) -> str:
    """The suite's figures as markdown for docs/benchmarks.md (everything read from ``doc``)."""
    rows = [r for r in doc["rows"] if not r.get("error")]
    first = rows[0] if rows else {}
    cfg = doc["config"]
    streaming = {r["num_fragments"]: r["fragment_numels"] for r in rows if r["strategy"] == "streaming_diloco"}
    sizes = ", ".join(f"P={p}: {numels}" for p, numels in streaming.items())
    ranks = " and ".join(str(n) for n in sorted({r["world_size"] for r in doc["rows"]})) or str(cfg["world_size"])
    kept = kept_lines(doc["kept"], "Kept") if doc.get("kept") else []
    lines = [*run_lines(doc, json_path), *([""] + kept if kept else []), "",
             f"Model: byte-level Transformer LM, {cfg['layers']} blocks of width {cfg['width']}, "
             f"{first.get('model_params', 0):,} parameters; text: the first {cfg['text_bytes']:,} bytes of the Python "
             f"standard library's `*.py` files (sha256 {first.get('text_sha')}, last 65,536 held out); "
             f"{ranks} ranks × {cfg['batch_size']} windows of {cfg['context']} bytes per step, "
             f"{cfg['steps']} AdamW steps (lr {cfg['lr']}), seed {cfg['seed']}; every DiLoCo's outer step Nesterov SGD(0.7, "
             f"0.9); Streaming's fragments cut by {cfg['balance']}"
             + (f" ({sizes} parameters)" if sizes else "") + ".", "",
             f"\"reach\": the first step at which the run's training loss (mean of the ranks, trailing mean of {SMOOTH} "
             f"steps) is within 2% of DDP's final one on the same network with as many ranks, the seconds and the model "
             "bytes per rank sent by then; \"peak kernel kB/s\": the most one rank's link sent in one step over that step's duration; "
             "\"loop CPU s\": CPU seconds per rank over the training loop (mean of the ranks); \"other load\": cores other work "
             "kept busy during the launch; \"rounds\": the runs of a row, the specs in turn (reversed every other round), its "
             "timings the medians of its rounds (– : one run).",
             "", "Networks:", "", *network_lines(doc, named=True), "", markdown_table(doc["rows"], TABLE_COLUMNS)]
    lines += failed_lines(doc["rows"], lambda r: f"{r['network']} {r['label']}")
    if doc.get("goals"):
        lines += ["", "Issue 21's goals on these rows:", "", markdown_table(doc["goals"], GOAL_COLUMNS)]
    return "\n".join(lines)


CLI = SuiteCli(config=SuiteConfig, quick=QUICK, full=FULL, out="diloco.json, diloco.png and docs_section.md",
               either={"networks": NETWORKS})  # fmt: skip

run = documented_run(SUITE, run_suite, docs_section)
