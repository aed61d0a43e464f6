"""Asynchronous suite: time to accuracy of DDP, async parameter server, D-PSGD, AD-PSGD and fairscale's SGP with and
without a straggler on slow links; Hogwild! against a lock, one process and DDP on this machine.

``python -m lightning_pdist.bench asynchronous [--quick] --out DIR [--parts network|shared|both] [--models cnn text]
[--keep-from OLD.json]`` trains each model of ``--models``, every run from the same seed and weights
(:mod:`~lightning_pdist.bench.asynchronous_worker`): ``cnn``, ``ClassifierModule(model="cnn")`` on the digits (SGD
``--lr``, ``--momentum``); ``text``, ``SparseBagClassifier`` (an ``nn.EmbeddingBag(sparse=True)`` table of 12,012
rows, the case Hogwild! was made for) on synthetic IMDB reviews the suite writes once in a temporary folder (Adagrad,
which steps only the touched rows: ``--text-lr`` for the table, ``--text-head-lr`` for the head). Per model, in two parts:

* **network**: ``--world-size`` ranks, one per emulated host on ``--rate`` links (netns + tbf, needs root), each
  method of ``--methods`` in one launch of two fits: without a straggler, then with the last rank slowed
  ``--slowdown``× (it sleeps ``slowdown − 1`` times the wall time of its step after every step). Per fit,
  ``--steps`` steps per rank; rank 0 copies its parameters every ``--eval-every`` steps and they are evaluated
  after the fit. ``time_to_target_s``: the training time (rank 0's clock) at which rank 0's model first reached
  DDP's final accuracy of the same setting (``target``); ``tta_speedup``: DDP's time over the row's. Every clock
  starts at the end of the first step (set-up and first-batch costs stay out).
* **shared**: this machine, loopback: ``single`` (one process, ``--shared-samples`` samples), and 2 processes
  sharing them (each ``--shared-samples / 2``): ``hogwild``, ``hogwild_lock`` and ``ddp``. ``samples_per_s``: all
  processes' samples after their first step over the slowest process's training loop.

Writes ``DIR/asynchronous.json``, ``DIR/asynchronous.png`` and ``DIR/docs_section.md``; ``doc["goals"]`` judges
issue 22's goals on each model's rows, ``doc["not_run"]`` says what the issue names that did not run, and why.
``--keep-from OLD.json`` adds the rows (one per model, part, method and straggler) of an earlier run that this one
does not make again, with that run's command, date and load in ``doc["kept"]``; the earlier run must share the
settings the kept rows depend on (:func:`keep_settings`), so each launch of the full plan can be its own command.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import json
import tempfile

from lightning_pdist.bench.asynchronous_worker import METHODS, MODELS, TEXT_REVIEWS
from lightning_pdist.bench.cli import SuiteCli, SuiteRules
from lightning_pdist.bench.launch import SuiteRun
from lightning_pdist.bench.netns import parse_rate
from lightning_pdist.bench.report import (check_rows, documented_run, failed_lines, goal_lines, keep_earlier_rows,
                                          kept_lines, markdown_table, network_lines, not_run_lines, run_lines,
                                          save_figure, subplots)  # fmt: skip

SUITE = "asynchronous"
WORKER = "lightning_pdist.bench.asynchronous_worker"
NETWORK_METHODS = ("ddp", "ps_async", "dpsgd", "adpsgd", "sgp")
SHARED_METHODS = ("single", "hogwild", "hogwild_lock", "ddp")
PARTS = ("network", "shared")
ROW_KEYS = ("model", "part", "method", "world_size", "straggler", "val_acc", "error")
ACC_TOLERANCE = 0.01  # "the same final accuracy": within one point (3.6 of the 359 held-out digits, 3 of 300 reviews)
QUICK = {"steps": 8, "shared_samples": 512, "methods": ("ddp", "adpsgd"), "world_size": 2}
FULL = {"steps": 96, "shared_samples": 12288, "methods": NETWORK_METHODS, "world_size": 4}


@dataclass(frozen=True)
class SuiteConfig(SuiteRules):
    """Everything that decides what the suite runs; validated on construction (``ValueError`` names the option)."""

    parts: tuple[str, ...] = PARTS
    """network (emulated links, needs root), shared (this machine) or both"""
    models: tuple[str, ...] = tuple(MODELS)
    """models from cnn (digits CNN) text (sparse bag of embeddings on synthetic IMDB reviews)"""
    rate: str = "100mbit"
    """emulated link rate each way, tc syntax"""
    world_size: int = 2
    """ranks of the network part"""
    methods: tuple[str, ...] = ("ddp", "adpsgd")
    """network part: methods from ddp ps_async dpsgd adpsgd sgp (ddp is the reference: run now or kept)"""
    shared: tuple[str, ...] = SHARED_METHODS
    """shared part: runs from single hogwild hogwild_lock ddp (single is the reference)"""
    steps: int = 8
    """network part: optimizer steps per rank per fit"""
    shared_samples: int = 512
    """shared part: training samples of each run, over all its processes"""
    slowdown: float = 3.0
    """how many times slower the straggler's steps are (>= 1)"""
    batch_size: int = 32
    """per process"""
    lr: float = 0.05
    """SGD learning rate"""
    momentum: float = 0.9
    """SGD momentum"""
    width: int = 32
    """SmallCNN width"""
    text_lr: float = 0.2
    """text model: Adagrad learning rate of the embedding table"""
    text_head_lr: float = 0.02
    """text model: Adagrad learning rate of its linear head"""
    text_width: int = 32
    """text model: embedding width (rows of 12,012 ids)"""
    seed: int = 0
    """seed of weights and data"""
    eval_every: int = 4
    """steps between rank 0's parameter copies (time to accuracy)"""
    timeout: float = 600.0
    """seconds per launch"""
    keep_from: str | None = None
    """an earlier asynchronous.json: its rows this run does not make again are kept (same settings needed)"""
    quick: bool = True
    SUITE: ClassVar[str] = SUITE

    def __post_init__(self) -> None:
        self.distinct("parts", PARTS)
        self.distinct("models", tuple(MODELS))
        parse_rate(self.rate)  # raises with the rule
        self.distinct("methods", NETWORK_METHODS)
        if "ddp" not in self.methods and self.keep_from is None:
            raise self.bad("methods", self.methods, "must include ddp (the time-to-accuracy target is DDP's accuracy), "
                                                    "or keep DDP's rows with --keep-from")  # fmt: skip
        self.distinct("shared", SHARED_METHODS)
        self.ints("world_size", low=2)
        self.ints("steps", low=2)  # the clock starts after the first step
        self.ints("batch_size", "width", "text_width", "eval_every")
        self.ints("seed", low=0)
        self.positive("lr", "text_lr", "text_head_lr")
        self.positive("timeout", unit=" seconds")
        if not 0 <= self.momentum < 1:
            raise self.bad("momentum", self.momentum, "must be in [0, 1)")
        if isinstance(self.slowdown, bool) or not isinstance(self.slowdown, (int, float)) or self.slowdown < 1:
            raise self.bad("slowdown", self.slowdown, "must be a number >= 1")
        unit = 2 * self.batch_size  # two processes, at least 2 steps each (the clock starts after the first)
        if isinstance(self.shared_samples, bool) or not isinstance(self.shared_samples, int) or self.shared_samples < 2 * unit \
                or self.shared_samples % unit:  # fmt: skip
            raise self.bad("shared_samples", self.shared_samples, f"must be a multiple of 2 * batch_size = {unit}, "
                                                                  f"at least {2 * unit}")  # fmt: skip
        self.earlier()


