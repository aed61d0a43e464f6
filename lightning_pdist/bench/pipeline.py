"""Pipeline suite: our four schedules against torch.distributed.pipelining, DeepSpeed, fairscale and DDP.

``python -m lightning_pdist.bench pipeline [--quick] --out DIR [--parts throughput bubble stash convergence]
[--network loopback|emulated|both] [--rate 100mbit] [--stages 2 4]`` writes ``DIR/pipeline.json``,
``DIR/pipeline.png`` and ``DIR/docs_section.md``. Every row names the network it ran on.

1. **throughput** (``rows``): samples/s of one MLP (``depth`` × ``Linear(width, width)``, cut evenly), the same
   batch and micro-batches, ``warmup_steps`` untimed, the median of ``steps`` timed steps (the slowest stage's).
   Ours (``gpipe``, ``1f1b``, ``pipedream``, ``2bw``) is driven at the executor level, as torch's schedules are:
   no Lightning on either side; one extra row (``ours+lightning``) runs ``Trainer(strategy=PipelineStrategy)``
   to show Lightning's overhead, in the engines' processes after them (one launch per stage count). DeepSpeed
   runs in a launch of its own (its failure is recorded, never a number); fairscale's ``Pipe`` is **one process**
   (K ``'cpu'`` devices, one thread); DDP holds the whole model on every rank and splits the batch. With 4 stages, 4 processes share 2 cores (``oversubscribed``).
   ``ratios``: ours 1F1B over torch's ``Schedule1F1B`` from the same launch.
2. **bubble** (``bubble.rows``): mean over stages of (seconds blocked in ``recv``) / (step wall time), ours only,
   loopback, against ``(K-1)/(m+K-1)`` and :func:`~lightning_pdist.pipeline.schedule.validate`'s
   simulation (forward 1, backward 2): the whole program of ``steps`` batches, and its steady state (the makespan
   one more batch adds), which is what the timed steps see (the fill falls in the warm-up).
3. **stash** (``stash.rows``): per stage with ``stash_width``-wide layers (tens of MB): ``executor.max_versions``,
   the bytes ``weight_versions()`` counts at the same instants, and the process's RSS growth (VmHWM after −
   VmRSS before; glibc's mmap threshold is fixed so that freed tensors leave the RSS), against
   ``validate(...).stash_depth``. RSS growth also holds gradients and activations, so each variant is set
   against a baseline with the same update pattern and one version (2BW against 1F1B, PipeDream against
   PipeDream without stashing): the difference is the stash. The variants run in turn in one launch, each from
   the resident memory the one before left (its tensors freed and unmapped).
4. **convergence** (``convergence``): validation accuracy after every epoch against samples seen, through
   Lightning, per model: digits with ``ClassifierModule(model="cnn")``, and synthetic IMDB reviews with a small BERT
   cut by ``split_points`` (``"transformer"``). DDP (``PdistStrategy``: Lightning's DDP plus byte accounting, same
   global batch), ``gpipe``, ``pipedream`` with and without weight stashing, ``2bw``, and the delayed-gradient
   family: ``spectrain``, ``ddg``, ``features_replay``, DNI (``synthetic_gradients=True``) and cDNI (DNI with
   ``synthetic_conditioning="labels"``); every method the same
   SGD (lr and momentum: SpecTrain predicts from the momentum) and epochs; every run in turn in one launch.
5. **bytes** (``bytes.rows``): the convergence runs' training bytes per epoch (all ranks, from the ``CommMeter``;
   evaluation traffic apart) against survey 002's Table 1: pipelined SGD moves activations, ``O(N·T·M)``
   (2 directions × cuts × samples × activation bytes, plus a 128-byte header per message and one frame per shape change), data parallelism
   the model, ``O(N²·L·M)`` (per rank ``2(R-1)/R`` × model bytes per step). CNN runs only (the BERT's boundary
   is packed by :mod:`~lightning_pdist.pipeline.ownership`).
6. **bert** (``bert.rows``): samples/s of the BERT cut at one named block (``split_points``), ours (through
   Lightning: a module that is not one ``nn.Sequential`` pipelines only through the strategy) against torch's
   ``pipeline()`` traced at the same point (``ScheduleGPipe``/``Schedule1F1B`` at the executor level, as in part 1),
   same batches and micro-batches, loopback, both in one launch. A cut torch cannot trace or run is recorded in
   ``not_run`` with its error.

``--keep-from OLD.json`` keeps the parts of an earlier run that this one does not run (``doc["kept"]``), and, when
this run makes only some convergence runs (``--converge-models``, ``--methods``), the earlier run's other convergence
runs beside them (``doc["convergence"]["kept"]``: per earlier command its runs, command, date and load), so that the
part can be re-run in pieces of under 10 minutes, each keeping the one before.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from lightning_pdist.bench.cli import SuiteCli, SuiteRules
from lightning_pdist.bench.launch import Launcher, SuiteRun
from lightning_pdist.bench.netns import LOOPBACK, EmulatedNetwork, parse_rate
from lightning_pdist.bench.report import (check_rows, documented_run, kept_provenance, markdown_table, network_lines,
                                          not_run_lines, pyplot, refuse_other_settings, run_lines,
                                          save_figure)  # fmt: skip

SUITE = "pipeline"
PARTS = ("throughput", "bubble", "stash", "convergence", "bert")
NETWORKS = ("loopback", "emulated")
SCHEDULES = ("gpipe", "1f1b", "pipedream", "2bw")
ENGINES = ("ours_gpipe", "ours_1f1b", "ours_pipedream", "ours_2bw", "torch_gpipe", "torch_1f1b", "ddp", "deepspeed",
           "fairscale", "lightning", "ours_1f1b_ahead", "ours_1f1b_late")  # fmt: skip
#: ours' receives posted ahead (P2P(post_ahead=True)) or when needed (False, the default the plain names run)
POST_AHEAD = {"ahead": True, "late": False}
DEFAULT_ENGINES = tuple(e for e in ENGINES if e.rpartition("_")[2] not in POST_AHEAD)  # the A/B only when asked
METHODS = ("ddp", "gpipe", "pipedream", "pipedream_nostash", "2bw", "spectrain", "ddg", "features_replay", "dni", "cdni")  # convergence runs
CONVERGE_MODELS = ("cnn", "transformer")
STASH_VARIANTS = ("1f1b", "2bw", "pipedream", "pipedream_nostash")
BASELINE = {"1f1b": "1f1b", "2bw": "1f1b", "pipedream": "pipedream_nostash", "pipedream_nostash": "pipedream_nostash"}
ROW_KEYS = ("engine", "schedule", "stages", "processes", "network", "samples_per_s", "median_step_s", "error")
BACKWARD_COST = 2.0  # a Linear layer's backward is two matmuls to the forward's one
QUICK = {"width": 512, "steps": 5, "warmup_steps": 2, "epochs": 3, "seeds": (0,)}
FULL = {"width": 1024, "steps": 20, "warmup_steps": 3, "epochs": 8, "seeds": (0, 1)}


@dataclass(frozen=True)
class SuiteConfig(SuiteRules):
    """Everything that decides what the suite runs; validated on construction.

    Raises:
        ValueError: a value breaks its rule; the message names the option, the value and the rule.
    """

    parts: tuple[str, ...] = PARTS
    """any of throughput, bubble, stash, convergence, bert (bytes come with convergence)"""
    networks: tuple[str, ...] = NETWORKS
    """throughput networks"""
    rate: str = "100mbit"
    """emulated links' rate, both ways"""
    stages: tuple[int, ...] = (2, 4)
    """stage counts of the throughput part"""
    engines: tuple[str, ...] = DEFAULT_ENGINES
    """throughput engines, any of ours_gpipe ours_1f1b ours_pipedream ours_2bw torch_gpipe torch_1f1b ddp deepspeed fairscale
    lightning ours_1f1b_ahead ours_1f1b_late (the last two: ours 1F1B with receives posted ahead, or when needed as in
    ours' other rows, the default)"""
    width: int = QUICK["width"]
    """MLP width"""
    depth: int = 8
    """Linear layers of the MLP"""
    batch_size: int = 64
    """global batch"""
    num_microbatches: int = 4
    """micro-batches per batch"""
    warmup_steps: int = QUICK["warmup_steps"]
    """untimed steps"""
    steps: int = QUICK["steps"]
    """timed steps (per round)"""
    rounds: int = 1
    """the engines launch runs its cases this many times in turn (ours, torch, ..., ours, torch, ...): every engine
    then samples the same stretches of the machine's load, and a row pools its rounds' steps"""
    lr: float = 1e-3
    """SGD lr of the throughput MLP"""
    bubble_points: tuple[tuple[int, int], ...] = ((2, 2), (2, 4), (2, 8), (4, 4))
    """K:m points of the bubble part"""
    bubble_width: int = 1024
    """MLP width of the bubble part"""
    stash_stages: tuple[int, ...] = (2,)
    """stage counts of the stash part"""
    stash_width: int = 2048
    """layer width of the stash part (2048: 16.8 MB a layer)"""
    methods: tuple[str, ...] = METHODS
    """convergence runs, any of ddp gpipe pipedream pipedream_nostash 2bw spectrain ddg features_replay dni cdni"""
    converge_models: tuple[str, ...] = CONVERGE_MODELS
    """convergence models: cnn (digits), transformer (a small BERT on synthetic IMDB, cut by split_points)"""
    converge_stages: int = 2
    """ranks of the convergence part"""
    converge_lr: float = 0.02
    """SGD lr of the convergence part's CNN (every method)"""
    converge_lr_transformer: float = 0.05
    """SGD lr of the convergence part's transformer (every method)"""
    converge_momentum: float = 0.9
    """SGD momentum of the convergence part (every method; SpecTrain needs it)"""
    converge_batch_size: int = 32
    """global batch of the convergence part"""
    epochs: int = QUICK["epochs"]
    """epochs of the convergence part"""
    seeds: tuple[int, ...] = QUICK["seeds"]
    """seeds of the convergence part"""
    bert_schedules: tuple[str, ...] = ("1f1b",)
    """schedules of the bert part, any of gpipe 1f1b (ours and torch's each)"""
    bert_batch_size: int = 32
    """global batch of the bert part (2 stages, --microbatches micro-batches)"""
    keep_from: str | None = None
    """a pipeline.json whose parts not run now are kept as they are, and whose convergence runs (model, method, seed)
    not made now are kept beside this run's (same settings); its command and date are recorded with them"""
    timeout: float = 600.0
    """seconds per launch"""
    quick: bool = True
    SUITE: ClassVar[str] = SUITE
    FLAGS: ClassVar[dict[str, str]] = {"networks": "--network", "num_microbatches": "--microbatches"}

    @property
    def converge_microbatches(self) -> int:
        return max(4, self.converge_stages)

    def __post_init__(self) -> None:
        bad = self.bad
        for name, allowed in (("parts", PARTS), ("networks", NETWORKS), ("engines", ENGINES), ("methods", METHODS),
                              ("converge_models", CONVERGE_MODELS), ("bert_schedules", ("gpipe", "1f1b")), ("stages", None),
                              ("stash_stages", None), ("seeds", None), ("bubble_points", None)):  # fmt: skip
            self.distinct(name, allowed)
        for name, values in (("stages", self.stages), ("stash_stages", self.stash_stages), ("converge_stages", (self.converge_stages,))):
            if any(isinstance(k, bool) or not isinstance(k, int) or not 2 <= k <= 8 for k in values):
                raise bad(name, values if len(values) > 1 else values[0], "a stage count must be an int in [2, 8]")
        self.ints("rounds", "width", "depth", "batch_size", "num_microbatches", "warmup_steps", "steps", "bubble_width", "stash_width",
                  "converge_batch_size", "epochs", "bert_batch_size")  # fmt: skip
        if any(not isinstance(s, int) or s < 0 for s in self.seeds):
            raise bad("seeds", self.seeds, "each seed must be an int >= 0")
        # The throughput and bubble parts' own rules apply only when they run (a tiny stash-only run needs no K:m).
        for k in self.stages if "throughput" in self.parts else ():
            if self.depth % k:
                raise bad("depth", self.depth, f"must be a multiple of every stage count (--stages {list(self.stages)})")
            if self.num_microbatches < k:
                raise bad("num_microbatches", self.num_microbatches, f"must be >= the stage count {k}: 1f1b and 2bw keep K in flight")
        if "throughput" in self.parts and (self.batch_size % self.num_microbatches or any(self.batch_size % k for k in self.stages)):
            raise bad("batch_size", self.batch_size, "must be a multiple of --microbatches and of every stage count "
                      "(DeepSpeed's micro-batches and DDP's shards are whole)")  # fmt: skip
        for point in self.bubble_points if "bubble" in self.parts else ():
            if len(point) != 2 or not all(isinstance(v, int) for v in point) or not 2 <= point[0] <= 8 or point[1] < point[0]:
                raise bad("bubble_points", point, "each point is K:m with K in [2, 8] and m >= K (1f1b and 2bw need it)")
            if self.depth % point[0] or self.batch_size % point[1]:
                raise bad("bubble_points", point, f"K must divide --depth ({self.depth}) and m --batch-size ({self.batch_size})")
        if self.converge_batch_size % self.converge_microbatches or self.converge_batch_size % self.converge_stages:
            raise bad("converge_batch_size", self.converge_batch_size, f"must be a multiple of the {self.converge_microbatches} "
                      "micro-batches and of --converge-stages (DDP's shards of the same global batch are whole)")  # fmt: skip
        if "bert" in self.parts and (self.bert_batch_size % self.num_microbatches or self.num_microbatches < 2):
            raise bad("bert_batch_size", self.bert_batch_size, f"must be a multiple of --microbatches ({self.num_microbatches}), "
                      "which must be >= the bert part's 2 stages")  # fmt: skip
        if not 0 <= self.converge_momentum < 1:
            raise bad("converge_momentum", self.converge_momentum, "must be in [0, 1)")
        if "spectrain" in self.methods and "convergence" in self.parts and not self.converge_momentum > 0:
            raise bad("converge_momentum", self.converge_momentum, "spectrain predicts the weights from SGD's momentum: must be > 0")
        try:
            parse_rate(self.rate)
        except ValueError:
            raise bad("rate", self.rate, "must look like '100mbit' or '1gbit'") from None
        self.positive("lr", "converge_lr", "converge_lr_transformer", "timeout")
        if self.keep_from is not None and not Path(self.keep_from).is_file():
            raise bad("keep_from", self.keep_from, "must be an existing pipeline.json")


