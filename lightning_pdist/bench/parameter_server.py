"""Parameter-server family suite: async EASGD vs Downpour vs sync EASGD with a straggler, Sandblaster L-BFGS vs
one-process L-BFGS vs SGD DDP, Parallax vs DDP vs the plain PS on a large embedding table (issue 23).

``python -m lightning_pdist.bench parameter_server [--quick] --out DIR [--parts easgd sandblaster parallax]``
writes ``DIR/parameter_server.json`` (one row per part, task and method), ``DIR/parameter_server.png`` and
``DIR/docs_section.md``. Every rank is a real process (:mod:`~lightning_pdist.bench.ps_family_worker`); the
strategies start their own servers, authenticated, server ``i`` on rank ``i``'s host.

* ``easgd`` (loopback, ``--easgd-workers`` ranks, digits CNN, SGD with momentum): ``ps_easgd``
  (``ParameterServerStrategy(mode="easgd")``), ``downpour`` (``mode="async"``) and ``sync_easgd``
  (``EASGDStrategy``, all-reduce), the last rank a straggler ``--slow-factor`` times slower (it sleeps that
  many times its own forward + backward, less one, before every batch). ``time_to_target_s``: rank 0's training
  time when the model it holds first reached ``--target-acc`` (evaluated every ``--eval-every`` steps).
* ``sandblaster`` (loopback): ``sandblaster`` on ``--sandblaster-workers`` ranks, ``lbfgs`` (torch's LBFGS in one
  process, the same settings: the reference it must equal) and ``sgd_ddp`` (momentum SGD, the batch split over
  the ranks), each on ``logreg`` (convex) and ``mlp`` (non-convex), the same global batch per step.
* ``parallax`` (``--parallax-workers`` hosts on emulated ``--rate`` links): ``parallax``, ``ddp`` and ``ps`` (sync)
  train the same bag-of-embeddings model (``--vocab`` rows: the table is nearly all of it) with SGD on generated
  token ids (:func:`~lightning_pdist.bench.ps_family_worker.text_data`). ``bytes_per_step``: what a rank's strategy
  counted it sent per step (mean over ranks); ``kernel_tx_per_step``: the busiest host's veth ``tx_bytes`` per
  step (servers included); ``ms_per_step``: slowest rank, after ``--warmup-steps``.

``doc["goals"]`` judges the issue's goal (Parallax at least 3x DDP's step rate, equal accuracy) from the rows,
``doc["findings"]`` states the other comparisons the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from lightning_pdist.bench.cli import SuiteCli, SuiteRules
from lightning_pdist.bench.launch import SuiteRun
from lightning_pdist.bench.netns import LOOPBACK, parse_rate
from lightning_pdist.bench.report import (documented_run, earlier_run, goal_lines, markdown_table, network_lines,
                                          run_lines, save_figure, subplots)  # fmt: skip

SUITE = "parameter_server"
PARTS = ("easgd", "sandblaster", "parallax")
PART_METHODS = {"easgd": ("ps_easgd", "downpour", "sync_easgd"), "sandblaster": ("sandblaster", "lbfgs", "sgd_ddp"),
                "parallax": ("parallax", "ddp", "ps")}  # fmt: skip
SANDBLASTER_TASKS = ("logreg", "mlp")
QUICK = {"easgd_workers": 2, "easgd_steps": 30, "sandblaster_steps": 8, "parallax_workers": 2, "parallax_steps": 4}
FULL = {"easgd_workers": 4, "easgd_steps": 120, "sandblaster_steps": 30, "parallax_workers": 4, "parallax_steps": 10}
PARALLAX_GOAL = 3.0  # issue 23: Parallax >= 3x DDP's step rate
EQUAL_ACC = 0.01  # accuracy within 1 point of DDP's counts as equal


@dataclass(frozen=True)
class SuiteConfig(SuiteRules):
    """Everything that decides what the suite runs; validated on construction (``ValueError`` names the option)."""

    parts: tuple[str, ...] = PARTS
    """easgd, sandblaster, parallax (one or more)"""
    methods: tuple[str, ...] = tuple(m for part in PARTS for m in PART_METHODS[part])
    """the methods of those parts to run"""
    sandblaster_tasks: tuple[str, ...] = SANDBLASTER_TASKS
    """logreg (convex), mlp (non-convex) or both"""
    easgd_workers: int = QUICK["easgd_workers"]
    """ranks of the EASGD part (the last is the straggler)"""
    easgd_steps: int = QUICK["easgd_steps"]
    """optimizer steps per rank, EASGD part"""
    period: int = 4
    """τ, local steps between elastic exchanges (both EASGD methods)"""
    slow_factor: float = 3.0
    """the straggler's slowdown of its forward + backward"""
    target_acc: float = 0.9
    """validation accuracy whose time is compared, EASGD part"""
    eval_every: int = 10
    """steps between rank 0's evaluations (EASGD and Sandblaster parts)"""
    sandblaster_workers: int = 2
    """ranks of sandblaster and sgd_ddp"""
    sandblaster_steps: int = QUICK["sandblaster_steps"]
    """optimizer steps per task and method, Sandblaster part"""
    lbfgs_batch: int = 256
    """global batch per step, Sandblaster part (sgd_ddp splits it over the ranks)"""
    lbfgs_lr: float = 0.5
    """L-BFGS lr (sandblaster and lbfgs)"""
    parallax_workers: int = QUICK["parallax_workers"]
    """ranks (emulated hosts) of the Parallax part"""
    parallax_steps: int = QUICK["parallax_steps"]
    """optimizer steps, Parallax part, --warmup-steps of them untimed"""
    rate: str = "100mbit"
    """emulated link rate of the Parallax part, both ways"""
    vocab: int = 200_000
    """rows of the embedding table"""
    embed_dim: int = 32
    """embedding width"""
    seq_len: int = 128
    """tokens per review"""
    text_lr: float = 1.0
    """SGD lr of the text model"""
    warmup_steps: int = 2
    """untimed steps of every run"""
    batch_size: int = 32
    """per rank, EASGD and Parallax parts"""
    lr: float = 0.05
    """SGD lr, EASGD part and sgd_ddp"""
    momentum: float = 0.9
    """SGD momentum, EASGD part and sgd_ddp"""
    seed: int = 0
    """seed of weights and data"""
    timeout: float = 600.0
    """seconds per launch"""
    keep_from: str = ""
    """an earlier parameter_server.json: its rows of the parts not in --parts are kept, with that run's command and time"""
    quick: bool = True
    SUITE: ClassVar[str] = SUITE

    def __post_init__(self) -> None:
        self.distinct("parts", PARTS)
        self.distinct("methods", tuple(m for part in PARTS for m in PART_METHODS[part]))
        self.distinct("sandblaster_tasks", SANDBLASTER_TASKS)
        self.ints("easgd_workers", "sandblaster_workers", "parallax_workers", low=2)
        self.ints("easgd_steps", "sandblaster_steps", "parallax_steps", "period", "eval_every", "lbfgs_batch",
                  "vocab", "embed_dim", "seq_len", "batch_size")  # fmt: skip
        self.ints("warmup_steps", "seed", low=0)
        for name in ("easgd_steps", "sandblaster_steps", "parallax_steps"):
            if getattr(self, name) <= self.warmup_steps:
                raise self.bad(name, getattr(self, name), f"must exceed --warmup-steps={self.warmup_steps}")
        if self.lbfgs_batch % self.sandblaster_workers:
            raise self.bad("lbfgs_batch", self.lbfgs_batch, f"must divide by --sandblaster-workers={self.sandblaster_workers}")
        if not self.slow_factor >= 1:
            raise self.bad("slow_factor", self.slow_factor, "must be >= 1 (1: no straggler)")
        if not 0 < self.target_acc <= 1:
            raise self.bad("target_acc", self.target_acc, "must be in (0, 1]")
        self.positive("lbfgs_lr", "text_lr", "lr", "timeout")
        if not 0 <= self.momentum < 1:
            raise self.bad("momentum", self.momentum, "must be in [0, 1)")
        parse_rate(self.rate)  # raises with the rule
        if self.keep_from and not Path(self.keep_from).is_file():
            raise self.bad("keep_from", self.keep_from, "must be a parameter_server.json written by this suite")