def worker_spec(config: SuiteConfig, model: str, method: str, world_size: int, steps: int, stragglers: list,
                data_dir: str | None = None) -> dict[str, Any]:  # fmt: skip
    """The spec of one launch (:class:`~lightning_pdist.bench.asynchronous_worker.Spec`); the text model's reviews
    are in ``data_dir``."""
    text = model == "text"
    return {"model": model, "method": method, "world_size": world_size, "steps": steps, "batch_size": config.batch_size,
            "lr": config.text_lr if text else config.lr, "momentum": 0.0 if text else config.momentum,
            "width": config.text_width if text else config.width, "head_lr": config.text_head_lr if text else None,
            "data_dir": (data_dir or "") if text else None, "seed": config.seed, "eval_every": config.eval_every,
            "stragglers": stragglers, "slowdown": config.slowdown}  # fmt: skip


def plan(config: SuiteConfig, data_dir: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    """``(part, spec)`` of every launch, model by model: the network methods (two fits each), then the shared-memory
    runs."""
    out = []
    for model in config.models:
        out += [("network", worker_spec(config, model, m, config.world_size, config.steps, [None, config.world_size - 1],
                                        data_dir)) for m in config.methods if "network" in config.parts]  # fmt: skip
        for m in config.shared if "shared" in config.parts else ():
            n = 1 if m == "single" else 2
            steps = config.shared_samples // (n * config.batch_size)
            out.append(("shared", worker_spec(config, model, m, n, steps, [None], data_dir)))
    return out


# -- keeping an earlier run's rows -------------------------------------------------------------------

#: The settings every row depends on, and those that only one model's rows depend on.
COMMON_SETTINGS = ("rate", "world_size", "steps", "shared_samples", "slowdown", "batch_size", "seed", "eval_every")
MODEL_SETTINGS = {"cnn": ("lr", "momentum", "width"), "text": ("text_lr", "text_head_lr", "text_width")}


def row_name(row: dict[str, Any]) -> str:
    """``"text/network/adpsgd"``: the unit a ``--keep-from`` run keeps or makes again (both fits of a launch)."""
    return f"{row.get('model', 'cnn')}/{row['part']}/{row['method']}"


def keep_settings(models: Sequence[str]) -> tuple[str, ...]:
    """The settings kept rows of ``models`` must share with this run."""
    return COMMON_SETTINGS + tuple(k for m in models for k in MODEL_SETTINGS[m])


def keep_rows(doc: dict[str, Any], old: dict[str, Any], config: SuiteConfig) -> None:
    """Add to ``doc`` (in place) the rows of ``old`` (an earlier asynchronous.json; rows without a model are the
    CNN's) that this run did not make again, in model, part, method order, and ``doc["kept"]``: per earlier command
    the rows it made, its command, date, load and wall time (an earlier run's own kept rows keep their entries).

    Raises:
        ValueError: ``old`` is another suite's, or ran with other :func:`keep_settings` than the rows it keeps.
    """
    methods = {"network": NETWORK_METHODS, "shared": SHARED_METHODS}
    keep_earlier_rows(doc, old, SUITE, config.keep_from, row_name,
                      lambda kept: keep_settings(list(dict.fromkeys(r["model"] for r in kept))),
                      lambda r: ([*MODELS].index(r["model"]), PARTS.index(r["part"]), methods[r["part"]].index(r["method"])),
                      "; re-run those rows too, or drop --keep-from", lambda r: {"model": "cnn", **r})  # fmt: skip


# -- rows ------------------------------------------------------------------------------------------


def build_rows(part: str, spec: dict[str, Any], got: Any) -> list[dict[str, Any]]:
    """One row per fit of a launch (``got``: :class:`~lightning_pdist.bench.launch.Launched`)."""
    base = {"model": spec["model"], "part": part, "method": spec["method"], "what": METHODS[spec["method"]], "world_size": spec["world_size"],
            "steps": spec["steps"], "other_load_cores": got.other_load_cores}  # fmt: skip
    rows = []
    for i, straggler in enumerate(spec["stragglers"]):
        fits = [r["fits"][i] for r in got.results] if not got.error else []
        error = got.error or next((f["error"] for f in fits if f.get("error")), None)
        row = {**base, "straggler": straggler, "error": error, "val_acc": None, "evals": []}
        if not error:
            loop = max(f["loop_s"] for f in fits)
            row.update(val_acc=round(fits[0]["val_acc"], 4), evals=fits[0]["evals"], loop_s=round(loop, 3),
                       rank0_loop_s=round(fits[0]["loop_s"], 3), model_params=fits[0]["model_params"],
                       ms_per_step=round(1000 * fits[0]["loop_s"] / (fits[0]["steps"] - 1), 1),
                       samples_per_s=round(sum(f["steps"] - 1 for f in fits) * spec["batch_size"] / loop, 1),
                       straggler_slept_s=None if straggler is None else round(fits[straggler]["slept_s"], 3),
                       straggler_compute_s=None if straggler is None else round(fits[straggler]["compute_s"], 3))  # fmt: skip
        rows.append(row)
    return rows


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Network rows: time to DDP's final accuracy of the same model and straggler setting; shared rows: samples/s and
    accuracy against one process of the same model (in place)."""
    for r in rows:
        r.update(target=None, time_to_target_s=None, tta_speedup=None, vs_single=None, acc_vs_single=None)
    for model in dict.fromkeys(r.get("model", "cnn") for r in rows):
        _compare_model([r for r in rows if r.get("model", "cnn") == model and not r["error"]])
    return rows


def _compare_model(ok: list[dict[str, Any]]) -> None:
    for straggler in {r["straggler"] for r in ok if r["part"] == "network"}:
        group = [r for r in ok if r["part"] == "network" and r["straggler"] == straggler]
        ddp = next((r for r in group if r["method"] == "ddp"), None)
        if ddp is None:
            continue
        for r in group:
            r["target"] = ddp["val_acc"]
            # val_acc is rounded to 4 places, the copies' accuracies are not: reaching means within half that unit
            r["time_to_target_s"] = next((t for _, t, acc in r["evals"] if acc >= ddp["val_acc"] - 5e-5), None)
        for r in group:
            reach, ref = r["time_to_target_s"], ddp["time_to_target_s"]
            r["tta_speedup"] = round(ref / reach, 2) if reach and ref else None
    single = next((r for r in ok if r["part"] == "shared" and r["method"] == "single"), None)
    for r in (x for x in ok if x["part"] == "shared" and single is not None):
        r["vs_single"] = round(r["samples_per_s"] / single["samples_per_s"], 2)
        r["acc_vs_single"] = round(r["val_acc"] - single["val_acc"], 4)


def goals(rows: Sequence[dict[str, Any]], slowdown: float) -> list[dict[str, Any]]:
    """Issue 22's goals for each model of ``rows`` (the CNN where there are none), each ``{"goal", "met",
    "measured"}`` (``met`` None where the rows cannot tell); the goal names the model."""
    models = list(dict.fromkeys(r.get("model", "cnn") for r in rows)) or ["cnn"]
    return [g for m in models for g in _model_goals([r for r in rows if r.get("model", "cnn") == m], slowdown, m)]


def _model_goals(rows: Sequence[dict[str, Any]], slowdown: float, model: str) -> list[dict[str, Any]]:
    by = {(r["part"], r["method"], r["straggler"] is not None): r for r in rows}
    ad, ddp = by.get(("network", "adpsgd", True)), by.get(("network", "ddp", True))
    goal = f"{model}: with one rank {slowdown:g}x slower, AD-PSGD reaches DDP's final accuracy >= 2x sooner than DDP"
    if ad is None or ddp is None or ad["error"] or ddp["error"]:
        out = [{"goal": goal, "met": None, "measured": "AD-PSGD or DDP did not run with the straggler"}]
    elif ad["time_to_target_s"] is None:
        best = max((e[2] for e in ad["evals"]), default=0.0)
        out = [{"goal": goal, "met": False, "measured": f"AD-PSGD's rank 0 never reached DDP's {ddp['val_acc']:.4f} "
                f"(best {best:.4f}) within {ad['steps']} steps; DDP reached it after {ddp['time_to_target_s']:.2f} s"}]  # fmt: skip
    elif ddp["time_to_target_s"] is None:
        out = [{"goal": goal, "met": None, "measured": f"DDP's rank-0 copies never reached its own final "
                f"{ddp['val_acc']:.4f}, so there is no time to compare"}]  # fmt: skip
    else:
        out = [{"goal": goal, "met": ad["tta_speedup"] >= 2, "measured": f"AD-PSGD reached DDP's {ddp['val_acc']:.4f} "
                f"after {ad['time_to_target_s']:.2f} s, DDP after {ddp['time_to_target_s']:.2f} s "
                f"({ad['tta_speedup']:.2f}x sooner)"}]  # fmt: skip
    hog, one = by.get(("shared", "hogwild", False)), by.get(("shared", "single", False))
    goal = (f"{model}: Hogwild! on 2 processes >= 1.6x one process's samples/s, final accuracy within {ACC_TOLERANCE:g} of "
            "one process's")  # fmt: skip
    if hog is None or one is None or hog["error"] or one["error"]:
        out.append({"goal": goal, "met": None, "measured": "Hogwild! or the single process did not run"})
    else:
        out.append({"goal": goal, "met": hog["vs_single"] >= 1.6 and abs(hog["acc_vs_single"]) <= ACC_TOLERANCE,
                    "measured": f"{hog['samples_per_s']:.0f} against {one['samples_per_s']:.0f} samples/s "
                    f"({hog['vs_single']:.2f}x); val_acc {hog['val_acc']:.4f} against {one['val_acc']:.4f}; other work "
                    f"kept {hog['other_load_cores']} cores busy meanwhile"})  # fmt: skip
    return out


def not_run(rows: Sequence[dict[str, Any]]) -> list[str]:
    """What issue 22's benchmark names that did not run here, and why (fairscale's SGP: its recorded error)."""
    have = {row_name(r) for r in rows}
    out = [f"{m} {p} part: not in this run (--models, --parts)" for m in MODELS for p in PARTS
           if not any(n.startswith(f"{m}/{p}/") for n in have)]  # fmt: skip
    sgp = next((r for r in rows if r["method"] == "sgp" and r["error"]), None)
    if sgp is not None:
        out.append(f"fairscale SGP (peer): not run; {sgp['error']}")
    return out


# -- running ---------------------------------------------------------------------------------------


def run_suite(config: SuiteConfig, out: Path, command: str, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every launch of :func:`plan`; write ``out/asynchronous.{json,png}``; return the document."""
    old = json.loads(Path(config.keep_from).read_text()) if config.keep_from else None
    with SuiteRun(SUITE, config, out, command, log) as run, tempfile.TemporaryDirectory(prefix="pdist-imdb-") as data:
        doc, loopback = run.doc, run.loopback()
        if old is not None:  # refused before anything is launched when its settings differ
            keep_rows({"rows": [], "config": doc["config"]}, old, config)
        net = run.emulated(config.rate, config.world_size, config.rate) if "network" in config.parts else None
        if "text" in config.models:
            from lightning_pdist.data.imdb_synthetic import write_imdb_like

            write_imdb_like(data, TEXT_REVIEWS, config.seed)  # once, before any rank reads it
        for part, spec in plan(config, data):
            if part == "network" and net is None:
                continue
            got = run.launcher.run(WORKER, spec, spec["world_size"], net if part == "network" else loopback, errors=400)
            for row in build_rows(part, spec, got):
                doc["rows"].append(row)
                log(f"{row['model']} {part} {row['method']} n={row['world_size']} straggler={row['straggler']}: " + (row["error"] or
                    f"{row['ms_per_step']} ms/step, {row['samples_per_s']} samples/s, val_acc {row['val_acc']}"))  # fmt: skip
        if old is not None:
            keep_rows(doc, old, config)
    check_rows(doc["rows"], ROW_KEYS, SUITE)
    compare(doc["rows"])
    doc["goals"] = goals(doc["rows"], config.slowdown)
    doc["not_run"] = not_run(doc["rows"])
    return run.finish(plot)


