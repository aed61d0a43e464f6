"""Sign suite: paper 004 Fig. 1 (signSGD-MV vs IT-signSGD over batch modes) and the comm-hook benchmark.

``python -m lightning_pdist.bench sign [--quick] --out DIR [--parts repro comm] [--data-dir D]
[--network loopback|emulated|both] [--rates 100mbit 1gbit] [--world-size 2 4]`` writes:

* ``DIR/sign.json``: ``repro.rows`` (one per run and evaluation: ``{"dataset", "method",
  "batch_mode", "small_batch_workers", "seed", "round", "val_acc"}``), ``repro.summary`` (mean ± std
  of the final accuracy per method and mode, and IT-signSGD's paired gain over the majority vote),
  ``repro.diagnosis`` (how reliable each batch size's signs are, truly and as eq. 4 sees them), and
  ``rows`` (Part B, one per hook, world size and network: ``{"hook", "world_size", "network", "rate",
  "params", "bytes_per_rank_per_step", "kernel_tx_bytes_per_rank_per_step", "ms_per_step",
  "speedup_vs_fp32", ...}``);
* ``DIR/sign.png``: accuracy vs round per batch mode (both methods, mean and min–max over seeds),
  and time and bytes per step per hook and network.

Part A (:mod:`~lightning_pdist.bench.sign_repro`) runs ``M = 15`` logical workers in one process
with the simulator that the tests check against real gloo ranks; batch modes 1–4 put 0, 9, 12 and
14 workers at ``B = 4`` and the rest at ``--large-batch`` (64). Datasets: scikit-learn's digits
(an MNIST-like stand-in, always), plus MNIST and CIFAR-10 when ``--data-dir`` holds them.

Part B (:mod:`~lightning_pdist.bench.sign_comm`) times plain DDP with fp32 all-reduce (no hook),
``fp16_compress_hook``, ``powerSGD_hook`` and our ``signsgd_mv_hook`` / ``it_signsgd_hook`` on a
``MLP(1024, hidden=4096)`` (4.24M parameters, 17 MB fp32), each rank a process, on loopback and on
emulated links (network namespaces, ``tc tbf`` at each ``--rates`` value both ways). Without
root/iproute2 the emulated part is skipped with the reason.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from lightning_pdist.bench.cli import SuiteCli, SuiteRules
from lightning_pdist.bench.launch import SuiteRun
from lightning_pdist.bench.netns import parse_rate
from lightning_pdist.bench.report import documented_run, markdown_table, network_lines, pyplot, run_lines, save_figure
from lightning_pdist.bench.sign_repro import BATCH_MODES, DATASETS
from lightning_pdist.bench.sign_worker import HOOKS

SUITE = "sign"
PARTS = ("repro", "comm")
NETWORKS = ("loopback", "emulated")
ESTIMATORS = ("coordinate", "tensor", "worker")
COMM_ROW_KEYS = ("hook", "world_size", "network", "rate", "params", "bytes_per_rank_per_step",
                 "kernel_tx_bytes_per_rank_per_step", "ms_per_step")  # fmt: skip
REPRO_ROW_KEYS = ("method", "batch_mode", "small_batch_workers", "seed", "round", "val_acc")
# The two plans; everything else has one default for both. Quick: < 10 minutes for both parts on 2 cores.
QUICK = {"seeds": (0, 1), "rounds": 200, "eval_every": 20, "world_sizes": (2,), "rates": ("100mbit",), "steps": 5}
FULL = {"seeds": (0, 1, 2, 3, 4), "rounds": 500, "eval_every": 25, "world_sizes": (2, 4),
        "rates": ("100mbit", "1gbit"), "steps": 10}  # fmt: skip


@dataclass(frozen=True)
class SuiteConfig(SuiteRules):
    """Everything that decides what the suite runs; validated on construction (``ValueError`` names the option)."""

    parts: tuple[str, ...] = PARTS
    """repro (Part A), comm (Part B) or both"""
    # Part A
    datasets: tuple[str, ...] = ("digits",)
    """Part A datasets (with --data-dir and no --datasets: digits mnist cifar10)"""
    data_dir: str | None = None
    """folder with MNIST/CIFAR-10 files; each found set is added to Part A"""
    batch_modes: tuple[int, ...] = tuple(BATCH_MODES)
    """paper's batch modes, 1-4"""
    seeds: tuple[int, ...] = QUICK["seeds"]
    """Part A seeds"""
    rounds: int = QUICK["rounds"]
    """Part A rounds"""
    eval_every: int = QUICK["eval_every"]
    """rounds between evaluations"""
    num_workers: int = 15
    """logical workers M"""
    small_batch: int = 4
    """small batch B"""
    large_batch: int = 64
    """the other workers' batch"""
    lr: float = 0.002
    """step size δ"""
    hidden: int = 128
    """Part A MLP hidden units"""
    warmup_rounds: int = 10
    """IT-signSGD majority rounds"""
    estimator: str = "worker"
    """IT-signSGD estimator, one of coordinate tensor worker"""
    # Part B
    networks: tuple[str, ...] = NETWORKS
    """Part B networks"""
    rates: tuple[str, ...] = QUICK["rates"]
    """emulated link rates"""
    world_sizes: tuple[int, ...] = QUICK["world_sizes"]
    """Part B ranks"""
    hooks: tuple[str, ...] = HOOKS
    """Part B hooks"""
    steps: int = QUICK["steps"]
    """Part B timed steps"""
    warmup_steps: int = 3
    """Part B untimed steps"""
    batch_size: int = 32
    """Part B batch per rank"""
    in_features: int = 1024
    """Part B MLP input features"""
    comm_hidden: int = 4096
    """Part B MLP hidden units"""
    powersgd_rank: int = 4
    """PowerSGD rank"""
    timeout: float = 600.0
    """seconds per Part B run"""
    quick: bool = True
    SUITE: ClassVar[str] = SUITE
    FLAGS: ClassVar[dict[str, str]] = {"networks": "--network", "world_sizes": "--world-size"}

    def __post_init__(self) -> None:
        bad = self.bad

        def distinct(option: str, values: tuple, allowed: Sequence | None = None) -> None:
            if not values:
                raise bad(option, values, "give at least one value")
            if allowed is not None and any(v not in allowed for v in values):
                raise bad(option, values, f"each value must be one of {tuple(allowed)}")
            if len(set(values)) != len(values):
                raise bad(option, values, "values must not repeat")

        distinct("--parts", self.parts, PARTS)
        distinct("--datasets", self.datasets, DATASETS)
        if any(d != "digits" for d in self.datasets) and self.data_dir is None and "repro" in self.parts:
            raise bad("--datasets", self.datasets, "mnist and cifar10 are read from local files; give --data-dir")
        distinct("--batch-modes", self.batch_modes, tuple(BATCH_MODES))
        distinct("--seeds", self.seeds)
        if any(not isinstance(s, int) or s < 0 for s in self.seeds):
            raise bad("--seeds", self.seeds, "each seed must be an int >= 0")
        self.ints("rounds", "eval_every", "large_batch", "small_batch", "hidden", "steps", "batch_size", "comm_hidden",
                  "powersgd_rank")  # fmt: skip
        if not isinstance(self.num_workers, int) or self.num_workers < max(BATCH_MODES.values()) + 1:
            raise bad("--num-workers", self.num_workers, f"must be an int >= {max(BATCH_MODES.values()) + 1} "
                      "(batch mode 4 puts 14 workers at the small batch and needs one more)")  # fmt: skip
        if self.eval_every > self.rounds:
            raise bad("--eval-every", self.eval_every, f"must be <= --rounds ({self.rounds})")
        self.positive("lr")
        if not isinstance(self.warmup_rounds, int) or self.warmup_rounds < 0:
            raise bad("--warmup-rounds", self.warmup_rounds, "must be an int >= 0")
        if self.estimator not in ESTIMATORS:
            raise bad("--estimator", self.estimator, f"must be one of {ESTIMATORS}")
        distinct("--network", self.networks, NETWORKS)
        distinct("--rates", self.rates)
        for rate in self.rates:
            try:
                parse_rate(rate)
            except ValueError:
                raise bad("--rates", rate, "each rate must look like '100mbit' or '1gbit'") from None
        distinct("--world-size", self.world_sizes)
        for ws in self.world_sizes:
            if isinstance(ws, bool) or not isinstance(ws, int) or not 2 <= ws <= 16:
                raise bad("--world-size", ws, "world_size must be an int in [2, 16] (a vote needs 2+ ranks)")
        distinct("--hooks", self.hooks, HOOKS)
        if "powersgd" in self.hooks and self.warmup_steps < 3:
            raise bad("--warmup-steps", self.warmup_steps, "must be >= 3 with powersgd (it compresses from step 2)")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise bad("--warmup-steps", self.warmup_steps, "must be an int >= 0")
        self.positive("timeout", unit=" seconds")