# -- the plan --------------------------------------------------------------------------------------------


def mlp_spec(config: SuiteConfig, job: str, stages: int, **extra: Any) -> dict[str, Any]:
    """A :mod:`~lightning_pdist.bench.pipeline_worker` spec on the throughput MLP (validated)."""
    from lightning_pdist.bench.pipeline_worker import check_spec

    spec = {"job": job, "num_stages": stages, "seed": 0, "width": config.width, "depth": config.depth,
            "batch_size": config.batch_size, "warmup_steps": config.warmup_steps, "steps": config.steps, "lr": config.lr}  # fmt: skip
    return check_spec({**spec, **extra})


def engine_cases(config: SuiteConfig) -> list[dict[str, Any]]:
    """The cases one ``engines`` launch runs, in order."""
    m = config.num_microbatches
    cases = []
    for name in config.engines:
        engine, _, schedule = name.partition("_")
        schedule, _, variant = schedule.partition("_")
        if engine in ("ours", "torch"):
            cases.append({"engine": engine, "schedule": schedule, "num_microbatches": m,
                          **({"variant": variant, "post_ahead": POST_AHEAD[variant]} if variant else {})})  # fmt: skip
        elif engine == "ddp":
            cases.append({"engine": "ddp", "schedule": None, "num_microbatches": m})
    return cases * config.rounds