# -- output ----------------------------------------------------------------------------------------

NETWORK_COLUMNS = (
    ("model", "model", None),
    ("method", "method", None),
    ("straggler", "straggler", lambda s: f"rank {s}"),
    ("ms/step (rank 0)", "ms_per_step", ".1f"),
    ("samples/s", "samples_per_s", ".0f"),
    ("val_acc", "val_acc", ".4f"),
    ("target (DDP's)", "target", ".4f"),
    ("s to target", "time_to_target_s", ".2f"),
    ("× sooner than DDP", "tta_speedup", ".2f"),
    ("other load", "other_load_cores", ".2f"),
)
SHARED_COLUMNS = (
    ("model", "model", None),
    ("run", "method", None),
    ("processes", "world_size", None),
    ("steps each", "steps", None),
    ("samples/s", "samples_per_s", ".0f"),
    ("× one process", "vs_single", ".2f"),
    ("val_acc", "val_acc", ".4f"),
    ("vs one process", "acc_vs_single", "+.4f"),
    ("other load", "other_load_cores", ".2f"),
)


def docs_section(doc: dict[str, Any], json_path: str) -> str:
    """The suite's section of docs/benchmarks.md, everything read from ``doc``."""
    cfg, rows = doc["config"], [{"model": "cnn", **r} for r in doc["rows"]]
    net = [r for r in rows if r["part"] == "network"]
    load = [r["other_load_cores"] for r in rows if r.get("other_load_cores") is not None]
    params = {m: next((r["model_params"] for r in rows if r["model"] == m and not r["error"]), 0) for m in MODELS}
    models = []
    if any(r["model"] == "cnn" for r in rows):
        models.append(f"cnn: digits CNN (width {cfg['width']}, {params['cnn']:,} parameters), SGD lr {cfg['lr']} momentum "
                      f"{cfg['momentum']}.")  # fmt: skip
    if any(r["model"] == "text" for r in rows):
        models.append(f"text: SparseBagClassifier, an nn.EmbeddingBag(sparse=True) table of 12,012 rows of "
                      f"{cfg['text_width']} (the mean of a review's rows) and a linear head, {params['text']:,} "
                      f"parameters, on {2 * TEXT_REVIEWS} synthetic IMDB-format training reviews (10% held out: 300); "
                      f"Adagrad, lr {cfg['text_lr']} for the table, {cfg['text_head_lr']} for the head; each "
                      "step's table gradient is a sparse tensor of the rows its batch touched.")  # fmt: skip
    lines = [*run_lines(doc, json_path), *kept_lines(doc), "",
             f"Models: {' '.join(models)} Batches of {cfg['batch_size']} per process, seed {cfg['seed']}. "
             "Each process has one core's thread (torch.set_num_threads(1)); the machine has "
             f"{doc['host']['cpus']} cores, shared with other sessions (\"other load\": the cores their work kept busy "
             "on average during the launch"
             + (f"; {min(load):.2f} to {max(load):.2f} cores in this run" if load else "") + ").", "",
             "Networks:", "", *network_lines(doc, named=True, goodput="short")]  # fmt: skip
    if net:
        lines += ["", f"Network part: {cfg['world_size']} ranks, one per emulated host, {cfg['steps']} steps per rank; "
                  f"the straggler (last rank) sleeps {cfg['slowdown'] - 1:g}× its step's wall time after each step. "
                  f"Clocks start at the end of the first step. Rank 0's model is copied every {cfg['eval_every']} steps "
                  "and evaluated on the held-out split (359 digits, 300 reviews) after the fit; \"s to target\": rank 0's training time "
                  "when its model first reached DDP's final accuracy of the same model and setting; samples/s: every rank's "
                  "samples over the slowest rank's loop (the straggler's, where it is slowest).", "",
                  markdown_table(net, NETWORK_COLUMNS)]  # fmt: skip
    shared = [r for r in rows if r["part"] == "shared"]
    if shared:
        compensated = [r["method"] for r in shared if r["model"] == "cnn" and "compensate" in r.get("what", "")]
        lowered = f"{max(0.0, cfg['momentum'] - 0.5):g}"  # 2 processes: 1 − 1/2
        lines += ["", f"Shared part (this machine, loopback): {cfg['shared_samples']} training samples per run, split "
                  "over its processes; samples/s: the samples after each process's first step over the slowest "
                  "process's training loop."
                  + (f" The CNN's {' and '.join(compensated)} rows lower each process's own momentum "
                     f"{cfg['momentum']:g} by the 1 − 1/2 that two asynchronous processes add (implicit_momentum="
                     f"'compensate': {lowered}); one process and DDP keep {cfg['momentum']:g}." if compensated else ""), "",
                  markdown_table(shared, SHARED_COLUMNS)]  # fmt: skip
    lines += failed_lines(rows, lambda r: f"{r['model']} {r['part']} {r['method']} (straggler {r['straggler']})")
    lines += ["", "Goals (issue 22):", "", *goal_lines(doc["goals"]), *not_run_lines(doc)]
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: str | Path) -> Path:
    """Rank 0's accuracy against training time, without (dashed) and with (solid) the straggler; samples/s of the
    shared-memory runs."""
    ok = [r for r in doc["rows"] if not r["error"]]
    fig, (ax_acc, ax_rate) = subplots(1, 2, figsize=(13, 5))
    colors = {m: f"C{i}" for i, m in enumerate(dict.fromkeys(r["method"] for r in ok))}
    marks = {"cnn": ".", "text": "x"}
    for r in (x for x in ok if x["part"] == "network" and x["evals"]):
        model = r.get("model", "cnn")
        ax_acc.plot([e[1] for e in r["evals"]], [e[2] for e in r["evals"]], marker=marks[model], color=colors[r["method"]],
                    linestyle="-" if r["straggler"] is not None else "--",
                    label=f"{model} {r['method']}" + (" (straggler)" if r["straggler"] is not None else ""))  # fmt: skip
    ax_acc.set_xlabel(f"training time (s, rank 0), {doc['config']['rate']} links")
    ax_acc.set_ylabel("validation accuracy (rank 0's model)")
    ax_acc.grid(True, alpha=0.3)
    if ax_acc.lines:
        ax_acc.legend(fontsize=7)
    shared = [r for r in ok if r["part"] == "shared"]
    ax_rate.barh([f"{r.get('model', 'cnn')} {r['method']} ×{r['world_size']}" for r in shared], [r["samples_per_s"] for r in shared])
    ax_rate.invert_yaxis()
    ax_rate.set_xlabel("training samples per second (this machine)")
    ax_rate.grid(True, axis="x", alpha=0.3)
    return save_figure(fig, path, title=f"asynchronous suite, {doc['created']}")


CLI = SuiteCli(config=SuiteConfig, quick=QUICK, full=FULL, out="asynchronous.json, asynchronous.png and docs_section.md",
               either={"parts": PARTS})  # fmt: skip

run = documented_run(SUITE, run_suite, docs_section)