def worker_spec(config: SuiteConfig, method: str, task: str) -> dict[str, Any]:
    """The :mod:`~lightning_pdist.bench.ps_family_worker` spec of one launch (validated)."""
    from lightning_pdist.bench.ps_family_worker import METHODS, check_spec

    part, c = METHODS[method][0], config
    spec = {"method": method, "task": task, "warmup_steps": c.warmup_steps, "seed": c.seed, "period": c.period,
            "eval_every": c.eval_every, "slow_rank": None, "slow_factor": 1.0, "vocab": c.vocab, "embed_dim": c.embed_dim,
            "seq_len": c.seq_len, "lr": c.lr, "momentum": c.momentum, "batch_size": c.batch_size}  # fmt: skip
    if part == "easgd":
        spec.update(world_size=c.easgd_workers, steps=c.easgd_steps, slow_rank=c.easgd_workers - 1, slow_factor=c.slow_factor)
    elif part == "sandblaster":
        lbfgs = method != "sgd_ddp"
        spec.update(world_size=1 if method == "lbfgs" else c.sandblaster_workers, steps=c.sandblaster_steps,
                    batch_size=c.lbfgs_batch, lr=c.lbfgs_lr if lbfgs else c.lr, momentum=0.0 if lbfgs else c.momentum)  # fmt: skip
    else:
        spec.update(world_size=c.parallax_workers, steps=c.parallax_steps, lr=c.text_lr, momentum=0.0)
    spec["samples"] = spec["batch_size"] * spec["world_size"] * spec["steps"]
    return check_spec(spec)