def steady_bubble(schedule: str, stages: int, microbatches: int, batches: int) -> tuple[float, float]:
    """(whole-program, steady-state) bubble of ``validate``'s simulation of ``batches`` batches."""
    from lightning_pdist.pipeline.schedule import build_schedule, validate

    now = validate(build_schedule(schedule, stages, microbatches, batches), BACKWARD_COST)
    more = validate(build_schedule(schedule, stages, microbatches, batches + 1), BACKWARD_COST)
    period = more.makespan - now.makespan
    return now.bubble_fraction, 1.0 - microbatches * (1.0 + BACKWARD_COST) / period


def pipeline_bytes(samples: int, microbatches: int, activation_numel: Sequence[int], announced_after: Sequence[int] = ()) -> int:
    """Bytes all stages send for ``samples`` in ``microbatches``: each cut, both ways, payload plus header, plus one
    announce frame per change of micro-batch shape, as large as the frame before it (``announced_after``: the
    previous micro-batch size at each change, 0 for the first message)."""
    from lightning_pdist.bench.pipeline_worker import HEADER_BYTES

    def cut(numel: int) -> int:
        announces = sum(HEADER_BYTES + size * numel * 4 for size in announced_after)
        return 2 * (samples * numel * 4 + microbatches * HEADER_BYTES + announces)

    return sum(cut(numel) for numel in activation_numel)


def ddp_bytes(steps: int, params: int, ranks: int) -> int:
    """Bytes all ranks send in ``steps`` fp32 all-reduces of ``params``: ``R · 2(R-1)/R · 4P`` per step."""
    from lightning_pdist.core.accounting import all_reduce_bytes

    return ranks * steps * all_reduce_bytes(4 * params, ranks)


# -- running ---------------------------------------------------------------------------------------------


class Runner:
    """Launches worker runs on loopback or on one emulated network (``net``); says how busy the rest of the machine was."""

    def __init__(self, config: SuiteConfig, launcher: Launcher, log: Callable[[str], None]) -> None:
        self.config, self.log, self.launcher = config, log, launcher
        self.net: EmulatedNetwork | None = None

    def launch(self, spec: dict[str, Any], processes: int, network: str, env: dict[str, str] | None = None) -> dict[str, Any]:
        """Run ``spec`` on ``processes`` ranks; their results, or ``{"error": ...}`` when a rank failed."""
        return self.launch_each([spec], processes, network, env)[0]

    def launch_each(self, specs: Sequence[dict[str, Any]], processes: int, network: str,
                    env: dict[str, str] | None = None) -> list[dict[str, Any]]:  # fmt: skip
        """Run each of ``specs`` in turn on the same ``processes`` ranks (one launch); per spec, :meth:`launch`'s answer."""
        net = LOOPBACK if network == "loopback" else self.net
        answers = []
        for got in self.launcher.run_each("lightning_pdist.bench.pipeline_worker", specs, processes, net, env=env, errors=500):
            if got.error is not None:  # the row says why; the launcher already stopped the other ranks
                answers.append({"error": got.error, "ranks": []})
                continue
            error = next((r["error"] for r in got.results if "error" in r), None)
            answers.append({"error": error, "ranks": got.results, "wall_s": round(got.wall_s, 1), "other_load_cores": got.other_load_cores})
        return answers


def throughput_rows(result: dict[str, Any], spec: dict[str, Any], processes: int, network: str, engine: str = "") -> list[dict[str, Any]]:
    """Rows of one launch: per case, the slowest stage's median step and ours' measured bubble."""
    common = {"stages": spec["num_stages"], "processes": processes, "network": network, "rate": None,
              "oversubscribed": processes > (os.cpu_count() or 1), "width": spec["width"], "depth": spec["depth"],
              "batch_size": spec["batch_size"], "other_load_cores": result.get("other_load_cores")}  # fmt: skip
    if result["error"] is not None:
        schedule = {"deepspeed": "1f1b", "fairscale": "gpipe", "ours+lightning": "1f1b"}.get(engine)
        return [{"engine": engine, "schedule": schedule, **common, "num_microbatches": spec.get("num_microbatches"),
                 "samples_per_s": None, "median_step_s": None, "error": result["error"]}]  # fmt: skip
    rows = []
    groups: dict[tuple, list[int]] = {}  # the cases of one engine and schedule over the rounds, pooled into one row
    for i, case in enumerate(result["ranks"][0]["cases"]):
        groups.setdefault((case["engine"], case["schedule"], case["num_microbatches"], case.get("variant")), []).append(i)
    for indices in groups.values():
        case = result["ranks"][0]["cases"][indices[0]]
        per_rank = [{key: None if r["cases"][indices[0]][key] is None else [v for i in indices for v in r["cases"][i][key]]
                     for key in ("step_s", "wait_s", "bytes")} | {"loop_s": sum(r["cases"][i]["loop_s"] for i in indices)}
                    for r in result["ranks"]]  # fmt: skip
        step = max(statistics.median(c["step_s"]) for c in per_rank)
        waits = [sum(c["wait_s"]) / sum(c["step_s"]) for c in per_rank if c["wait_s"] is not None]
        sent = [statistics.mean(c["bytes"]) for c in per_rank if c["bytes"] is not None]
        rounds = [max(statistics.median(r["cases"][i]["step_s"]) for r in result["ranks"]) for i in indices]
        rows.append({
            "engine": case["engine"] + (f" ({case['variant']})" if case.get("variant") else ""),
            "schedule": None if case["engine"] == "ddp" else case["schedule"], **common,
            "num_microbatches": case["num_microbatches"], "samples_per_s": round(spec["batch_size"] / step, 2),
            "median_step_s": round(step, 5), "mean_step_s": round(max(c["loop_s"] for c in per_rank) / len(per_rank[0]["step_s"]), 5),
            "bubble_measured": round(statistics.mean(waits), 4) if waits else None,
            "bytes_per_step": round(sum(sent)) if sent else None, "max_versions": result["ranks"][0]["cases"][indices[-1]].get("max_versions"),
            "error": None, **({"round_median_step_s": [round(t, 5) for t in rounds]} if len(indices) > 1 else {}),
            **({"post_ahead": case["post_ahead"]} if "post_ahead" in case else {}),
        })  # fmt: skip
    return rows


def run_throughput(runner: Runner, config: SuiteConfig, network: str) -> list[dict[str, Any]]:
    """Part 1 on one network: per stage count, the engines launch and DeepSpeed's (fairscale and Lightning once)."""
    rows = []
    cases = engine_cases(config)
    for k in config.stages:
        launches = []
        if cases:
            launches.append(("", mlp_spec(config, "engines", k, cases=cases), k))
        if "deepspeed" in config.engines:
            launches.append(("deepspeed", mlp_spec(config, "deepspeed", k, num_microbatches=config.num_microbatches), k))
        if "fairscale" in config.engines and network == config.networks[0]:
            launches.append(("fairscale", mlp_spec(config, "fairscale", k, num_microbatches=config.num_microbatches), 1))
        if "lightning" in config.engines and network == config.networks[0] and k == config.stages[0]:
            launches.append(("ours+lightning", mlp_spec(config, "lightning", k, num_microbatches=config.num_microbatches,
                                                        schedule="1f1b"), k))  # fmt: skip
        shared = [launch for launch in launches if launch[0] in ("", "ours+lightning")]  # one launch on the same k ranks
        results = dict(zip([launch[0] for launch in shared], runner.launch_each([spec for _, spec, _ in shared], k, network)))
        for engine, spec, processes in launches:
            where = "single process" if processes == 1 else network
            result = results[engine] if engine in results else runner.launch(spec, processes, "loopback" if processes == 1 else network)
            new = throughput_rows(result, spec, processes, where, engine)
            rows += new
            for row in new:
                what = row["error"] or f"{row['samples_per_s']:.0f} samples/s" + (
                    f", bubble {row['bubble_measured']:.3f}" if row.get("bubble_measured") is not None else "")
                runner.log(f"[throughput] {where} K={k} {row['engine']} {row['schedule'] or ''}: {what}")
    return rows