def run_suite(config: SuiteConfig, out: Path, command: str, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the requested parts; write ``out/sign.{json,png}``; return the document."""
    from lightning_pdist.bench.sign_comm import run_comm
    from lightning_pdist.bench.sign_repro import run_repro

    with SuiteRun(SUITE, config, out, command, log, port=29599) as run:
        doc = run.doc
        doc["repro"] = None
        if "repro" in config.parts:
            t0 = time.perf_counter()
            doc["repro"] = run_repro(config, log)
            doc["repro"]["wall_s"] = round(time.perf_counter() - t0, 1)
        if "comm" in config.parts:
            t0 = time.perf_counter()
            doc["rows"] = run_comm(config, run)
            doc["comm_wall_s"] = round(time.perf_counter() - t0, 1)
    return run.finish(plot)


# -- output -------------------------------------------------------------------------------------

SUMMARY_COLUMNS = (
    ("dataset", "dataset", None), ("mode", "batch_mode", None), ("B=4 workers", "small_batch_workers", None),
    ("method", "method", None), ("seeds", "seeds", None), ("round", "final_round", None),
    ("final val_acc", "final_val_acc_mean", ".4f"), ("± std", "final_val_acc_std", ".4f"),
    ("gain vs MV", "gain_vs_majority", "+.4f"),
    ("gain per seed", "gain_by_seed", lambda xs: " ".join(f"{x:+.3f}" for x in xs)),
)  # fmt: skip
COMM_COLUMNS = (
    ("network", "network", None), ("rate", "rate", None), ("ranks", "world_size", None), ("hook", "hook", None),
    ("logged MB/rank/step", "bytes_per_rank_per_step", lambda b: f"{b / 1e6:.3f}"),
    ("kernel tx MB/rank/step", "kernel_tx_bytes_per_rank_per_step", lambda b: f"{b / 1e6:.3f}"),
    ("tx/logged", "kernel_tx_ratio", ".3f"), ("ms/step", "ms_per_step", ".1f"),
    ("compute ms", "compute_ms_per_step", ".1f"), ("speedup vs fp32", "speedup_vs_fp32", ".2f"),
    ("other load", "other_load_cores", ".2f"),
)  # fmt: skip


def diagnosis_lines(repro: dict[str, Any]) -> list[str]:
    """One line per diagnosed mode: each batch size's error rate against the vote (eq. 4) and against the truth."""
    lines = []
    for d in repro.get("diagnosis", []):
        parts = [f"{k} ({v['workers']} workers): p vs vote {v['p_vs_majority']:.3f}, p vs full-batch sign "
                 f"{v['p_vs_full_batch']:.3f}, exact zeros {v['zero_fraction']:.3f}"
                 for k, v in d["by_batch_size"].items()]  # fmt: skip
        lines.append(f"- {d['dataset']} mode {d['batch_mode']} (signSGD-MV model after {d['round']} rounds, "
                     f"seed {d['seed']}): " + "; ".join(parts))  # fmt: skip
        sizes = sorted(d["by_batch_size"], key=lambda k: int(k[2:]))
        small, large = d["by_batch_size"][sizes[0]], d["by_batch_size"][sizes[-1]]
        hidden = large["p_vs_majority"] >= small["p_vs_majority"] - 0.02
        lines.append(
            f"  - {sizes[-1]} is truly more reliable ({large['p_vs_full_batch']:.3f} vs {small['p_vs_full_batch']:.3f} "
            f"errors against the full-batch sign), but eq. 4 measures it against the vote: "
            f"{large['p_vs_majority']:.3f} vs {small['p_vs_majority']:.3f}"
            + (f", {'no better' if hidden else 'better'} than {sizes[0]}; weights "
               + _weights_note(repro, d["dataset"], d["batch_mode"], d["seed"]))  # fmt: skip
        )
    return lines


def _weights_note(repro: dict[str, Any], dataset: str, mode: int, seed: int) -> str:
    """IT-signSGD's final LLR weights of one run, as ``B=4 mean w, B=64 mean w``."""
    run = next((r for r in repro.get("runs", []) if r["dataset"] == dataset and r["batch_mode"] == mode
                and r["seed"] == seed and r["method"] == "it_signsgd"), None)  # fmt: skip
    weights = None if run is None else run.get("final_llr_weights")
    if not weights or len(weights) != repro_workers(repro):
        return "not recorded"
    k = BATCH_MODES[mode]
    small, large = weights[:k], weights[k:]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return f"at the end of the IT-signSGD run: B=4 workers {mean(small):.3f}, the others {mean(large):.3f}"


def repro_workers(repro: dict[str, Any]) -> int:
    """M of a Part A document: the number of final LLR weights of its runs (15 unless configured otherwise)."""
    counts = [len(r["final_llr_weights"]) for r in repro.get("runs", []) if r.get("final_llr_weights")]
    return counts[0] if counts else 0


def verdict_lines(summary: Sequence[dict[str, Any]]) -> list[str]:
    """Per dataset and heterogeneous mode: does IT-signSGD beat the majority vote beyond the seed spread?"""
    lines = []
    for entry in summary:
        gain = entry.get("gain_vs_majority")
        if gain is None or entry["small_batch_workers"] == 0:
            continue
        per_seed = entry["gain_by_seed"]
        spread = max(abs(x) for x in per_seed) if per_seed else 0.0
        if all(x == 0 for x in per_seed):
            word = "identical to signSGD-MV in every seed (the weights never changed a vote's outcome)"
        elif all(x > 0 for x in per_seed):
            word = f"better in every seed ({gain:+.4f} on average)"
        elif all(x < 0 for x in per_seed):
            word = f"worse in every seed ({gain:+.4f} on average)"
        else:
            word = f"mixed across seeds ({gain:+.4f} on average, per seed up to ±{spread:.4f}): no consistent gain"
        lines.append(f"- {entry['dataset']} mode {entry['batch_mode']}: IT-signSGD {word}")
    return lines


def docs_section(doc: dict[str, Any], json_path: str) -> str:
    """The figures of a suite document as markdown for docs/benchmarks.md; everything is read from ``doc``."""
    cfg = doc["config"]
    lines = [
        *run_lines(doc, json_path),
    ]
    repro = doc.get("repro")
    if repro:
        sets = "; ".join(f"{k}: " + (f"skipped ({v['skipped']})" if "skipped" in v else
                         f"{v['train']} train / {v['val']} val samples, MLP of {v.get('model_params')} parameters")
                         for k, v in repro["datasets"].items())  # fmt: skip
        small = ", ".join(str(BATCH_MODES[m]) for m in cfg["batch_modes"])
        lines += [
            "", "### Part A: paper 004 Fig. 1 (simulator, one process)", "",
            f"M = {cfg['num_workers']} workers, batch modes {list(cfg['batch_modes'])} ({small} workers at "
            f"B = {cfg['small_batch']}, the rest at B = {cfg['large_batch']}), each worker its own equal shard of the "
            f"training split; plain signSGD votes (no momentum), x ← x − δ·U with δ = {cfg['lr']}, "
            f"{cfg['rounds']} rounds, seeds {list(cfg['seeds'])}; IT-signSGD with estimator `{cfg['estimator']}`, "
            f"warm-up {cfg['warmup_rounds']} rounds. Datasets: {sets}. Part A took {repro['wall_s']} s.",
            "", markdown_table(repro["summary"], SUMMARY_COLUMNS), "",
            "Verdict (computed from the paired per-seed differences):", "", *verdict_lines(repro["summary"]),
        ]  # fmt: skip
        if repro.get("diagnosis"):
            lines += ["", "Why (error rates of one worker's sign, measured at the trained signSGD-MV model, 30 draws):",
                      "", *diagnosis_lines(repro)]  # fmt: skip
    if doc.get("rows") or doc.get("networks"):
        nets = "\n".join(network_lines(doc))
        first = doc["rows"][0] if doc["rows"] else {}
        lines += [
            "", "### Part B: comm hooks, bytes and time per step (real processes, plain DDP on gloo)", "",
            f"Model MLP({cfg['in_features']}, hidden={cfg['comm_hidden']}) = {first.get('params', 0):,} parameters, "
            f"batch {cfg['batch_size']} per rank of synthetic data, {cfg['steps']} timed steps after "
            f"{cfg['warmup_steps']} untimed; PowerSGD rank {cfg['powersgd_rank']} (compressing from step 2); "
            f"IT-signSGD warm-up 2 rounds. Logged bytes: our hooks' meter; for fp32/fp16/PowerSGD the byte model "
            f"of `core/accounting.py`. Kernel tx: the rank's veth counter over the timed steps (emulated links only). "
            f"Part B took {doc.get('comm_wall_s')} s.", "", "Networks:", "", nets, "",
            markdown_table(doc["rows"], COMM_COLUMNS),
        ]  # fmt: skip
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: str | Path) -> Path:
    """Write the suite's figure: Part A's curves (one row of panels per dataset), Part B's times and bytes."""
    plt = pyplot()
    from lightning_pdist.bench.sign_comm import network_key
    from lightning_pdist.bench.sign_repro import plot_repro

    repro = doc.get("repro") or {"rows": []}
    sets = list(dict.fromkeys(r["dataset"] for r in repro["rows"]))
    comm = doc.get("rows") or []
    nrows = len(sets) + (1 if comm else 0)
    if nrows == 0:
        nrows = 1
    fig = plt.figure(figsize=(18, 3.8 * nrows))
    grid = fig.add_gridspec(nrows, 4)
    for i, name in enumerate(sets):
        axes = [fig.add_subplot(grid[i, j]) for j in range(4)]
        plot_repro(axes, repro["rows"], name)
    if comm:
        ax_t, ax_b = fig.add_subplot(grid[len(sets), :2]), fig.add_subplot(grid[len(sets), 2:])
        labels = list(dict.fromkeys(f"{network_key(r['network'], r['rate'])} n={r['world_size']}" for r in comm))
        width = 0.8 / len(HOOKS)
        for k, hook in enumerate(HOOKS):
            by = {f"{network_key(r['network'], r['rate'])} n={r['world_size']}": r for r in comm if r["hook"] == hook}
            xs = [i + k * width for i, lab in enumerate(labels) if lab in by]
            ax_t.bar(xs, [by[lab]["ms_per_step"] for lab in labels if lab in by], width, label=hook)
            ax_b.bar(xs, [by[lab]["bytes_per_rank_per_step"] / 1e6 for lab in labels if lab in by], width, label=hook)
        for ax, ylabel in ((ax_t, "ms per step (slowest rank)"), (ax_b, "MB sent per rank per step (logged, log)")):
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))], labels, fontsize=8)
            ax.set_ylabel(ylabel)
            ax.grid(True, axis="y", alpha=0.3)
        ax_b.set_yscale("log")
        ax_t.set_yscale("log")
        ax_t.legend(fontsize=7)
    return save_figure(fig, path, dpi=100, title=f"sign suite, {doc['created']}")


# -- command line -------------------------------------------------------------------------------


def _datasets(kwargs: dict[str, Any], given: set[str]) -> dict[str, Any]:
    """With ``--data-dir`` and no ``--datasets``, Part A adds MNIST and CIFAR-10."""
    if kwargs["data_dir"] and "datasets" not in given:
        kwargs["datasets"] = ("digits", "mnist", "cifar10")
    return kwargs


CLI = SuiteCli(config=SuiteConfig, quick=QUICK, full=FULL, out="sign.json and sign.png",
               either={"networks": NETWORKS},
               derive=_datasets)  # fmt: skip

run = documented_run(SUITE, run_suite, docs_section)