# -- rows ---------------------------------------------------------------------------------------


def build_row(ranks: Sequence[dict[str, Any]], network: str, other_load: float | None, target_acc: float) -> dict[str, Any]:
    """One row from the ranks' results of one launch (rank 0 first)."""
    from lightning_pdist.bench.ps_family_worker import METHODS

    first, slow = ranks[0], [r for r in ranks if r["slow_sleep_s"] > 0]
    fast = [r for r in ranks if r["slow_sleep_s"] == 0]
    kernel = [r["kernel_tx_per_step"] for r in ranks]
    return {
        "part": METHODS[first["method"]][0], "method": first["method"], "what": METHODS[first["method"]][1],
        "task": first["task"], "network": network, "world_size": first["world_size"], "params": first["params"],
        "steps": first["train_steps"], "timed_steps": first["timed_steps"],
        "ms_per_step": max(r["ms_per_step"] for r in ranks),
        "fast_ms_per_step": round(sum(r["ms_per_step"] for r in fast) / len(fast), 3),
        "straggler_ms_per_step": slow[0]["ms_per_step"] if slow else None,
        "loop_s": max(r["loop_s"] for r in ranks),
        "bytes_per_step": round(sum(r["bytes_per_step"] for r in ranks) / len(ranks), 1),
        "kernel_tx_per_step": max(kernel) if all(k is not None for k in kernel) else None,
        "rows_per_step": first["rows_per_step"],
        "val_acc": round(first["val_acc"], 4), "train_loss": first["train_loss"], "evals": first["evals"],
        "time_to_target_s": next((t for _, t, acc, _ in first["evals"] if acc >= target_acc), None),
        "other_load_cores": other_load,
    }  # fmt: skip


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row against its part's baseline of the same task (in place): DDP for Parallax, LBFGS for Sandblaster."""
    base = {"parallax": "ddp", "sandblaster": "lbfgs", "easgd": "sync_easgd"}
    for row in rows:
        ref = next((r for r in rows if r["part"] == row["part"] and r["task"] == row["task"]
                    and r["method"] == base[row["part"]]), None)  # fmt: skip
        row["vs"] = ref["method"] if ref else None
        row["step_rate_x"] = round(ref["ms_per_step"] / row["ms_per_step"], 2) if ref else None
        row["acc_vs"] = round(row["val_acc"] - ref["val_acc"], 4) if ref else None
        row["loss_vs"] = round(row["train_loss"] - ref["train_loss"], 5) if ref else None
    return rows