def ratios(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ours 1F1B over torch's Schedule1F1B, per stage count and network (same launch)."""
    out = []
    for key in dict.fromkeys((r["stages"], r["network"]) for r in rows):
        by = {(r["engine"], r["schedule"]): r for r in rows if (r["stages"], r["network"]) == key and r["samples_per_s"]}
        ours, theirs = by.get(("ours", "1f1b")), by.get(("torch", "1f1b"))
        if ours and theirs:
            out.append({"stages": key[0], "network": key[1], "ours_1f1b_samples_per_s": ours["samples_per_s"],
                        "torch_1f1b_samples_per_s": theirs["samples_per_s"],
                        "ratio": round(ours["samples_per_s"] / theirs["samples_per_s"], 3)})  # fmt: skip
            if "round_median_step_s" in ours and "round_median_step_s" in theirs:  # same batch: the inverse ratio of steps
                out[-1]["round_ratios"] = [round(t / o, 3) for o, t in zip(ours["round_median_step_s"], theirs["round_median_step_s"])]
    return out


def run_bubble(runner: Runner, config: SuiteConfig, measured: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """Part 2: ours' measured bubble at each K:m point, on loopback, against the formula and the simulation.

    ``measured``: throughput rows of this run; where they already hold ours' four schedules on loopback at a point's K
    and m with the bubble width (a run whose bubble width is its MLP width), that launch is not repeated.
    """
    from lightning_pdist.pipeline.schedule import bubble_formula

    rows = []
    for k in dict.fromkeys(p[0] for p in config.bubble_points):
        cases = [{"engine": "ours", "schedule": s, "num_microbatches": m} for kk, m in config.bubble_points if kk == k for s in SCHEDULES]
        spec = {**mlp_spec(config, "engines", k, cases=cases), "width": config.bubble_width}
        done = {(r["schedule"], r["num_microbatches"]): r for r in measured if r["engine"] == "ours" and r["network"] == "loopback"
                and r["stages"] == k and r["width"] == config.bubble_width and r["error"] is None}  # fmt: skip
        have = [done.get((c["schedule"], c["num_microbatches"])) for c in cases]
        got = have if all(have) else throughput_rows(runner.launch(spec, k, "loopback"), spec, k, "loopback", "ours")
        for row in got:
            if row["error"] is not None:
                rows.append({"stages": k, "network": "loopback", "error": row["error"]})
                continue
            m = row["num_microbatches"]
            whole, steady = steady_bubble(row["schedule"], k, m, config.steps)
            rows.append({**{key: row[key] for key in ("schedule", "stages", "num_microbatches", "network", "oversubscribed",
                                                       "width", "bubble_measured", "median_step_s", "other_load_cores", "error")},
                         "formula": round(bubble_formula(k, m), 4), "simulated_whole": round(whole, 4),
                         "simulated_steady": round(steady, 4)})  # fmt: skip
            runner.log(f"[bubble] K={k} m={m} {row['schedule']}: measured {row['bubble_measured']}, formula "
                       f"{bubble_formula(k, m):.3f}, simulated steady {steady:.3f}")  # fmt: skip
    return rows


def run_stash(runner: Runner, config: SuiteConfig) -> list[dict[str, Any]]:
    """Part 3: weight versions, their bytes and RSS growth per stage, each variant against its baseline."""
    from lightning_pdist.pipeline.schedule import build_schedule, validate
    from lightning_pdist.bench.pipeline_worker import check_spec

    rows = []
    m = max(4, max(config.stash_stages))
    for k in config.stash_stages:
        by_variant = {}
        specs = [check_spec({"job": "stash", "num_stages": k, "seed": 0, "width": config.stash_width, "depth": 2 * k,
                             "batch_size": 2 * m, "num_microbatches": m, "batches": 3, "lr": config.lr,
                             "schedule": variant.split("_")[0], "weight_stashing": variant != "pipedream_nostash"})
                 for variant in STASH_VARIANTS]  # fmt: skip
        # One launch runs the variants in turn. A fixed mmap threshold: every tensor of more than 64 KiB is its own
        # mapping, unmapped when freed (so a variant's peak does not reuse the memory of the one before).
        results = runner.launch_each(specs, k, "loopback", env={"MALLOC_MMAP_THRESHOLD_": "65536"})
        for variant, spec, result in zip(STASH_VARIANTS, specs, results):
            schedule = spec["schedule"]
            depth = validate(build_schedule(schedule, k, m, spec["batches"])).stash_depth
            by_variant[variant] = result["ranks"]
            for s, r in enumerate(result["ranks"]):
                expected = depth[s] if variant != "pipedream_nostash" else 1
                rows.append({"stages": k, "variant": variant, "schedule": schedule, "stage": s, "network": "loopback",
                             "num_microbatches": m, "param_bytes": r["param_bytes"], "stash_depth": depth[s],
                             "expected_versions": expected, "max_versions": r["max_versions"],
                             "max_weight_bytes": r["max_weight_bytes"], "expected_weight_bytes": expected * r["param_bytes"],
                             "rss_growth": r["rss_growth"], "hwm_reset": r["hwm_reset"], "baseline": BASELINE[variant]})  # fmt: skip
            if result["error"] is not None:
                rows.append({"stages": k, "variant": variant, "network": "loopback", "error": result["error"]})
        for row in rows:
            base = by_variant.get(row.get("baseline"))
            if row["stages"] == k and base and "stage" in row:
                b = base[row["stage"]]
                row["rss_over_baseline"] = row["rss_growth"] - b["rss_growth"]
                row["expected_over_baseline"] = (row["expected_versions"] - b["max_versions"]) * row["param_bytes"]
                runner.log(f"[stash] K={k} {row['variant']} stage {row['stage']}: {row['max_versions']} versions "
                           f"(depth {row['stash_depth']}), {row['max_weight_bytes'] / 1e6:.1f} MB, RSS +{row['rss_growth'] / 1e6:.1f} MB "
                           f"({row['rss_over_baseline'] / 1e6:+.1f} MB over {row['baseline']}, expected "
                           f"{row['expected_over_baseline'] / 1e6:+.1f})")  # fmt: skip
    return rows


def run_convergence(runner: Runner, config: SuiteConfig) -> dict[str, Any]:
    """Parts 4 and 5: accuracy per epoch of every model and method, and the CNN's training bytes per epoch against the
    formulas."""
    from lightning_pdist.bench.pipeline_worker import check_spec

    curves, bytes_rows, runs = [], [], []
    k = config.converge_stages
    plan = [(mo, se, me) for mo in config.converge_models for se in config.seeds for me in config.methods]
    specs = [check_spec({"job": "converge", "num_stages": k, "seed": seed, "strategy": method.split("_nostash")[0],
                         "weight_stashing": method != "pipedream_nostash", "num_microbatches": config.converge_microbatches,
                         "batch_size": config.converge_batch_size,
                         "lr": config.converge_lr if model == "cnn" else config.converge_lr_transformer, "momentum": config.converge_momentum, "epochs": config.epochs, "model": model})
             for model, seed, method in plan]  # fmt: skip
    for (model, seed, method), spec, result in zip(plan, specs, runner.launch_each(specs, k, "loopback")):  # one launch
        if result["error"] is not None:
            runs.append({"model": model, "method": method, "seed": seed, "error": result["error"]})
            runner.log(f"[convergence] {model} {method} seed {seed}: {result['error']}")
            continue
        ranks = result["ranks"]
        r0 = ranks[0]
        for e in r0["epochs"]:
            curves.append({"model": model, "method": method, "seed": seed, "stages": k, "epoch": e["epoch"],
                           "samples": e["samples"] * (k if method == "ddp" else 1), "val_acc": round(e["val_acc"], 4),
                           "lr": spec["lr"], "network": "loopback"})  # fmt: skip
        measured = sum(r["train_bytes"] for r in ranks)
        if model == "cnn" and seed == config.seeds[0]:
            bytes_rows.append(bytes_row(method, r0, measured, k, config.epochs))
        runs.append({"model": model, "method": method, "seed": seed, "error": None, "final_val_acc": round(r0["epochs"][-1]["val_acc"], 4),
                     "fit_s": round(r0["fit_s"], 1), "eval_bytes": sum(r["eval_bytes"] for r in ranks)})  # fmt: skip
        runner.log(f"[convergence] {model} {method} seed {seed}: val_acc {[round(e['val_acc'], 3) for e in r0['epochs']]}, "
                   f"{measured / config.epochs / 1e6:.2f} MB/epoch")  # fmt: skip
    return {"rows": curves, "runs": runs, "summary": convergence_summary(runs), "bytes_rows": bytes_rows}


def bytes_row(method: str, r0: dict[str, Any], measured: int, k: int, epochs: int) -> dict[str, Any]:
    """Part 5's row of one CNN run: measured training bytes per epoch against survey 002 Table 1's term."""
    if method == "ddp":
        formula, term = ddp_bytes(r0["train_steps"], r0["params"], k), "N²·L·M: R · 2(R-1)/R · 4·params per step"
    else:
        formula = pipeline_bytes(r0["samples"], r0["microbatches"], r0["activation_numel"], r0["announced_after"])
        term = "N·T·M: 2 · cuts · samples · 4·activation numel, + 128 B per message, + 1 frame per shape change"
    return {"method": method, "ranks": k, "network": "loopback (bytes do not depend on it)", "epochs": epochs,
            "params": r0["params"], "activation_numel": r0["activation_numel"],
            "samples_per_epoch": r0["samples"] * (k if method == "ddp" else 1) // epochs,
            "measured_bytes_per_epoch": measured / epochs, "formula_bytes_per_epoch": formula / epochs, "survey_term": term,
            "measured_over_formula": round(measured / formula, 6) if formula else None}  # fmt: skip


def convergence_summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Final accuracy per model and method (mean over seeds) and what stashing bought, in words the JSON keeps."""
    final: dict[str, dict[str, float | None]] = {}
    for model in dict.fromkeys(r.get("model", "cnn") for r in runs):
        for method in METHODS:
            accs = [r["final_val_acc"] for r in runs if r.get("model", "cnn") == model and r["method"] == method and r.get("error") is None]
            final.setdefault(model, {})[method] = round(statistics.mean(accs), 4) if accs else None
    notes = {}
    for model, by in final.items():
        stash, nostash = by.get("pipedream"), by.get("pipedream_nostash")
        if stash is None or nostash is None:
            notes[model] = "stashing was not compared (a run is missing)"
        elif abs(stash - nostash) < 0.01:
            notes[model] = (f"no difference at this lr and stage count ({stash:.4f} vs {nostash:.4f}): with few stages a "
                            "backward without stashing uses weights only K-1-s updates newer than its forward's, which a "
                            "small lr barely moves")  # fmt: skip
        else:
            notes[model] = (f"stashing {stash:.4f} vs no stashing {nostash:.4f} ({stash - nostash:+.4f}): without stashing a "
                            "backward uses newer weights than its forward, and at this lr the mismatched gradients "
                            + ("do not train" if nostash < 0.2 else "train worse"))  # fmt: skip
    return {"final_val_acc": final, "stashing_note": notes}


def run_bert(runner: Runner, config: SuiteConfig) -> tuple[list[dict[str, Any]], list[str]]:
    """Part 6: the BERT cut by ``split_points``, ours and torch's, per schedule; rows, and what could not run."""
    from lightning_pdist.bench.pipeline_worker import BERT_SPLIT, TRANSFORMER, check_spec

    rows, not_run = [], []
    plan = [(schedule, engine) for schedule in config.bert_schedules for engine in ("ours", "torch")]
    specs = [check_spec({"job": "bert", "num_stages": 2, "seed": 0, "batch_size": config.bert_batch_size,
                         "num_microbatches": config.num_microbatches, "warmup_steps": config.warmup_steps,
                         "steps": config.steps, "lr": config.lr, "engine": engine, "schedule": schedule})
             for schedule, engine in plan]  # fmt: skip
    for (schedule, engine), spec, result in zip(plan, specs, runner.launch_each(specs, 2, "loopback")):  # one launch
        for row in throughput_rows(result, {**spec, "width": TRANSFORMER["hidden_size"], "depth": TRANSFORMER["num_layers"]},
                                   2, "loopback", "ours+lightning" if engine == "ours" else "torch"):  # fmt: skip
            row.update(schedule=schedule, split_point=f"model.{BERT_SPLIT}" if engine == "ours" else BERT_SPLIT)
            rows.append(row)
            if row["error"]:
                not_run.append(f"bert {engine} {schedule}: {row['error']}")
            runner.log(f"[bert] {row['engine']} {schedule}: {row['error'] or str(row['samples_per_s']) + ' samples/s'}")
    return rows, not_run


def run_suite(config: SuiteConfig, out: Path, command: str, log: Callable[[str], None] = print) -> dict[str, Any] | None:
    """Run the requested parts; write ``out/pipeline.{json,png}``; return the document."""
    run = SuiteRun(SUITE, config, out, command, log, port=29700)
    doc, runner, clock = run.doc, Runner(config, run.launcher, log), time.perf_counter()

    def lap(part: str) -> None:
        nonlocal clock
        doc["part_wall_s"][part] = round(time.perf_counter() - clock, 1)
        clock = time.perf_counter()

    doc["part_wall_s"] = {}
    if "loopback" in config.networks or set(config.parts) - {"throughput"}:  # bubble, stash and convergence run on it
        run.loopback(LOOPBACK.describe())
    with run:
        if "throughput" in config.parts:
            for network in config.networks:
                if network == "loopback":
                    doc["rows"] += run_throughput(runner, config, "loopback")
                    continue
                for key, runner.net, _ in run.networks(("emulated",), (config.rate,), max(config.stages)):
                    rows = run_throughput(runner, config, key)
                    doc["rows"] += [{**r, "rate": config.rate} if r["network"] == key else r for r in rows]
            if any(r["network"] == "single process" for r in doc["rows"]):
                doc["networks"]["single process"] = {"detail": "fairscale Pipe: one process, its stages on K 'cpu' devices "
                                                               "sharing one thread; nothing crosses a network"}  # fmt: skip
            check_rows(doc["rows"], ROW_KEYS, SUITE)
            doc["ratios"] = ratios(doc["rows"])
            lap("throughput")
        if "bubble" in config.parts:
            doc["bubble"] = {"rows": run_bubble(runner, config, doc["rows"]), "backward_cost": BACKWARD_COST}
            lap("bubble")
        if "stash" in config.parts:
            doc["stash"] = {"rows": run_stash(runner, config)}
            lap("stash")
        if "convergence" in config.parts:
            conv = run_convergence(runner, config)
            doc["bytes"] = {"rows": conv.pop("bytes_rows")}
            doc["convergence"] = conv
            lap("convergence")
        if "bert" in config.parts:
            rows, not_run = run_bert(runner, config)
            doc["bert"] = {"rows": rows}
            doc["not_run"] = not_run
            lap("bert")
    if config.keep_from is not None:
        old = json.loads(Path(config.keep_from).read_text())
        keep_parts(doc, old, config)
        if "convergence" in config.parts:
            keep_convergence_rows(doc, old, config)
    return run.finish(plot)


#: What each part writes into the document.
PART_KEYS = {"throughput": ("rows", "ratios", "networks"), "bubble": ("bubble",), "stash": ("stash",),
             "convergence": ("convergence", "bytes"), "bert": ("bert", "not_run")}  # fmt: skip
#: The settings each part's figures depend on (a kept part must have been run with the same, as this run's text says).
PART_SETTINGS = {"throughput": ("networks", "rate", "stages", "engines", "width", "depth", "batch_size", "num_microbatches",
                                "warmup_steps", "steps", "lr", "rounds"),
                 "bubble": ("bubble_points", "bubble_width", "depth", "batch_size", "steps", "warmup_steps"),
                 "stash": ("stash_stages", "stash_width", "lr"),
                 "convergence": ("methods", "converge_models", "converge_stages", "converge_lr", "converge_lr_transformer", "converge_momentum",
                                 "converge_batch_size", "epochs", "seeds"),
                 "bert": ("bert_schedules", "bert_batch_size", "num_microbatches", "warmup_steps", "steps", "lr")}  # fmt: skip


def keep_parts(doc: dict[str, Any], old: dict[str, Any], config: SuiteConfig) -> None:
    """Copy into ``doc`` the parts ``old`` holds that this run did not run; ``doc["kept"]`` says from which run.

    Raises:
        ValueError: a kept part was run with other settings than this run's (its figures would be described wrongly).
    """
    kept = [p for p in PARTS if p not in config.parts and all(k in old for k in PART_KEYS[p][:1])]
    for part in kept:
        now = json.loads(json.dumps(doc["config"]))  # tuples as the file's lists
        then = {**old["config"], **(old.get(part) or {}).get("covers", {})}  # row-level kept convergence: the rows it holds
        differ = [k for k in PART_SETTINGS[part] if k in then and then[k] != now[k]]
        if differ:
            raise ValueError(f"pipeline(--keep-from={config.keep_from}): its {part} part ran with other settings "
                             f"({', '.join(k + '=' + repr(then[k]) for k in differ)}); re-run that part")  # fmt: skip
        for key in PART_KEYS[part]:
            if key == "networks":
                doc["networks"] = {**old["networks"], **doc["networks"]}
            elif key in old:
                doc[key] = old[key]
        doc["part_wall_s"][part] = old.get("part_wall_s", {}).get(part)
    before = old.get("kept") or {}  # the parts ``old`` itself kept came from an earlier run (and so on)
    sources = [{k: v for k, v in before.items() if k != "earlier"}, *before.get("earlier", [])] if before.get("parts") else []
    # each part under the earliest run it came from only (a nearer entry that lists it kept it in turn)
    earlier = [{**e, "parts": [p for p in e["parts"] if p in kept and not any(p in d["parts"] for d in sources[i + 1:])]}
               for i, e in enumerate(sources)]  # fmt: skip
    doc["kept"] = {"parts": kept, "from_command": old["command"], "from_created": old["created"], "from_host": old["host"],
                   "earlier": [e for e in earlier if e["parts"]]}  # fmt: skip


#: The settings every convergence row depends on: rows kept from an earlier run (``--keep-from``) must share them.
CONVERGE_KEEP_SETTINGS = ("converge_stages", "converge_lr", "converge_lr_transformer", "converge_momentum",
                          "converge_batch_size", "epochs")  # fmt: skip


def keep_convergence_rows(doc: dict[str, Any], old: dict[str, Any], config: SuiteConfig) -> None:
    """Add to this run's convergence part the runs of ``old`` (an earlier pipeline.json) it did not make again, by
    (model, method, seed): their curve rows, their bytes rows and their runs, in model, seed, method order; recompute
    the summary. ``doc["convergence"]["kept"]`` holds, per earlier command, the runs it made (``"cnn dni s0"``) and its
    command, date and load (an earlier run's own kept runs keep their entries); ``doc["convergence"]["covers"]`` the
    models, methods and seeds the part now holds (what a later whole-part keep compares).

    Raises:
        ValueError: ``old`` is another suite's, or its convergence ran with other :data:`CONVERGE_KEEP_SETTINGS`.
    """
    where = f"pipeline(--keep-from={config.keep_from!r})"
    if old.get("suite") != SUITE:
        raise ValueError(f"{where}: holds suite {old.get('suite')!r}, not {SUITE!r}")
    if not old.get("convergence"):
        return
    now = json.loads(json.dumps(doc["config"]))
    refuse_other_settings(where, old["config"], now, CONVERGE_KEEP_SETTINGS, "convergence rows", "; re-run them")
    conv, was = doc["convergence"], old["convergence"]
    name = lambda r: f"{r.get('model', 'cnn')} {r['method']} s{r['seed']}"  # noqa: E731
    made = {name(r) for r in conv["runs"]}
    kept = [r for r in was["runs"] if name(r) not in made]
    names = {name(r) for r in kept}
    cnn_first = {r["method"] for r in kept if r.get("model", "cnn") == "cnn" and r["seed"] == old["config"]["seeds"][0]}  # its bytes rows
    models, methods = list(CONVERGE_MODELS), list(METHODS)
    order = lambda r: (models.index(r.get("model", "cnn")), r["seed"], methods.index(r["method"]))  # noqa: E731
    conv["runs"] = sorted(conv["runs"] + kept, key=order)
    conv["rows"] = sorted(conv["rows"] + [r for r in was["rows"] if name(r) in names], key=lambda r: (*order(r), r["epoch"]))
    bytes_made = {r["method"] for r in doc["bytes"]["rows"]}
    doc["bytes"]["rows"] = sorted(doc["bytes"]["rows"] + [r for r in (old.get("bytes") or {}).get("rows", [])
                                                          if r["method"] in cnn_first - bytes_made], key=lambda r: methods.index(r["method"]))  # fmt: skip
    conv["summary"] = convergence_summary(conv["runs"])
    conv["kept"] = kept_provenance(old, was.get("kept", []), [name(r) for r in kept])
    conv["covers"] = {"converge_models": [m for m in models if any(r.get("model", "cnn") == m for r in conv["runs"])],
                      "methods": [m for m in methods if any(r["method"] == m for r in conv["runs"])],
                      "seeds": sorted({r["seed"] for r in conv["runs"]})}  # fmt: skip


# -- output --------------------------------------------------------------------------------------------

THROUGHPUT_COLUMNS = (
    ("network", "network", None), ("K", "stages", None), ("procs", "processes", None), ("engine", "engine", None),
    ("schedule", "schedule", None), ("m", "num_microbatches", None), ("samples/s", "samples_per_s", ".1f"),
    ("median ms", "median_step_s", lambda s: f"{1000 * s:.1f}"), ("bubble", "bubble_measured", ".3f"),
    ("bytes/step", "bytes_per_step", ",d"), ("oversubscribed", "oversubscribed", lambda b: "yes" if b else "no"),
    ("other load", "other_load_cores", ".2f"), ("error", "error", None),
)  # fmt: skip
BUBBLE_COLUMNS = (
    ("K", "stages", None), ("m", "num_microbatches", None), ("schedule", "schedule", None),
    ("measured", "bubble_measured", ".3f"), ("(K-1)/(m+K-1)", "formula", ".3f"),
    ("simulated, steady", "simulated_steady", ".3f"), ("simulated, whole run", "simulated_whole", ".3f"),
    ("median ms", "median_step_s", lambda s: f"{1000 * s:.1f}"),
)  # fmt: skip
STASH_COLUMNS = (
    ("K", "stages", None), ("variant", "variant", None), ("stage", "stage", None), ("stash depth", "stash_depth", None),
    ("versions", "max_versions", None), ("weight MB", "max_weight_bytes", lambda b: f"{b / 1e6:.1f}"),
    ("RSS growth MB", "rss_growth", lambda b: f"{b / 1e6:.1f}"), ("baseline", "baseline", None),
    ("over baseline MB", "rss_over_baseline", lambda b: f"{b / 1e6:+.1f}"),
    ("expected MB", "expected_over_baseline", lambda b: f"{b / 1e6:+.1f}"),
)  # fmt: skip
FINAL_COLUMNS = (
    ("method", "method", None), ("cnn val_acc", "acc_cnn", ".4f"), ("transformer val_acc", "acc_transformer", ".4f"),
    ("cnn fit s", "fit_s_cnn", ".1f"), ("transformer fit s", "fit_s_transformer", ".1f"),
)  # fmt: skip
BERT_COLUMNS = (
    ("engine", "engine", None), ("schedule", "schedule", None), ("split point", "split_point", None),
    ("m", "num_microbatches", None), ("samples/s", "samples_per_s", ".1f"),
    ("median ms", "median_step_s", lambda s: f"{1000 * s:.1f}"), ("other load", "other_load_cores", ".2f"), ("error", "error", None),
)  # fmt: skip
BYTES_COLUMNS = (
    ("method", "method", None), ("ranks", "ranks", None), ("samples/epoch", "samples_per_epoch", None),
    ("measured MB/epoch", "measured_bytes_per_epoch", lambda b: f"{b / 1e6:.3f}"),
    ("formula MB/epoch", "formula_bytes_per_epoch", lambda b: f"{b / 1e6:.3f}"),
    ("measured/formula", "measured_over_formula", ".4f"), ("survey term", "survey_term", None),
)  # fmt: skip


def docs_section(doc: dict[str, Any], json_path: str) -> str:
    """The suite's figures as markdown; everything is read from ``doc``."""
    cfg = doc["config"]
    lines = [
        *run_lines(doc, json_path),
    ]
    if doc.get("kept", {}).get("parts"):
        kept = doc["kept"]
        lines += ["", f"Parts {', '.join(kept['parts'])} are kept from the run `{kept['from_command']}` of {kept['from_created']} "
                  f"(1-min load average {kept['from_host']['loadavg_1m_at_start']} at its start); the others ran in the run above."]  # fmt: skip
        lines += [f"Of these, {', '.join(e['parts'])} came to it from the run `{e['from_command']}` of {e['from_created']} "
                  f"(1-min load average {e['from_host']['loadavg_1m_at_start']} at its start)." for e in kept.get("earlier", [])]  # fmt: skip
    if doc["rows"]:
        nets = "\n".join(network_lines(doc, goodput=None))
        lines += ["", "### Throughput", "", f"MLP: {cfg['depth']} × Linear({cfg['width']}, {cfg['width']}), batch "
                  f"{cfg['batch_size']} in {cfg['num_microbatches']} micro-batches, {cfg['warmup_steps']} untimed + "
                  f"{cfg['steps']} timed steps (median of the slowest stage). More processes than CPUs means "
                  "oversubscribed; fairscale is one process.", "", "Networks:", "", nets, "",
                  markdown_table(doc["rows"], THROUGHPUT_COLUMNS), ""]  # fmt: skip
        lines += [f"- ours 1F1B / torch Schedule1F1B, {r['network']}, K={r['stages']}: {r['ratio']:.3f}"
                  + (f" (per round: {', '.join(f'{x:.3f}' for x in r['round_ratios'])})" if r.get("round_ratios") else "")
                  for r in doc.get("ratios", [])]  # fmt: skip
        lines += ["- DeepSpeed runs with its shared-memory all-reduce op switched off (a 75-80 s JIT build the pipeline's "
                  "p2p never uses) and plain SGD, so no JIT happens; its traffic goes over gloo like everyone's."]  # fmt: skip
        lines += mlp_bytes_lines(doc["rows"])
    if doc.get("bubble"):
        loads = [r["other_load_cores"] for r in doc["bubble"]["rows"] if r.get("other_load_cores") is not None]
        lines += ["", "### Bubble (loopback)", "", f"Width {cfg['bubble_width']}; simulation with backward cost "
                  f"{doc['bubble']['backward_cost']}. The measured wait also holds each message's transfer and, where "
                  f"processes outnumber free cores, the time a neighbour waits for a core (other load during these runs: "
                  f"{max(loads) if loads else '–'} cores).", "", markdown_table(doc["bubble"]["rows"], BUBBLE_COLUMNS)]  # fmt: skip
    if doc.get("stash"):
        lines += ["", "### Weight stashing memory (loopback)", "", markdown_table(doc["stash"]["rows"], STASH_COLUMNS)]
    conv = doc.get("convergence")
    if conv:
        models = list(dict.fromkeys(r.get("model", "cnn") for r in conv["runs"]))
        lrs = " and ".join(f"{cfg.get('converge_lr' if m == 'cnn' else 'converge_lr_transformer')} ({m})" for m in models)
        what = {"cnn": "cnn: ClassifierModule(model='cnn') on digits",
                "transformer": "transformer: a 2-block BERT (hidden 128, 4 heads, max 128 tokens, no dropout) on synthetic "
                               "IMDB reviews, cut by split_points at its second block"}  # fmt: skip
        lines += ["", "### Convergence (Lightning, loopback)", "",
                  f"SGD for every method, momentum {cfg.get('converge_momentum', 0.0)}, lr {lrs}, batch "
                  f"{cfg['converge_batch_size']} in {max(4, cfg['converge_stages'])} micro-batches, {cfg['converge_stages']} "
                  f"stages/ranks, {cfg['epochs']} epochs, seeds {list(cfg['seeds'])}. {'; '.join(what[m] for m in models)}. "
                  "pipedream (and spectrain, ddg, features_replay, dni, cdni) update after every micro-batch (batch/m samples, "
                  "the same lr), the others once per batch; dni is pipedream's timing with synthetic_gradients=True, cdni "
                  "the same with synthetic_conditioning='labels'.", "",
                  markdown_table(final_rows(conv), [c for c in FINAL_COLUMNS if c[1].rsplit("_", 1)[-1] in ("method", *models)]), ""]  # fmt: skip
        notes = conv["summary"]["stashing_note"]
        lines += [f"Stashing ({model}): {note}" for model, note in (notes.items() if isinstance(notes, dict) else [("cnn", notes)])]
        lines += [f"- {r.get('model', 'cnn')} {r['method']} seed {r['seed']}: error {r['error']}" for r in conv["runs"] if r.get("error")]
        if conv.get("kept"):
            lines += ["", "Convergence runs kept from earlier commands (the others ran in the run above):", ""]
            lines += [f"- {', '.join(e['rows'])}: `{e['command']}` (run {e['created']}, 1-min load average "
                      f"{e['loadavg_1m_at_start']} at its start)" for e in conv["kept"]]  # fmt: skip
    if (doc.get("bytes") or {}).get("rows"):
        lines += ["", "### Bytes per epoch against survey 002 Table 1", "", markdown_table(doc["bytes"]["rows"], BYTES_COLUMNS)]
    if doc.get("bert"):
        lines += ["", "### BERT cut by split_points (loopback)", "", "The convergence part's BERT (batch "
                  f"{cfg.get('bert_batch_size')} of random token ids, {cfg['num_microbatches']} micro-batches, 2 stages, "
                  f"{cfg['warmup_steps']} untimed + {cfg['steps']} timed steps): ours through Lightning "
                  "(PipelineStrategy(split_points=...), the only way such a module pipelines here: its per-step overhead "
                  "is in the figure, see ours+lightning against ours 1f1b above), torch's pipeline() traced at the same "
                  "block with its schedule at the executor level.", "", markdown_table(doc["bert"]["rows"], BERT_COLUMNS)]  # fmt: skip
    return "\n".join(lines + not_run_lines(doc))


def final_rows(conv: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per method: final val_acc per model (mean over seeds) and the fit seconds of the first seed."""
    finals = conv["summary"]["final_val_acc"]
    if finals and not isinstance(next(iter(finals.values())), dict):  # one model (the CNN), as older files hold
        finals = {"cnn": finals}
    fit = {(r.get("model", "cnn"), r["method"]): r.get("fit_s") for r in conv["runs"] if r.get("error") is None}
    methods = [m for m in METHODS if any(by.get(m) is not None for by in finals.values())]
    return [{"method": m, **{f"acc_{mo}": by.get(m) for mo, by in finals.items()},
             **{f"fit_s_{mo}": fit.get((mo, m)) for mo in finals}} for m in methods]  # fmt: skip


def _legend(ax: Any, **kwargs: Any) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kwargs)


def mlp_bytes_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Per step of the throughput MLP: what the pipeline's activations cost against DDP's all-reduce (all ranks)."""
    lines = []
    for k in dict.fromkeys(r["stages"] for r in rows):
        ours = next((r for r in rows if r["stages"] == k and r["engine"] == "ours" and r.get("bytes_per_step")), None)
        ddp = next((r for r in rows if r["stages"] == k and r["engine"] == "ddp" and r.get("bytes_per_step")), None)
        if ours and ddp:
            times = ddp["bytes_per_step"] / ours["bytes_per_step"]
            lines.append(f"- bytes per step, K={k}: pipeline {ours['bytes_per_step']:,} (activations and their gradients) vs "
                         f"DDP {ddp['bytes_per_step']:,} (the model, all-reduced): {times:.1f}x")  # fmt: skip
    return lines


def plot(doc: dict[str, Any], path: str | Path) -> Path:
    """Throughput per engine, bubble against the formula, stash memory, accuracy vs samples, bytes per epoch."""
    plt = pyplot()

    fig = plt.figure(figsize=(18, 9))
    grid = fig.add_gridspec(2, 3)
    axes = [fig.add_subplot(grid[0, :2]), fig.add_subplot(grid[0, 2])] + [fig.add_subplot(grid[1, j]) for j in range(3)]
    rows = [r for r in doc["rows"] if r["samples_per_s"]]
    group = lambda r: f"{r['network']} K={r['stages']}"  # noqa: E731
    label = lambda r: f"{r['engine']} {r['schedule'] or ''}".strip()  # noqa: E731
    groups = list(dict.fromkeys(map(group, rows)))
    colors = {name: f"C{i % 10}" for i, name in enumerate(dict.fromkeys(map(label, rows)))}
    width = 0.8 / max([sum(group(r) == g for r in rows) for g in groups] + [1])
    seen: set[str] = set()
    for i, g in enumerate(groups):
        for j, r in enumerate(r for r in rows if group(r) == g):
            name = label(r)
            axes[0].bar(i + j * width, r["samples_per_s"], width, color=colors[name], label=None if name in seen else name)
            seen.add(name)
    axes[0].set_xticks([i + (sum(group(r) == g for r in rows) - 1) * width / 2 for i, g in enumerate(groups)], groups, fontsize=7)
    axes[0].set(ylabel="samples/s", title="throughput (same MLP and batch)")
    _legend(axes[0], fontsize=6, ncol=2)
    bubble = (doc.get("bubble") or {}).get("rows", [])
    for schedule, marker in zip(SCHEDULES, "osD^"):
        pts = [r for r in bubble if r["schedule"] == schedule and r.get("bubble_measured") is not None]
        axes[1].scatter([r["simulated_steady"] for r in pts], [r["bubble_measured"] for r in pts], marker=marker, label=schedule)
    axes[1].plot([0, 0.6], [0, 0.6], "k:", lw=1)
    axes[1].set(xlabel="simulated steady-state bubble (= (K-1)/(m+K-1) when flushed)", ylabel="measured wait / step", title="bubble")
    _legend(axes[1], fontsize=7)
    stash = [r for r in (doc.get("stash") or {}).get("rows", []) if "stage" in r]
    names = [f"K{r['stages']} {r['variant']} s{r['stage']}" for r in stash]
    for j, (key, label) in enumerate((("expected_weight_bytes", "depth × stage bytes"), ("max_weight_bytes", "weight_versions()"),
                                      ("rss_over_baseline", "RSS growth over baseline"))):  # fmt: skip
        axes[2].bar([i + j * 0.27 for i in range(len(stash))], [r.get(key, 0) / 1e6 for r in stash], 0.27, label=label)
    axes[2].set_xticks(range(len(stash)), names, rotation=90, fontsize=6)
    axes[2].set(ylabel="MB", title="stashed weights per stage")
    _legend(axes[2], fontsize=7)
    curves = (doc.get("convergence") or {}).get("rows", [])
    for model, style in zip(CONVERGE_MODELS, ("o-", "s--")):
        for i, method in enumerate(METHODS):
            for seed in dict.fromkeys(r["seed"] for r in curves):
                pts = [r for r in curves if r.get("model", "cnn") == model and r["method"] == method and r["seed"] == seed]
                if pts:
                    axes[3].plot([r["samples"] for r in pts], [r["val_acc"] for r in pts], style, color=f"C{i}",
                                 label=f"{model} {method} s{seed}")  # fmt: skip
    axes[3].set(xlabel="training samples", ylabel="val accuracy", title="convergence (cnn: digits, o-; transformer: IMDB, s--)")
    _legend(axes[3], fontsize=5, ncol=2)
    brows = (doc.get("bytes") or {}).get("rows", [])
    axes[4].bar([i - 0.2 for i in range(len(brows))], [r["measured_bytes_per_epoch"] / 1e6 for r in brows], 0.4, label="measured")
    axes[4].bar([i + 0.2 for i in range(len(brows))], [r["formula_bytes_per_epoch"] / 1e6 for r in brows], 0.4, label="formula")
    axes[4].set_xticks(range(len(brows)), [r["method"] for r in brows], fontsize=7, rotation=15)
    axes[4].set(ylabel="MB per epoch (all ranks)", title="bytes per epoch vs survey 002 Table 1")
    _legend(axes[4], fontsize=7)
    return save_figure(fig, path, dpi=100, title=f"pipeline suite, {doc['created']}")


# -- command line ----------------------------------------------------------------------------------------


def _point(text: Any) -> tuple[int, int]:
    if isinstance(text, tuple):  # jsonargparse checks a parsed value again
        return text
    k, sep, m = text.partition(":")
    if not sep or not k.isdigit() or not m.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not K:m (two ints, e.g. 2:4)")
    return int(k), int(m)


CLI = SuiteCli(config=SuiteConfig, quick=QUICK, full=FULL, out="pipeline.json, pipeline.png and docs_section.md",
               either={"networks": NETWORKS},
               parsers={"bubble_points": _point})  # fmt: skip

run = documented_run(SUITE, run_suite, docs_section)
