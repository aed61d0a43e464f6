"""Tensor-parallel suite: paper 003 Table 1 (DP vs TP for BERT/ALBERT on IMDB), DP×TP, hybrid conv-DP/FC-MP, bytes.

``python -m lightning_pdist.bench tensor_parallel [--quick] --out DIR [--network loopback|emulated|both]
[--rates 1gbit 100mbit] [--models bert albert vgg transformer] [--configs dp tp tp_sp deepspeed_tp dp_tp hybrid]``
writes
``DIR/tensor_parallel.json``, ``DIR/tensor_parallel.png`` and ``DIR/docs_section.md``.

Paper 003 trains BERT-base and ALBERT-base on IMDB with data parallelism (6 pods) and DeepSpeed tensor parallelism
(degree 6) and reports training time only: BERT 556 s DP vs 392 s TP (0.705), ALBERT 264 s vs 200 s (0.758). It did
not analyse communication; this suite measures it and sets it against a written byte model
(:mod:`lightning_pdist.tensor_parallel.cost`).

Runs, each rank a real process (:mod:`~lightning_pdist.bench.tp_worker`, Lightning on gloo), the same **global batch**
in every configuration:

* ``dp``: ``PdistStrategy`` (DDP with byte accounting), 2 ranks (and 4 in the full plan);
* ``tp``: ``TensorParallelStrategy`` (plan ``"auto"``: Megatron-style column/row pairs), 2 ranks on the whole batch;
* ``tp_sp``: the same with ``sequence_parallel=True`` (all-gather / reduce-scatter along the sequence instead of each
  all-reduce; byte model :func:`~lightning_pdist.tensor_parallel.cost.sp_encoder_bytes`); a model the strategy refuses gets its refusal
  in the row's ``error`` (ALBERT until its attention is covered);
* ``deepspeed_tp``: DeepSpeed AutoTP, degree 2, the paper's own engine (:mod:`~lightning_pdist.bench.tp_deepspeed`;
  plain torch loop, IMDB-shaped random token batches; a failure is recorded in its row, never a number);
* ``dp_tp``: ``TensorParallelStrategy(tensor_parallel_size=2)`` on 4 ranks (2 × 2), full plan only (4 processes
  on 2 cores are oversubscribed);
* ``hybrid``: ``plan="hybrid"`` on ``vgg16_scaled`` (convolutions data-parallel, the FC stack column/row-sharded over
  the all-gathered batch), against ``dp`` on the same model.

Models: transformers' BERT and ALBERT (:class:`~lightning_pdist.models.encoder.EncoderClassifier`, random init) at
reduced depth and width (stated in the JSON ``models``), on IMDB-format files this suite generates (``aclImdb``
layout, synthetic reviews: :func:`~lightning_pdist.data.imdb_synthetic.write_imdb_like`) read by
:class:`~lightning_pdist.data.IMDBDataModule`. ``transformer`` (not in the default ``--models``): Lightning's demo
Transformer (``lightning.pytorch.demos.Transformer``, encoder-decoder language model) at the encoders' width, heads,
FFN and vocabulary with ``num_layers // 2`` encoder and decoder layers each, on random tokens (next-token targets,
no download), 2 ranks only, under ``dp``, ``tp``, ``tp_sp`` and ``deepspeed_tp``; its TP rows carry the meter only
(no byte model: ``–``).

Time: **per step**, over ``steps`` timed optimizer steps after ``warmup_steps`` untimed ones, between barriers on
every rank (``time per N steps`` / N), the fastest of ``repeats`` runs of the plan; TP/DP ratios compare those, as the paper's training times compare equal
numbers of steps of equal global batches. Bytes per step per rank: measured (the strategy's ``CommMeter``), from the
byte model, and on emulated links the kernel's ``tx_bytes`` of each rank's veth over the same window
(``kernel_over_model`` must lie within 10% of 1: headers and ACKs add ~5%).

Crossover (``crossover``): the time model ``t = compute + bytes / bandwidth`` with each configuration's compute
measured on loopback (its busiest rank's CPU time per step, which other sessions' load hardly moves; wall time per
step for DeepSpeed, which reports no CPU time) and its bytes from the model: the bandwidth below which TP beats DP, the model's prediction at every emulated rate
against the measurement, and at each rate the global batch and the hidden size at which the winner changes
(compute scaled by :func:`~lightning_pdist.tensor_parallel.cost.encoder_flops`).

Networks: ``loopback`` (127.0.0.1, unshaped) and emulated links (:class:`~lightning_pdist.bench.netns.EmulatedNetwork`,
``tc tbf`` at each of ``--rates`` both ways); without root/iproute2 the emulated part is skipped with the reason.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

from lightning_pdist.bench.cli import SuiteCli, SuiteRules
from lightning_pdist.bench.launch import Launcher, SuiteRun
from lightning_pdist.bench.netns import LOOPBACK, EmulatedNetwork, parse_rate
from lightning_pdist.bench.report import (check_rows, documented_run, markdown_table, network_lines, pyplot, run_lines,
                                          save_figure)  # fmt: skip

SUITE = "tensor_parallel"
MODELS = ("bert", "albert", "vgg")  # the default --models
MODEL_CHOICES = (*MODELS, "transformer")
ENCODERS = ("bert", "albert")
CONFIGS = ("dp", "tp", "deepspeed_tp", "dp_tp", "hybrid", "tp_sp")  # tp_sp last: the figure keeps its colours
NETWORKS = ("loopback", "emulated")
TP_LIKE = ("tp", "tp_sp", "deepspeed_tp", "dp_tp", "hybrid")
PAPER = {"bert": {"dp_s": 556, "tp_s": 392, "ratio": 0.705}, "albert": {"dp_s": 264, "tp_s": 200, "ratio": 0.758}}
KERNEL_TOLERANCE = 0.10  # |kernel tx / byte model - 1| allowed on emulated links
ROW_KEYS = ("network", "model", "config", "world_size", "step_s", "meter_bytes_per_step", "model_bytes_per_step", "error")
QUICK = {"rates": ("100mbit",), "world_sizes": (2,), "warmup_steps": 1, "steps": 3, "repeats": 1}
FULL = {"rates": ("1gbit", "100mbit"), "world_sizes": (2, 4), "warmup_steps": 2, "steps": 6, "repeats": 2}


@dataclass(frozen=True)
class SuiteConfig(SuiteRules):
    """Everything that decides what the suite runs; validated on construction.

    The encoder defaults are BERT-base / ALBERT-base reduced: 4 layers instead of 12, hidden 256 instead of 768,
    4 heads instead of 12, FFN 1024 instead of 3072, a vocabulary of 8,000 instead of 30,522, 64 tokens per review
    (ALBERT: factorised embedding 64 instead of 128, one shared block).

    Raises:
        ValueError: a value breaks its rule; the message names the option, the value and the rule.
    """

    networks: tuple[str, ...] = NETWORKS
    """loopback (127.0.0.1), emulated (netns + tbf links, needs root) or both"""
    rates: tuple[str, ...] = QUICK["rates"]
    """emulated link rates"""
    models: tuple[str, ...] = MODELS
    """any of bert albert vgg transformer"""
    configs: tuple[str, ...] = CONFIGS
    """any of dp tp tp_sp deepspeed_tp dp_tp hybrid (dp_tp runs with --world-sizes 4)"""
    world_sizes: tuple[int, ...] = QUICK["world_sizes"]
    """2 and/or 4"""
    hidden_size: int = 256
    """encoder hidden_size"""
    num_layers: int = 4
    """encoder num_layers"""
    num_heads: int = 4
    """encoder num_heads"""
    intermediate_size: int = 1024
    """encoder intermediate_size"""
    vocab_size: int = 8000
    """encoder vocab_size"""
    embedding_size: int = 64
    """encoder embedding_size (ALBERT)"""
    seq_len: int = 64
    """encoder seq_len"""
    global_batch: int = 8
    """encoder samples per step, all ranks"""
    vgg_width: float = 0.125
    """vgg16_scaled width"""
    vgg_global_batch: int = 16
    """VGG images per step, all ranks"""
    warmup_steps: int = QUICK["warmup_steps"]
    """untimed steps"""
    steps: int = QUICK["steps"]
    """timed steps"""
    reviews_per_class: int = 250
    """generated reviews per class and split"""
    lr: float = 0.01
    """SGD learning rate"""
    seed: int = 0
    """seed of the data and the models"""
    repeats: int = QUICK["repeats"]
    """runs of the plan per network; each row keeps its fastest"""
    timeout: float = 600.0
    """seconds per launch"""
    quick: bool = True
    SUITE: ClassVar[str] = SUITE
    FLAGS: ClassVar[dict[str, str]] = {"networks": "--network"}

    def __post_init__(self) -> None:
        bad = self.bad
        for name, allowed in (("networks", NETWORKS), ("models", MODEL_CHOICES), ("configs", CONFIGS), ("rates", None),
                              ("world_sizes", (2, 4))):  # fmt: skip
            self.distinct(name, allowed)
        for rate in self.rates:
            try:
                parse_rate(rate)
            except (TypeError, ValueError):
                raise bad("--rates", rate, "each rate must look like '100mbit' or '1gbit'") from None
        self.ints("hidden_size", "num_layers", "num_heads", "intermediate_size", "vocab_size", "embedding_size", "seq_len",
                  "global_batch", "vgg_global_batch", "warmup_steps", "steps", "reviews_per_class", "repeats")  # fmt: skip
        if self.vocab_size < 3:
            raise bad("--vocab-size", self.vocab_size, "must be >= 3 (padding, unknown, one word)")
        if self.hidden_size % self.num_heads:
            raise bad("--hidden-size", self.hidden_size, f"must be a multiple of --num-heads ({self.num_heads})")
        degree = 2  # every TP configuration here shards 2 ways (tp on 2 ranks, dp_tp 2 x 2)
        for option, value in (("--num-heads", self.num_heads), ("--intermediate-size", self.intermediate_size)):
            if value % degree:
                raise bad(option, value, f"must be divisible by the tensor-parallel degree {degree}")
        if "tp_sp" in self.configs and self.seq_len % degree:
            raise bad("--seq-len", self.seq_len, f"must be divisible by the tensor-parallel degree {degree} under tp_sp "
                      "(sequence parallelism gives each TP rank seq_len / degree positions)")  # fmt: skip
        ranks = max(self.world_sizes)
        if self.global_batch % ranks:
            raise bad("--global-batch", self.global_batch, f"must be a multiple of the largest world size ({ranks})")
        if self.vgg_global_batch % 2:
            raise bad("--vgg-global-batch", self.vgg_global_batch, "must be a multiple of 2 (the VGG runs' ranks)")
        fc = round(4096 * self.vgg_width) if isinstance(self.vgg_width, (int, float)) else 0
        if not 0 < self.vgg_width <= 1 or fc < degree or fc % degree:
            raise bad("--vgg-width", self.vgg_width, f"must be in (0, 1] with round(4096 * width) (the FC width) a "
                      f"positive multiple of {degree}")  # fmt: skip
        if self.reviews_per_class * 2 * 0.9 < self.global_batch * (self.warmup_steps + self.steps):
            raise bad("--reviews-per-class", self.reviews_per_class, "too few: the run needs "
                      f"{self.global_batch * (self.warmup_steps + self.steps)} training reviews (90% of 2 x this)")  # fmt: skip
        self.positive("lr", "timeout")
        self.ints("seed", low=0)

    def encoder_kwargs(self) -> dict[str, Any]:
        """``EncoderClassifier`` keywords (besides the family) of the BERT and ALBERT runs."""
        return {"vocab_size": self.vocab_size, "hidden_size": self.hidden_size, "num_layers": self.num_layers,
                "num_heads": self.num_heads, "intermediate_size": self.intermediate_size, "max_len": self.seq_len,
                "embedding_size": self.embedding_size, "num_classes": 2}  # fmt: skip

    def transformer_kwargs(self) -> dict[str, Any]:
        """``lightning.pytorch.demos.Transformer`` keywords: the encoders' shape, ``num_layers // 2`` encoder and
        decoder layers each (as many blocks as the encoders), the demo's own dropout."""
        return {"vocab_size": self.vocab_size, "ninp": self.hidden_size, "nhead": self.num_heads,
                "nhid": self.intermediate_size, "nlayers": max(1, self.num_layers // 2)}  # fmt: skip

    def model_kwargs(self, model: str) -> dict[str, Any]:
        """The keywords the workers build ``model`` with."""
        return self.transformer_kwargs() if model == "transformer" else self.encoder_kwargs()


# -- data and the plan ---------------------------------------------------------------------------------


def plan_runs(config: SuiteConfig) -> list[dict[str, Any]]:
    """The runs on every network, in order: ``{"model", "config", "world_size", "tp_size"}``.

    2 ranks: the encoders and the demo Transformer under ``dp``, ``tp``, ``tp_sp`` and ``deepspeed_tp``, VGG under
    ``dp`` and ``hybrid``; 4 ranks: the encoders under ``dp`` and ``dp_tp`` (2 × 2).
    """
    runs = []
    for ws in config.world_sizes:
        for model in config.models:
            if model == "vgg":
                configs = ("dp", "hybrid") if ws == 2 else ()
            elif ws == 2:
                configs = ("dp", "tp", "tp_sp", "deepspeed_tp")
            else:
                configs = () if model == "transformer" else ("dp", "dp_tp")
            for name in configs:
                if name in config.configs:
                    tp = {"dp": 1, "dp_tp": 2}.get(name, ws)
                    runs.append({"model": model, "config": name, "world_size": ws, "tp_size": tp})
    return runs


def worker_spec(config: SuiteConfig, run: dict[str, Any], data_dir: Path) -> tuple[str, dict[str, Any]]:
    """The worker module and spec of ``run``: :mod:`~lightning_pdist.bench.tp_deepspeed` or :mod:`~lightning_pdist.bench.tp_worker`."""
    if run["config"] == "deepspeed_tp":
        return "lightning_pdist.bench.tp_deepspeed", {
            "family": run["model"], "model_kwargs": config.model_kwargs(run["model"]), "batch_size": config.global_batch,
            "seq_len": config.seq_len, "steps": config.steps, "warmup_steps": config.warmup_steps, "tp_size": run["tp_size"],
            "seed": config.seed, "lr": config.lr}  # fmt: skip
    from lightning_pdist.bench.tp_worker import check_spec

    vgg = run["model"] == "vgg"
    return "lightning_pdist.bench.tp_worker", check_spec({
        "config": run["config"], "model": run["model"], "world_size": run["world_size"], "tp_size": run["tp_size"],
        "global_batch": config.vgg_global_batch if vgg else config.global_batch, "seq_len": config.seq_len,
        "model_kwargs": config.model_kwargs(run["model"]), "vgg_width": config.vgg_width, "warmup_steps": config.warmup_steps,
        "steps": config.steps, "seed": config.seed, "lr": config.lr, "data_dir": str(data_dir)})  # fmt: skip


# -- the byte model of every run -------------------------------------------------------------------------


def model_facts(config: SuiteConfig) -> dict[str, dict[str, Any]]:
    """Per model, what the byte model needs, from meta-device builds (no memory): parameters, shards, VGG shapes;
    ``sp_partial`` the parameters sequence parallelism sums per step (or ``sp_refusal``, the strategy's refusal)."""
    import torch

    from lightning_pdist.tensor_parallel.cost import partial_params, tp_local_numel
    from lightning_pdist.tensor_parallel.plan import plan_for

    facts = {}
    with torch.device("meta"):
        for family in (m for m in config.models if m in ENCODERS):
            from lightning_pdist.models.encoder import EncoderClassifier

            model = EncoderClassifier(family, **config.encoder_kwargs())
            partial = partial_params(model, plan_for(model))
            facts[family] = {"params": sum(p.numel() for p in model.parameters()),
                             "params_local_tp2": tp_local_numel(model, plan_for(model).as_dict(), 2),
                             **config.encoder_kwargs(), "seq_len": config.seq_len, "global_batch": config.global_batch,
                             "family": family, "sp_partial": partial if isinstance(partial, int) else None,
                             "sp_refusal": None if isinstance(partial, int) else partial}  # fmt: skip
        if "transformer" in config.models:
            from lightning.pytorch.demos import Transformer

            demo = Transformer(**config.transformer_kwargs())
            facts["transformer"] = {"params": sum(p.numel() for p in demo.parameters()), **config.transformer_kwargs(),
                                    "seq_len": config.seq_len, "global_batch": config.global_batch}  # fmt: skip
        if "vgg" in config.models:
            from lightning_pdist.models.vgg import vgg16_scaled

            vgg = vgg16_scaled(width=config.vgg_width, device="meta")
            fc6, fc8 = vgg.classifier.fc6, vgg.classifier.fc8
            facts["vgg"] = {"params": sum(p.numel() for p in vgg.parameters()), "width": config.vgg_width,
                            "conv_params": sum(p.numel() for p in vgg.features.parameters()), "fc_in": fc6.in_features,
                            "fc_hidden": fc6.out_features, "num_classes": fc8.out_features, "in_size": vgg.in_size,
                            "global_batch": config.vgg_global_batch}  # fmt: skip
    return facts


def step_bytes(run: dict[str, Any], facts: dict[str, Any]) -> Any:
    """The byte model's :class:`~lightning_pdist.tensor_parallel.cost.StepBytes` of one rank of ``run``
    (for ``tp_sp`` too: :func:`~lightning_pdist.tensor_parallel.cost.sp_encoder_bytes`); ``None`` where there is none
    (the demo Transformer's TP rows; ``tp_sp`` on a model the strategy refuses)."""
    from lightning_pdist.tensor_parallel.cost import dp_bytes, dp_tp_bytes, hybrid_vgg_bytes, sp_encoder_bytes
    from lightning_pdist.tensor_parallel.cost import tp_encoder_bytes

    ws, tp, name = run["world_size"], run["tp_size"], run["config"]
    if name == "dp":
        return dp_bytes(facts["params"], ws)
    if run.get("model") == "transformer" or (name == "tp_sp" and facts.get("sp_partial") is None):
        return None
    if name == "hybrid":
        return hybrid_vgg_bytes(facts["conv_params"], facts["global_batch"] // ws, facts["fc_in"], facts["fc_hidden"],
                                facts["num_classes"], ws)  # fmt: skip
    shape = (facts["seq_len"], facts["hidden_size"], facts["num_layers"])
    if name == "tp_sp":
        return sp_encoder_bytes(facts["global_batch"], *shape, tp_size=tp, partial_params=facts["sp_partial"])
    if name == "dp_tp":
        return dp_tp_bytes(facts["params_local_tp2"], facts["global_batch"] * tp // ws, *shape, dp_size=ws // tp, tp_size=tp)
    # DeepSpeed AutoTP all-reduces the input gradient of query, key and value separately; we once for the three
    return tp_encoder_bytes(facts["global_batch"], *shape, tp_size=tp, fused_qkv=name != "deepspeed_tp")


# -- running ---------------------------------------------------------------------------------------------


class Runner:
    """Runs the plan on one network after the other; one launch per run, its ranks' results turned into a row."""

    def __init__(self, config: SuiteConfig, scratch: Path, facts: dict[str, dict[str, Any]], log: Callable[[str], None]):
        from lightning_pdist.data.imdb_synthetic import write_imdb_like

        self.config, self.facts, self.log = config, facts, log
        self.data_dir = write_imdb_like(scratch / "imdb", config.reviews_per_class, config.seed)
        self.launcher = Launcher(SUITE, scratch, config.timeout, port=29800)

    def launch(self, run: dict[str, Any], network: str, net: EmulatedNetwork | None) -> dict[str, Any]:
        """One row: ``run`` on ``network`` (``net`` for emulated links), or its error."""
        module, spec = worker_spec(self.config, run, self.data_dir)
        got = self.launcher.run(module, spec, run["world_size"], net or LOOPBACK, errors=600)
        row = build_row(run, got.results, self.facts[run["model"]], self.config.steps, network, got.error)
        row.update(process_wall_s=round(got.wall_s, 1), other_load_cores=got.other_load_cores)
        self.log(describe(row))
        return row

    def launch_all(self, runs: Sequence[dict[str, Any]], network: str, net: EmulatedNetwork | None) -> list[dict[str, Any]]:
        """Every run on ``network``, the whole plan ``repeats`` times over; per run the row of its fastest repeat.

        Other sessions share the 2 cores, and a burst of their work slows whatever runs then; the plan is repeated
        as a whole (not each run back to back) so that one burst cannot spoil every repeat of one run. Each row
        keeps every repeat's step time in ``step_s_repeats``.
        """
        passes = [[self.launch(run, network, net) for run in runs] for _ in range(self.config.repeats)]
        rows = []
        for tries in zip(*passes):
            timed = [r for r in tries if r["step_s"] is not None]
            best = dict(min(timed, key=lambda r: r["step_s"]) if timed else tries[0])
            best.update(repeats=len(tries), step_s_repeats=[r["step_s"] for r in tries])
            rows.append(best)
        return rows


def build_row(run: dict[str, Any], ranks: Sequence[dict[str, Any]], facts: dict[str, Any], steps: int, network: str,
              error: str | None) -> dict[str, Any]:  # fmt: skip
    """One JSON row from a run's ranks (``tp_worker`` or ``tp_deepspeed`` results; none when ``error``)."""
    model = step_bytes(run, facts)  # None: no byte model for this run ("–"); the meter is in the row all the same
    modelled = None if model is None else model.total
    row: dict[str, Any] = {**run, "network": network, "rate": None if network == "loopback" else network.split()[-1],
                           "global_batch": facts["global_batch"], "steps": steps, "model_bytes_per_step": modelled,
                           "model_by_kind": None if model is None else model.by_kind(), "params_full": facts["params"], "error": error,
                           "step_s": None, "meter_bytes_per_step": None, "kernel_tx_bytes_per_step": None,
                           "meter_over_model": None, "kernel_over_model": None}  # fmt: skip
    if error is not None:
        return row
    deepspeed = run["config"] == "deepspeed_tp"
    window = max(r["loop_s"] if deepspeed else r["window_s"] for r in ranks)
    row["step_s"] = round(window / steps, 5)
    row["median_step_s"] = round(max(statistics.median(r["step_s"]) for r in ranks), 5)
    row["time_steps_s"] = round(window, 4)
    row["params_local"] = ranks[0]["params_local"]
    row["final_loss"] = round(ranks[0]["losses"][-1], 4)
    if not deepspeed:  # DeepSpeed counts nothing (bytes, CPU time); its bytes are the kernel's alone
        row["cpu_per_step_s"] = round(max(r["cpu_s"] for r in ranks) / steps, 5)
        meter = statistics.mean(r["meter_bytes"] for r in ranks) / steps
        row["meter_bytes_per_step"] = round(meter)
        row["meter_by_kind_per_step"] = {k: v // steps for k, v in ranks[0]["meter_by_kind"].items()}
        row["meter_over_model"] = round(meter / modelled, 6) if modelled else None
    if all(r["tx_bytes"] is not None for r in ranks):
        kernel = statistics.mean(r["tx_bytes"] for r in ranks) / steps
        row["kernel_tx_bytes_per_step"] = round(kernel)
        row["kernel_tx_bytes_by_rank"] = [r["tx_bytes"] for r in ranks]
        row["kernel_over_model"] = round(kernel / modelled, 4) if modelled else None
    return row


def describe(row: dict[str, Any]) -> str:
    """One log line per row."""
    head = f"[{row['network']}] {row['model']} {row['config']} x{row['world_size']}"
    if row["error"]:
        return f"{head}: error {row['error']}"
    measured = "" if row["meter_bytes_per_step"] is None else f", meter {row['meter_bytes_per_step'] / 1e6:.3f}"
    kernel = "" if row["kernel_over_model"] is None else f", kernel/model {row['kernel_over_model']:.3f}"
    modelled = "–" if row["model_bytes_per_step"] is None else f"{row['model_bytes_per_step'] / 1e6:.3f}"
    return (f"{head}: {1000 * row['step_s']:.1f} ms/step, model {modelled} MB/step"
            f"{measured}{kernel} (run {row.get('process_wall_s', '?')} s)")  # fmt: skip


# -- what the rows say ------------------------------------------------------------------------------------


def ratios(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each TP-like configuration's step time over DP's (same model, network and ranks), the paper's beside it, and
    over DeepSpeed AutoTP's (``deepspeed_ratio``: same model, network and ranks; ``None`` where DeepSpeed has no
    timed row, and for DeepSpeed's own row)."""
    out = []
    for row in rows:
        if row["config"] not in TP_LIKE or row["step_s"] is None:
            continue
        dp = next((r for r in rows if (r["network"], r["model"], r["world_size"], r["config"]) ==
                   (row["network"], row["model"], row["world_size"], "dp") and r["step_s"]), None)  # fmt: skip
        if dp is None:
            continue
        ds = next((r for r in rows if (r["network"], r["model"], r["world_size"], r["config"]) ==
                   (row["network"], row["model"], row["world_size"], "deepspeed_tp") and r["step_s"]), None)  # fmt: skip
        bytes_ratio = (round(row["model_bytes_per_step"] / dp["model_bytes_per_step"], 3)
                       if row["model_bytes_per_step"] and dp["model_bytes_per_step"] else None)  # fmt: skip
        out.append({"network": row["network"], "model": row["model"], "config": row["config"], "world_size": row["world_size"],
                    "dp_step_s": dp["step_s"], "step_s": row["step_s"], "ratio": round(row["step_s"] / dp["step_s"], 3),
                    "bytes_ratio": bytes_ratio,
                    "deepspeed_ratio": round(row["step_s"] / ds["step_s"], 3) if ds and row["config"] != "deepspeed_tp"
                    else None,
                    "paper_ratio": PAPER.get(row["model"], {}).get("ratio") if row["config"] in ("tp", "deepspeed_tp")
                    else None})  # fmt: skip
    return out


def kernel_check(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Our strategies' rows on emulated links: kernel tx / byte model within :data:`KERNEL_TOLERANCE` of 1?"""
    checked = [r for r in rows if r["kernel_over_model"] is not None and r["config"] != "deepspeed_tp"]
    worst = max(checked, key=lambda r: abs(r["kernel_over_model"] - 1), default=None)
    return {"tolerance": KERNEL_TOLERANCE, "rows": len(checked),
            "within": sum(abs(r["kernel_over_model"] - 1) <= KERNEL_TOLERANCE for r in checked),
            "min_ratio": min((r["kernel_over_model"] for r in checked), default=None),
            "max_ratio": max((r["kernel_over_model"] for r in checked), default=None),
            "worst": None if worst is None else {k: worst[k] for k in ("network", "model", "config", "kernel_over_model")},
            "deepspeed": [{k: r[k] for k in ("network", "model", "kernel_tx_bytes_per_step", "kernel_over_model")}
                          for r in rows if r["config"] == "deepspeed_tp" and r["kernel_over_model"] is not None]}  # fmt: skip


def encoder_params(family: str, config: SuiteConfig, hidden: int) -> int:
    """Parameters of the suite's encoder at another width (FFN and heads scaled alike), built on the meta device."""
    import torch

    from lightning_pdist.models.encoder import EncoderClassifier

    kwargs = {**config.encoder_kwargs(), "hidden_size": hidden,
              "intermediate_size": int(hidden * config.intermediate_size / config.hidden_size)}
    with torch.device("meta"):
        return sum(p.numel() for p in EncoderClassifier(family, **kwargs).parameters())


def crossover(rows: Sequence[dict[str, Any]], networks: dict[str, Any], config: SuiteConfig) -> list[dict[str, Any]]:
    """Per model and TP-like engine against DP (2 ranks): where the modelled step times cross, and how well they predict.

    ``compute`` is each configuration's CPU time per step on loopback (its busiest rank's; wall time for DeepSpeed,
    which does not report CPU time, and for DP beside it); bandwidths are the emulated links' measured TCP goodput.
    For the encoders, at each rate also the global batch and the hidden size at which the winner changes.
    """
    from lightning_pdist.tensor_parallel.cost import crossover_bandwidth, step_time

    out = []
    for model in (m for m in config.models if m != "transformer"):  # no byte model of the demo Transformer's TP
        at = lambda name, net: next((r for r in rows if (r["model"], r["config"], r["world_size"], r["network"]) ==  # noqa: E731
                                     (model, name, 2, net) and r["step_s"]), None)  # fmt: skip
        dp = at("dp", "loopback")
        for engine in ("hybrid",) if model == "vgg" else ("tp", "deepspeed_tp"):
            tp = at(engine, "loopback")
            if dp is None or tp is None:
                continue
            # Compute: the busiest rank's CPU time per step where both rows have it (other sessions' load hardly
            # moves it), else both loopback step times.
            source = "cpu_per_step_s" if dp.get("cpu_per_step_s") and tp.get("cpu_per_step_s") else "step_s"
            c_dp, c_tp, b_dp, b_tp = dp[source], tp[source], dp["model_bytes_per_step"], tp["model_bytes_per_step"]
            cross = crossover_bandwidth(c_dp, b_dp, c_tp, b_tp)
            entry = {"model": model, "engine": engine, "compute_source": f"loopback {source}", "compute_dp_s": c_dp,
                     "compute_tp_s": c_tp, "bytes_dp": b_dp, "bytes_tp": b_tp, "bandwidth_bytes_per_s": cross.value, "tp_wins": where_wins([cross], "tp", "bandwidth"),
                     "bytes_equal_global_batch": round(b_dp / (b_tp / config.global_batch), 2) if model in ENCODERS else None,
                     "rates": []}  # fmt: skip
            for name, info in networks.items():
                bw = info.get("measured_tcp_goodput_bytes_per_s")
                if not bw:
                    continue
                measured = {n: (at(n, name) or {}).get("step_s") for n in ("dp", engine)}
                t_dp, t_tp = step_time(c_dp, b_dp, bw), step_time(c_tp, b_tp, bw)
                rate = {"network": name, "bandwidth_bytes_per_s": bw, "predicted_dp_s": round(t_dp, 4),
                        "predicted_tp_s": round(t_tp, 4), "measured_dp_s": measured["dp"], "measured_tp_s": measured[engine],
                        "predicted_ratio": round(t_tp / t_dp, 3),
                        "measured_ratio": round(measured[engine] / measured["dp"], 3)
                        if measured["dp"] and measured[engine] else None}  # fmt: skip
                if model in ENCODERS:
                    rate.update(scaling_crossovers(model, config, c_dp, c_tp, b_dp, bw, fused_qkv=engine == "tp"))
                entry["rates"].append(rate)
            out.append(entry)
    return out


def scaling_crossovers(model: str, config: SuiteConfig, c_dp: float, c_tp: float, b_dp: int, bw: float,
                       fused_qkv: bool = True) -> dict[str, Any]:  # fmt: skip
    """At bandwidth ``bw``: the global batch and the hidden size where TP (2 ranks) and DP (2 ranks) swap places
    (``fused_qkv``: as :func:`~lightning_pdist.tensor_parallel.cost.tp_encoder_bytes`; ``False`` for DeepSpeed).

    Compute scales linearly with the batch and as :func:`~lightning_pdist.tensor_parallel.cost.encoder_flops`
    with the width (FFN kept at the same multiple of it, heads fixed); DP's bytes follow the parameter count, TP's
    the activations.
    """
    from lightning_pdist.tensor_parallel.cost import dp_bytes, encoder_flops, find_crossovers, step_time
    from lightning_pdist.tensor_parallel.cost import tp_encoder_bytes

    G, L, H, layers, heads = config.global_batch, config.seq_len, config.hidden_size, config.num_layers, config.num_heads
    ffn = config.intermediate_size / H  # the FFN stays this multiple of the width
    flops0 = encoder_flops(G, L, H, config.intermediate_size, layers)

    def batch_diff(g: int) -> float:
        return step_time(c_dp * g / G, b_dp, bw) - step_time(c_tp * g / G, tp_encoder_bytes(g, L, H, layers, 2, fused_qkv=fused_qkv).total, bw)

    def width_diff(heads_wide: int) -> float:
        h = heads_wide * heads  # hidden sizes the model accepts: multiples of the heads
        scale = encoder_flops(G, L, h, int(h * ffn), layers) / flops0
        dp_b = dp_bytes(encoder_params(model, config, h), 2).total
        return step_time(c_dp * scale, dp_b, bw) - step_time(c_tp * scale, tp_encoder_bytes(G, L, h, layers, 2, fused_qkv=fused_qkv).total, bw)

    by_batch = find_crossovers(batch_diff, 1, 4096)
    by_width = [replace(c, value=None if c.value is None else c.value * heads)
                for c in find_crossovers(width_diff, 2, 8192 // heads)]  # fmt: skip
    return {"global_batch_crossovers": [c.value for c in by_batch], "tp_wins_batch": where_wins(by_batch, "tp", "global batch"),
            "hidden_size_crossovers": [c.value for c in by_width], "tp_wins_width": where_wins(by_width, "tp", "hidden size")}  # fmt: skip


def where_wins(crossings: Sequence[Any], name: str, what: str) -> str:
    """Where ``name`` is faster, in words, from :func:`~lightning_pdist.tensor_parallel.cost.find_crossovers`
    (or one :func:`~lightning_pdist.tensor_parallel.cost.crossover_bandwidth`): ``"everywhere"``,
    ``"nowhere"``, ``"at bandwidth < 376.6 Mbit/s"``, ``"at hidden size < 44 or >= 948"``."""
    if crossings[0].value is None:
        return "everywhere" if crossings[0].below == name else "nowhere"
    show = (lambda v: f"{v * 8 / 1e6:.1f} Mbit/s") if what == "bandwidth" else (lambda v: f"{v:g}")  # noqa: E731
    edges = [None, *(c.value for c in crossings), None]
    winners = [crossings[0].below, *(c.above for c in crossings)]
    spans = []
    for lo, hi, who in zip(edges, edges[1:], winners):
        if who != name:
            continue
        spans.append(f"< {show(hi)}" if lo is None else f">= {show(lo)}" if hi is None else f"{show(lo)} to {show(hi)}")
    return f"at {what} " + " or ".join(spans)


PAPER_SHAPES = {  # transformers' BERT-base and ALBERT-base, as paper 003 trained them, at its degree 6
    "bert": {"vocab_size": 30522, "hidden_size": 768, "num_layers": 12, "num_heads": 12, "intermediate_size": 3072,
             "max_len": 512},
    "albert": {"vocab_size": 30000, "hidden_size": 768, "num_layers": 12, "num_heads": 12, "intermediate_size": 3072,
               "max_len": 512, "embedding_size": 128},
}  # fmt: skip
PAPER_RANKS = 6
PAPER_BATCHES = ((8, 128), (8, 512), (32, 512))  # (samples, tokens each) per step: the paper gives neither


def paper_scale() -> dict[str, Any]:
    """The byte model at paper 003's scale (no run): DP over 6 ranks against TP of degree 6, per step and rank.

    DP's bytes do not depend on the batch; TP's grow with the tokens per step, so they are equal at
    ``bytes_dp / (TP bytes per token)`` tokens. The paper states neither its batch nor its sequence length, so a few
    common IMDB fine-tuning settings are shown.
    """
    import torch

    from lightning_pdist.tensor_parallel.cost import dp_bytes, tp_encoder_bytes
    from lightning_pdist.models.encoder import EncoderClassifier

    out = {}
    for family, shape in PAPER_SHAPES.items():
        with torch.device("meta"):
            params = sum(p.numel() for p in EncoderClassifier(family, num_classes=2, **shape).parameters())
        dp = dp_bytes(params, PAPER_RANKS).total
        # the paper's engine (DeepSpeed): query, key and value each all-reduce their input gradient
        per_token = tp_encoder_bytes(1, 1, shape["hidden_size"], shape["num_layers"], PAPER_RANKS, fused_qkv=False).total
        out[family] = {"params": params, "ranks": PAPER_RANKS, "dp_bytes_per_step": dp, "tp_bytes_per_token": per_token,
                       "equal_bytes_tokens_per_step": round(dp / per_token),
                       "tp_over_dp_bytes": {f"{b}x{L}": round(b * L * per_token / dp, 3) for b, L in PAPER_BATCHES},
                       "paper_time_ratio": PAPER[family]["ratio"]}  # fmt: skip
    return out


# -- the suite ------------------------------------------------------------------------------------------


def run_suite(config: SuiteConfig, out: Path, command: str, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the plan on every requested network; write ``out/tensor_parallel.{json,png}``; return the document."""
    facts, runs = model_facts(config), plan_runs(config)
    with SuiteRun(SUITE, config, out, command, log) as run:
        doc, runner = run.doc, Runner(config, run.scratch, facts, log)
        doc["models"] = facts
        for name, net, _ in run.networks(config.networks, config.rates, max(r["world_size"] for r in runs), loopback=LOOPBACK.describe()):
            doc["rows"] += runner.launch_all(runs, name, net)
    check_rows(doc["rows"], ROW_KEYS, SUITE)
    doc["ratios"] = ratios(doc["rows"])
    doc["kernel_check"] = kernel_check(doc["rows"])
    doc["crossover"] = crossover(doc["rows"], doc["networks"], config)
    doc["paper"] = PAPER
    doc["paper_scale"] = paper_scale()
    return run.finish(plot)


# -- output --------------------------------------------------------------------------------------------

MB = lambda b: f"{b / 1e6:.3f}"  # noqa: E731
ROW_COLUMNS = (
    ("network", "network", None), ("model", "model", None), ("config", "config", None), ("ranks", "world_size", None),
    ("ms/step", "step_s", lambda s: f"{1000 * s:.1f}"), ("CPU ms/step", "cpu_per_step_s", lambda s: f"{1000 * s:.1f}"),
    ("MB/step measured", "meter_bytes_per_step", MB),
    ("MB/step model", "model_bytes_per_step", MB), ("MB/step kernel", "kernel_tx_bytes_per_step", MB),
    ("kernel/model", "kernel_over_model", ".3f"), ("other load", "other_load_cores", ".2f"),
    ("error", "error", lambda e: str(e).replace("|", "\\|")),  # a stderr tail's line breaks are '|': escaped in the cell
)  # fmt: skip
RATIO_COLUMNS = (
    ("network", "network", None), ("model", "model", None), ("config", "config", None), ("ranks", "world_size", None),
    ("DP ms/step", "dp_step_s", lambda s: f"{1000 * s:.1f}"), ("ms/step", "step_s", lambda s: f"{1000 * s:.1f}"),
    ("time ÷ DP", "ratio", ".3f"), ("bytes ÷ DP", "bytes_ratio", ".3f"), ("paper 003", "paper_ratio", ".3f"),
)  # fmt: skip
DEEPSPEED_COLUMN = ("time ÷ DeepSpeed", "deepspeed_ratio", ".3f")  # shown when the document's ratios carry it


def ratio_columns(ratio_rows: Sequence[dict[str, Any]]) -> tuple:
    """:data:`RATIO_COLUMNS`, with :data:`DEEPSPEED_COLUMN` after ``time ÷ DP`` when the rows carry
    ``deepspeed_ratio`` (documents written before it existed render as they did)."""
    if not any("deepspeed_ratio" in r for r in ratio_rows):
        return RATIO_COLUMNS
    at = next(i for i, c in enumerate(RATIO_COLUMNS) if c[1] == "ratio") + 1
    return (*RATIO_COLUMNS[:at], DEEPSPEED_COLUMN, *RATIO_COLUMNS[at:])
CROSS_COLUMNS = (
    ("model", "model", None), ("engine", "engine", None), ("network", "network", None),
    ("predicted ÷ DP", "predicted_ratio", ".3f"), ("measured ÷ DP", "measured_ratio", ".3f"),
    ("TP faster (batch)", "tp_wins_batch", None), ("TP faster (width)", "tp_wins_width", None),
)  # fmt: skip


def docs_section(doc: dict[str, Any], json_path: str) -> str:
    """The suite's figures as markdown; everything is read from ``doc``."""
    cfg, facts = doc["config"], doc["models"]
    nets = network_lines(doc, goodput="short")
    models = [f"- {name}: {f['params']:,} parameters" + (
        f", {f['num_layers']} layers, hidden {f['hidden_size']}, {f['num_heads']} heads, FFN {f['intermediate_size']}, "
        f"vocabulary {f['vocab_size']}, {f['seq_len']} tokens, global batch {f['global_batch']}"
        + (f", embedding {f['embedding_size']}, one shared block" if name == "albert" else "") if name in ENCODERS else
        f", Lightning's demo Transformer, {f['nlayers']} encoder and {f['nlayers']} decoder layers, hidden {f['ninp']}, "
        f"{f['nhead']} heads, FFN {f['nhid']}, vocabulary {f['vocab_size']}, {f['seq_len']} random tokens, global batch "
        f"{f['global_batch']}" if name == "transformer" else f", vgg16_scaled(width={f['width']}), {f['in_size']}×{f['in_size']} random images, {f['num_classes']} classes, "
        f"global batch {f['global_batch']}, convolutions {f['conv_params']:,} parameters") for name, f in facts.items()]  # fmt: skip
    kc = doc["kernel_check"]
    lines = [*run_lines(doc, json_path), "", "Networks:", "", *nets, "", "Models (BERT-base: 12 layers, hidden 768, 12 heads, "
             "FFN 3072, 108M parameters; ALBERT-base: 12M):", "", *models, "",
             f"Time: {cfg['steps']} timed optimizer steps after {cfg['warmup_steps']} untimed, between barriers on every rank; "
             f"`ms/step` is that window over the steps, the fastest of {cfg.get('repeats', 1)} runs of the plan "
             "(`other load`: cores other sessions kept busy during the kept run); `CPU ms/step` the busiest rank's CPU time over the same steps (not reported by DeepSpeed). Bytes per step and rank: `measured` by the strategy's CommMeter, "
             "`model` from `tensor_parallel/cost.py`, `kernel` the veth's tx_bytes over the same window.", "",
             markdown_table(doc["rows"], ROW_COLUMNS), "", "Step time against DP (same model, network, ranks and global batch):",
             "", markdown_table(doc["ratios"], ratio_columns(doc["ratios"])), ""]  # fmt: skip
    if kc["rows"]:
        lines.append(f"Kernel tx against the byte model: {kc['within']} of {kc['rows']} rows of our strategies within "
                     f"{kc['tolerance']:.0%} (ratios {kc['min_ratio']:.3f} to {kc['max_ratio']:.3f}).")  # fmt: skip
    for c in doc["crossover"]:
        equal = (f"; the bytes are equal at a global batch of {c['bytes_equal_global_batch']:g}"
                 if c["bytes_equal_global_batch"] is not None else "")  # fmt: skip
        lines += ["", f"Crossover, {c['model']} {c['engine']} vs dp (2 ranks): compute {1000 * c['compute_dp_s']:.0f} vs "
                  f"{1000 * c['compute_tp_s']:.0f} ms/step ({c['compute_source']}), {c['bytes_dp'] / 1e6:.2f} vs {c['bytes_tp'] / 1e6:.2f} "
                  f"MB/step; {c['engine']} is faster {c['tp_wins']}{equal}."]  # fmt: skip
        if c["rates"]:
            lines += ["", markdown_table([{**c, **r} for r in c["rates"]], CROSS_COLUMNS)]
    for family, p in doc.get("paper_scale", {}).items():
        ratios_text = ", ".join(f"{k} tokens {v:.2f}x" for k, v in p["tp_over_dp_bytes"].items())
        lines += ["", f"Paper scale ({family}-base, {p['params']:,} parameters, {p['ranks']} ranks, byte model only): DP "
                  f"{p['dp_bytes_per_step'] / 1e6:.0f} MB per step and rank whatever the batch, TP "
                  f"{p['tp_bytes_per_token'] / 1e3:.0f} kB per token of the step, equal at "
                  f"{p['equal_bytes_tokens_per_step']:,} tokens per step; TP's bytes over DP's at batch x sequence "
                  f"{ratios_text} (paper 003's time ratio: {p['paper_time_ratio']})."]  # fmt: skip
    return "\n".join(lines)


def _network_groups(ax: Any, rows: Sequence[dict[str, Any]]) -> None:
    """Tick labels ``model config xN`` and each network's name over its run of bars, split by a vertical line."""
    ax.set_xticks(range(len(rows)), [f"{r['model']} {r['config']} x{r['world_size']}" for r in rows], rotation=90, fontsize=7)
    start = 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i]["network"] != rows[start]["network"]:
            ax.text((start + i - 1) / 2, 1.01, rows[start]["network"], transform=ax.get_xaxis_transform(), ha="center", fontsize=8)
            if i < len(rows):
                ax.axvline(i - 0.5, color="gray", lw=0.6)
            start = i


def plot(doc: dict[str, Any], path: str | Path) -> Path:
    """Step time per run, bytes per step (measured, model, kernel), time ratios against the paper, the time model."""
    fig = pyplot().figure(figsize=(16, 14))
    grid = fig.add_gridspec(3, 2, height_ratios=(1, 1, 1.2))
    top, middle = fig.add_subplot(grid[0, :]), fig.add_subplot(grid[1, :])
    left, ax = fig.add_subplot(grid[2, 0]), fig.add_subplot(grid[2, 1])
    rows = [r for r in doc["rows"] if r["step_s"]]
    x = list(range(len(rows)))
    top.bar(x, [1000 * r["step_s"] for r in rows], color=[f"C{CONFIGS.index(r['config'])}" for r in rows])
    top.set(ylabel="ms per step", yscale="log")
    top.set_title("step time (colour = configuration)", pad=16)
    for j, (key, name) in enumerate((("meter_bytes_per_step", "measured (meter)"), ("model_bytes_per_step", "byte model"),
                                     ("kernel_tx_bytes_per_step", "kernel tx"))):  # fmt: skip
        middle.bar([i + 0.27 * (j - 1) for i in x], [(r.get(key) or 0) / 1e6 for r in rows], 0.27, label=name)
    middle.set(ylabel="MB per step per rank", yscale="log")
    middle.set_title("bytes per step and rank", pad=16)
    middle.legend(fontsize=8)
    for panel in (top, middle):
        _network_groups(panel, rows)
    rat = doc.get("ratios", [])
    left.bar(range(len(rat)), [r["ratio"] for r in rat], color=[f"C{CONFIGS.index(r['config'])}" for r in rat])
    for model, ls in (("bert", "--"), ("albert", ":")):
        left.axhline(PAPER[model]["ratio"], color="k", ls=ls, lw=1, label=f"paper 003 {model} TP÷DP {PAPER[model]['ratio']}")
    left.axhline(1.0, color="gray", lw=0.8)
    left.set(ylabel="step time ÷ DP's", yscale="log")
    left.set_title("against DP (same model, network, ranks)", pad=16)
    _network_groups(left, rat)
    left.legend(fontsize=7)
    cross = doc.get("crossover", [])
    models = list(dict.fromkeys(c["model"] for c in cross))
    bws = [10 ** (5 + k / 20) for k in range(100)]  # 100 kB/s .. 10 GB/s
    styles = {"dp": ("-", "o"), "tp": ("--", "s"), "deepspeed_tp": ("-.", "^"), "hybrid": (":", "D")}
    for c in cross:
        color = f"C{models.index(c['model'])}"
        lines = [(c["engine"], c["compute_tp_s"], c["bytes_tp"], "measured_tp_s")]
        if c is next(x for x in cross if x["model"] == c["model"]):  # DP once per model
            lines.insert(0, ("dp", c["compute_dp_s"], c["bytes_dp"], "measured_dp_s"))
        for name, comp, nbytes, key in lines:
            ax.plot([b * 8 / 1e6 for b in bws], [comp + nbytes / b for b in bws], styles[name][0], color=color, lw=1,
                    label=f"{c['model']} {name}")  # fmt: skip
            pts = [(r["bandwidth_bytes_per_s"] * 8 / 1e6, r[key]) for r in c["rates"] if r[key]]
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=styles[name][1], color=color, s=18)
        if c["bandwidth_bytes_per_s"]:
            ax.axvline(c["bandwidth_bytes_per_s"] * 8 / 1e6, color=color, lw=0.6, ls=":")
    ax.set(xscale="log", yscale="log", xlabel="link bandwidth, Mbit/s", ylabel="s per step",
           title="t = compute + bytes / bandwidth (lines), measured (markers)")  # fmt: skip
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6, ncol=2)
    return save_figure(fig, path, dpi=100, title=f"tensor_parallel suite, {doc['created']}")


# -- command line ----------------------------------------------------------------------------------------

CLI = SuiteCli(config=SuiteConfig, quick=QUICK, full=FULL, out="tensor_parallel.json, tensor_parallel.png and docs_section.md",
               either={"networks": NETWORKS})  # fmt: skip

run = documented_run(SUITE, run_suite, docs_section)