def goals(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 23's goal for these rows, ``{"goal", "met", "measured"}`` (``met`` None where not run)."""
    by = {r["method"]: r for r in rows if r["part"] == "parallax"}
    goal = f"Parallax >= {PARALLAX_GOAL:g}x DDP's step rate on the large-embedding model, equal accuracy (within {EQUAL_ACC})"
    if "parallax" not in by or "ddp" not in by:
        return [{"goal": goal, "met": None, "measured": "the parallax part did not run"}]
    p, d = by["parallax"], by["ddp"]
    met = p["step_rate_x"] >= PARALLAX_GOAL and abs(p["acc_vs"]) <= EQUAL_ACC
    return [{"goal": goal, "met": met, "measured": (
        f"{p['ms_per_step']:.1f} ms per step against DDP's {d['ms_per_step']:.1f} ms ({p['step_rate_x']:.2f}x the step "
        f"rate) on {p['network']}, {p['world_size']} workers; val_acc {p['val_acc']:.4f} against {d['val_acc']:.4f}; "
        f"{p['bytes_per_step']:,.0f} B sent per worker and step against {d['bytes_per_step']:,.0f}")}]  # fmt: skip


def findings(rows: Sequence[dict[str, Any]], target_acc: float) -> list[str]:
    """The other comparisons, as sentences built from the rows."""
    out = []
    easgd = [r for r in rows if r["part"] == "easgd"]
    if easgd:
        def tta(r: dict[str, Any]) -> str:
            return f"{r['time_to_target_s']:.2f} s" if r["time_to_target_s"] is not None else "never"
        out.append(f"Straggler runs, time for rank 0's model to reach val_acc {target_acc}: "
                   + "; ".join(f"{r['method']} {tta(r)} (final {r['val_acc']:.4f}, fast ranks {r['fast_ms_per_step']:.1f} "
                               f"ms/step, straggler {r['straggler_ms_per_step'] or 0:.1f})" for r in easgd))  # fmt: skip
    for task in SANDBLASTER_TASKS:
        by = {r["method"]: r for r in rows if r["part"] == "sandblaster" and r["task"] == task}
        if "sandblaster" in by and "lbfgs" in by:
            s, lb = by["sandblaster"], by["lbfgs"]
            sgd = f"; sgd_ddp {by['sgd_ddp']['train_loss']:.5f}" if "sgd_ddp" in by else ""
            out.append(f"{task}: training loss after {s['steps']} steps: sandblaster {s['train_loss']:.5f}, one-process "
                       f"LBFGS {lb['train_loss']:.5f} (difference {s['loss_vs']:+.2e}){sgd}")  # fmt: skip
    return out


# -- running ------------------------------------------------------------------------------------


def run_suite(config: SuiteConfig, out: Path, command: str, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the parts of ``config``; write ``out/parameter_server.{json,png}``; return the document."""
    run = SuiteRun(SUITE, config, out, command, log)
    doc = run.doc
    chosen = lambda part: [m for m in PART_METHODS[part] if part in config.parts and m in config.methods]  # noqa: E731

    def launch(method: str, task: str, net: Any, network: str) -> None:
        spec = worker_spec(config, method, task)
        got = run.launcher.run("lightning_pdist.bench.ps_family_worker", spec, spec["world_size"], net)
        row = build_row(got.results, network, got.other_load_cores, config.target_acc)
        doc["rows"].append(row)
        log(f"[{row['part']}] {method} {task}: {row['ms_per_step']:.1f} ms/step, {row['bytes_per_step']:,.0f} B/step, "
            f"val_acc {row['val_acc']:.4f}, loss {row['train_loss']:.4f}, run {got.wall_s:.1f} s")  # fmt: skip

    with run:
        if {"easgd", "sandblaster"} & set(config.parts):
            run.loopback("127.0.0.1, no shaping")
        for method in chosen("easgd"):
            launch(method, "cnn", LOOPBACK, "loopback")
        for task in config.sandblaster_tasks if chosen("sandblaster") else ():
            for method in chosen("sandblaster"):
                launch(method, task, LOOPBACK, "loopback")
        for network, net, _ in run.networks(("emulated",) if chosen("parallax") else (), (config.rate,), config.parallax_workers):
            for method in chosen("parallax"):
                launch(method, "text", net, network)
    if config.keep_from:
        keep(doc, config)
    compare(doc["rows"])
    doc["goals"], doc["findings"] = goals(doc["rows"]), findings(doc["rows"], config.target_acc)
    return run.finish(plot)


def keep(doc: dict[str, Any], config: SuiteConfig) -> None:
    """Add the rows (and networks) of the parts not run from ``config.keep_from`` (in place), recording that run."""
    old = earlier_run(SUITE, config.keep_from)
    kept = [r for r in old["rows"] if r["part"] not in config.parts]
    doc["kept"] = {"parts": sorted({r["part"] for r in kept}, key=PARTS.index), "created": old["created"],
                   "command": old["command"], "loadavg_1m_at_start": old["host"]["loadavg_1m_at_start"]}  # fmt: skip
    for row in kept:
        doc["networks"].setdefault(row["network"], old["networks"][row["network"]])
    doc["rows"] = sorted(doc["rows"] + kept, key=lambda r: PARTS.index(r["part"]))


# -- output -------------------------------------------------------------------------------------

COMMON = (("method", "method", None), ("task", "task", None), ("ranks", "world_size", None), ("steps", "steps", None))
PART_COLUMNS = {
    "easgd": (*COMMON, ("fast ms/step", "fast_ms_per_step", ".1f"), ("straggler ms/step", "straggler_ms_per_step", ".1f"),
              ("B/step", "bytes_per_step", ",.0f"), ("s to target", "time_to_target_s", ".2f"),
              ("run s", "loop_s", ".2f"), ("val_acc", "val_acc", ".4f"), ("other load", "other_load_cores", ".2f")),
    "sandblaster": (*COMMON, ("ms/step", "ms_per_step", ".1f"), ("B/step", "bytes_per_step", ",.0f"),
                    ("train loss", "train_loss", ".5f"), ("loss − LBFGS", "loss_vs", "+.2e"), ("val_acc", "val_acc", ".4f"),
                    ("other load", "other_load_cores", ".2f")),
    "parallax": (("method", "method", None), ("ranks", "world_size", None), ("params", "params", ",d"),
                 ("ms/step", "ms_per_step", ".1f"), ("× DDP's step rate", "step_rate_x", ".2f"),
                 ("B/step", "bytes_per_step", ",.0f"), ("kernel tx B/step", "kernel_tx_per_step", ",.0f"),
                 ("rows/step", "rows_per_step", ",.0f"), ("val_acc", "val_acc", ".4f"), ("vs DDP", "acc_vs", "+.4f"),
                 ("other load", "other_load_cores", ".2f")),
}  # fmt: skip
PART_TITLES = {"easgd": "Async EASGD vs Downpour vs sync EASGD, one straggler (digits CNN, loopback)",
               "sandblaster": "Sandblaster L-BFGS vs one-process L-BFGS vs SGD DDP (digits, loopback)",
               "parallax": "Parallax vs DDP vs the plain PS, large embedding table"}  # fmt: skip


def docs_section(doc: dict[str, Any], json_path: str) -> str:
    """The suite's section of docs/benchmarks.md, everything read from ``doc``."""
    cfg = doc["config"]
    lines = [*run_lines(doc, json_path)]
    if doc.get("kept"):
        k = doc["kept"]
        lines += [f"Rows of the {' and '.join(k['parts'])} parts kept from the run of {k['created']} (`{k['command']}`, "
                  f"1-min load average {k['loadavg_1m_at_start']} at its start)."]  # fmt: skip
    lines += ["", "Networks:", "", *network_lines(doc, goodput="short")]
    notes = {"easgd": f"the last rank sleeps {cfg['slow_factor'] - 1:g}x its own forward + backward before every batch "
                      f"({cfg['slow_factor']:g}x slower); τ = {cfg['period']}, SGD lr {cfg['lr']} momentum "
                      f"{cfg['momentum']}, batch {cfg['batch_size']} per rank; 's to target': rank 0's training time "
                      f"until the model it holds reached val_acc {cfg['target_acc']}; val_acc: the model fit leaves.",
             "sandblaster": f"global batch {cfg['lbfgs_batch']} per step; L-BFGS lr {cfg['lbfgs_lr']}, history 10, "
                            f"max_iter 1, no line search; sgd_ddp: SGD lr {cfg['lr']} momentum {cfg['momentum']}; "
                            "train loss: the whole training split, after the last step.",
             "parallax": f"vocabulary {cfg['vocab']:,} x {cfg['embed_dim']}, {cfg['seq_len']} tokens per review, batch "
                         f"{cfg['batch_size']} per rank, SGD lr {cfg['text_lr']}; {cfg['warmup_steps']} untimed steps; "
                         "B/step: each rank's own count of what it sent; kernel tx: the busiest host's veth, servers included."}  # fmt: skip
    for part in PARTS:
        rows = [r for r in doc["rows"] if r["part"] == part]
        if rows:
            lines += ["", f"### {PART_TITLES[part]}", "", notes[part], "", markdown_table(rows, PART_COLUMNS[part])]
    lines += ["", "Goal (issue 23):", "", *goal_lines(doc["goals"])]
    lines += ["", "Findings:", "", *[f"- {f}." for f in doc["findings"]]]
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: str | Path) -> Path:
    """Accuracy against time with the straggler; training loss against steps; ms per step of the Parallax rows."""
    fig, axes = subplots(1, 3, figsize=(16, 4.6))
    for row in doc["rows"]:
        if row["part"] == "easgd" and row["evals"]:
            axes[0].plot([e[1] for e in row["evals"]], [e[2] for e in row["evals"]], marker=".", label=row["method"])
        if row["part"] == "sandblaster" and row["evals"]:
            axes[1].plot([e[0] for e in row["evals"]], [e[3] for e in row["evals"]], marker=".",
                         linestyle="-" if row["task"] == "logreg" else "--", label=f"{row['method']} {row['task']}")  # fmt: skip
    axes[0].set(xlabel="training time, rank 0 (s)", ylabel="val_acc", title="EASGD part: one straggler")
    axes[1].set(xlabel="step", ylabel="training loss", yscale="log", title="Sandblaster part")
    bars = [r for r in doc["rows"] if r["part"] == "parallax"]
    axes[2].bar([r["method"] for r in bars], [r["ms_per_step"] for r in bars], color="tab:blue")
    axes[2].set(ylabel="ms per step (slowest rank)", yscale="log", title="Parallax part: " + (bars[0]["network"] if bars else "not run"))
    for ax in axes[:2]:
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    return save_figure(fig, path, title=f"parameter_server suite, {doc['created']}")


# -- command line -------------------------------------------------------------------------------

CLI = SuiteCli(config=SuiteConfig, quick=QUICK, full=FULL, out="parameter_server.json and parameter_server.png")

run = documented_run(SUITE, run_suite, docs_section)
