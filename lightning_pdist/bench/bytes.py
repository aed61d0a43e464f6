"""Bytes per step of every registered strategy on the recipes' digits model, from the byte models (no training).

``python -m lightning_pdist.bench bytes --out DIR`` writes ``DIR/bytes.json`` and ``DIR/docs_section.md``: for each
registered strategy, at the recipe's settings (``recipes/*.yaml``) on 2 ranks, batch 32 per rank, the bytes each rank
sends (what ``pdist/comm_bytes`` logs) in each of the first ``steps`` optimizer steps, under ``nonfinite="raise"``
(the default; ``"skip_step"`` sends the same) and ``nonfinite="propagate"``. Nothing is measured here: every figure
comes from the functions the strategies count with, so the file changes only when the code does;
``tests/cross/test_bytes_per_step.py`` runs real 2-rank fits and checks that the logged bytes equal these figures
step by step.

Model: ``ClassifierModule(model="cnn")`` (``SmallCNN(width=16)``, 19,178 fp32 parameters in 8 tensors, no buffers),
except ``tensor_parallel``, which refuses that CNN (nothing to shard) and runs on ``ClassifierModule(model="mlp")``
(``Linear(64, 128)`` column-wise, ``Linear(128, 10)`` row-wise; 9,610 parameters). The byte models:

* all-reduce of ``n`` bytes on ``N`` ranks: ``2(N−1)/N · n`` (:func:`~lightning_pdist.core.accounting.all_reduce_bytes`);
* the non-finite agreement: one all-reduce of ``N`` float32 flags (:func:`~lightning_pdist.core.nonfinite.one_hot_flag`),
  8 B at ``N = 2``, on every step that does not all-reduce gradients (averaging after warm-up, flushed pipelines,
  tensor parallelism); the sign vote carries its flag in the all-to-all header it sends anyway, the parameter
  servers agree through the store (not counted), DDP's averaged gradients need none, PipeDream/2BW agree on nothing;
* averaging schedules: :class:`~lightning_pdist.averaging.schedule.PeriodicSchedule` (warm-up steps average
  gradients, then a model all-reduce after step ``t`` when ``(t − warm-up) % period == 0``);
* sign votes: :func:`~lightning_pdist.sign.hooks.sign_hook_bytes` for the one DDP bucket;
* parameter server: each worker's ``PUSHPULL`` message as :func:`~lightning_pdist.core.ps_wire.encode_message`
  frames it (header, JSON metadata with the request's ``patience``, the gradient);
* pipeline: per micro-batch one frame (:data:`~lightning_pdist.pipeline.p2p.HEADER_BYTES` + the tensor) across the
  cut, plus a header-only frame announcing the shape the first time each peer sees it;
* tensor parallelism: one all-reduce of each row-wise layer's ``(B, out)`` output (the column-wise layer's input,
  the data, needs no gradient, so no backward all-reduce);
* compression (the registered names at their defaults, one DDP bucket): TernGrad's gathered payload (the
  ``(length, flag)`` header, a 4-byte scale per tensor, 2 bits per entry;
  :func:`~lightning_pdist.compression.exchange.gather_wire_bytes`); PowerSGD's 4-byte flag all-reduce per bucket, then a
  plain all-reduce for its first ``start_iter`` steps and :func:`~lightning_pdist.compression.powersgd.powersgd_bytes`
  after; the flag is in both policies (it is the exchange's own header);
* DiLoCo / streaming DiLoCo: the flag every step, and at each fragment's exchange (the schedule's ``starts_after``)
  an all-reduce of its fp32 delta and float buffers, or with ``quantize`` an all-gather of its codes and scales
  (:func:`~lightning_pdist.diloco.quantize.code_bytes`).

Top-k, DGC and QSGD send a Zstandard code whose length depends on the gradients, so no byte model gives it exactly:
:data:`CODED_CASES` rows (``doc["coded_rows"]``) hold per step the exact part (header, length prefix, fp32 values or
scales) and the payload uncoded (raw int32 indices, raw int8 levels); the logged bytes lie strictly between.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_pdist.bench.cli import SuiteCli
from lightning_pdist.bench.report import command_line, markdown_table, new_document, write_json

__all__ = ["CASES", "POLICIES", "CLI", "SuiteConfig", "compute", "docs_section", "run", "step_bytes"]

SUITE = "bytes"
WORLD = 2
BATCH = 32
POLICIES = ("raise", "propagate")

#: (registered name, strategy keyword arguments as in the recipe, model, steps listed). The steps cover every kind
#: of step the strategy has at those settings (warm-up, local, averaging, the first pipeline step ...).
CASES: tuple[tuple[str, dict[str, Any], str, int], ...] = (
    ("pdist_ddp", {}, "cnn", 3),
    ("local_sgd", {"period": 8, "warmup_steps": 20}, "cnn", 29),
    ("simuparallel_sgd", {}, "cnn", 3),
    ("bmuf", {"period": 8}, "cnn", 9),
    ("easgd", {"period": 4}, "cnn", 5),
    ("signsgd_mv", {"aggregation": "majority", "momentum": 0.9}, "cnn", 3),
    ("it_signsgd", {"aggregation": "llr", "warmup_rounds": 10, "estimator": "worker"}, "cnn", 12),
    ("parameter_server", {"sharding": "memory", "mode": "sync"}, "cnn", 4),
    ("parameter_server_async", {"sharding": "memory", "mode": "async"}, "cnn", 3),
    ("parameter_server_ssp", {"sharding": "memory", "mode": "ssp", "staleness": 2}, "cnn", 3),
    ("pipeline_gpipe", {"num_stages": 2, "schedule": "gpipe"}, "cnn", 3),
    ("pipeline_1f1b", {"num_stages": 2, "schedule": "1f1b"}, "cnn", 3),
    ("pipedream", {"num_stages": 2, "schedule": "pipedream"}, "cnn", 3),
    ("pipedream_2bw", {"num_stages": 2, "schedule": "2bw"}, "cnn", 3),
    ("tensor_parallel", {"tensor_parallel_size": 2}, "mlp", 3),
    ("terngrad", {}, "cnn", 3),
    ("powersgd", {}, "cnn", 4),
    ("diloco", {"sync_every": 20, "outer_optimizer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.9}, "cnn", 21),
    ("streaming_diloco", {"sync_every": 20, "num_fragments": 2, "overlap_steps": 2, "fragment_alpha": 0.0,
                          "quantize": "int4", "outer_optimizer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.9},
     "cnn", 21),
)
#: The registered compressors whose payload is Zstandard-coded (data-dependent length): bounded, not exact.
CODED_CASES: tuple[tuple[str, dict[str, Any], str, int], ...] = (
    ("topk", {}, "cnn", 3),
    ("dgc", {}, "cnn", 3),
    ("qsgd", {}, "cnn", 3),
)


@functools.lru_cache(maxsize=None)
def _module(model: str):
    from lightning_pdist.models import ClassifierModule

    return ClassifierModule(model=model, lr=0.05, momentum=0.9)


def _flag_bytes(world: int) -> int:
    from lightning_pdist.core.accounting import all_reduce_bytes
    from lightning_pdist.core.nonfinite import one_hot_flag

    flags = one_hot_flag(False, 0, world)
    return all_reduce_bytes(flags.numel() * flags.element_size(), world)


def _averaging(name: str, kwargs: dict, model_bytes: int, step: int, policy: str) -> int:
    from lightning_pdist.averaging.schedule import OneShotSchedule, PeriodicSchedule
    from lightning_pdist.core.accounting import all_reduce_bytes

    if name == "pdist_ddp":
        return all_reduce_bytes(model_bytes, WORLD)
    if name == "simuparallel_sgd":
        schedule: PeriodicSchedule = OneShotSchedule()
    else:
        schedule = PeriodicSchedule(kwargs["period"], kwargs.get("warmup_steps", 0))
    if schedule.averages_gradients(step):  # a DDP step: its averaged gradients need no flag
        return all_reduce_bytes(model_bytes, WORLD)
    flag = 0 if policy == "propagate" else _flag_bytes(WORLD)
    return flag + (all_reduce_bytes(model_bytes, WORLD) if schedule.syncs_after(step) else 0)


def _sign(kwargs: dict, module) -> int:
    from lightning_pdist.sign.hooks import sign_hook_bytes

    params = [p for p in module.parameters() if p.requires_grad]  # one DDP bucket: 76,712 B < DDP's first 1 MiB
    numel = sum(p.numel() for p in params)
    estimator = kwargs.get("estimator", "worker") if kwargs["aggregation"] == "llr" else None
    return sum(sign_hook_bytes(numel, WORLD, len(params), estimator=estimator).values())


def _parameter_server(kwargs: dict, module, step: int, rank: int) -> int:
    """One ``PUSHPULL`` per step to the one server (``ceil(2/2)``), framed as the client frames it.

    ``version`` is the server's shard version the gradient was computed on: ``step − 1`` in sync mode (one server
    step per worker step); in async/SSP the worker's first push carries 0 and each later one the version its last
    pull returned, which depends on arrival order but stays a one-digit number for the steps listed here, so the
    frame's length does not (its JSON is what varies; only its length counts).
    """
    from lightning_pdist.parameter_server import ParameterServerStrategy
    from lightning_pdist.parameter_server.layout import numeric_hparams
    from lightning_pdist.core.ps_wire import Kind, encode_message

    optimizer = module.configure_optimizers()
    optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
    params = [p for p in module.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    version = step - 1 if kwargs["mode"] == "sync" else 0
    patience = float(inspect.signature(ParameterServerStrategy).parameters["server_timeout"].default)
    meta = {"worker": rank, "version": version, "hparams": [numeric_hparams(g) for g in optimizer.param_groups],
            "optimizer": 0, "present": "1" * len(params),
            "patience": patience}  # a waiting request tells the server how long the worker waits (client.request)
    head, _ = encode_message(Kind.PUSHPULL, meta)
    return len(head) + 4 * numel


def _pipeline(name: str, module, step: int, policy: str) -> int:
    """Both ranks send the same: stage 0 each micro-batch's activation, stage 1 its gradient back."""
    import torch

    from lightning_pdist.pipeline.p2p import HEADER_BYTES
    from lightning_pdist.pipeline.partition import find_network, list_layers, partition

    micro = 2 * WORLD  # num_microbatches=None: 2K
    path, network = find_network(module)
    layers = list_layers(network, path)
    first = partition(layers, WORLD).bounds[0]
    x = torch.zeros(BATCH // micro, 1, 8, 8)
    with torch.no_grad():
        for _, layer in layers[first[0] : first[1]]:
            x = layer(x)
    sent = micro * (HEADER_BYTES + x.numel() * x.element_size())
    if step == 1:
        sent += HEADER_BYTES  # the first frame to the peer announces the shape
    flushed = name in ("pipeline_gpipe", "pipeline_1f1b")
    return sent + (_flag_bytes(WORLD) if flushed and policy != "propagate" else 0)


def _tensor_parallel(module, policy: str) -> int:
    from torch import nn

    from lightning_pdist.core.accounting import all_reduce_bytes
    from lightning_pdist.tensor_parallel.plan import plan_for

    plan = plan_for(module)
    modules = dict(module.named_modules())
    rows = [modules[n] for n, style in plan.layers if style == "rowwise"]
    assert all(isinstance(m, nn.Linear) for m in rows)
    sent = sum(all_reduce_bytes(4 * BATCH * m.out_features, WORLD) for m in rows)
    return sent + (0 if policy == "propagate" else _flag_bytes(WORLD))


def _shapes(module) -> list:
    return [tuple(p.shape) for p in module.parameters() if p.requires_grad]


def _compressed(name: str, module, step: int) -> int:
    """TernGrad and PowerSGD at the registered defaults (one DDP bucket), per step."""
    from lightning_pdist.compression.exchange import gather_wire_bytes
    from lightning_pdist.compression.powersgd import powersgd_bytes
    from lightning_pdist.compression.strategy import REGISTERED
    from lightning_pdist.core.accounting import all_reduce_bytes

    compressor, shapes = REGISTERED[name][0], _shapes(module)
    numel = sum(math.prod(s) for s in shapes)
    if name == "terngrad":
        return gather_wire_bytes(4 * len(shapes) + math.ceil(2 * numel / 8), WORLD)
    flag = all_reduce_bytes(4, WORLD)
    if step <= compressor.start_iter:  # torch's iter counts from 0: steps 1..start_iter all-reduce plainly
        return flag + all_reduce_bytes(4 * numel, WORLD)
    return flag + powersgd_bytes(shapes, compressor.rank, compressor.min_compression_rate, WORLD)


def coded_bounds(name: str, module, step: int) -> tuple[int, int]:
    """(exact part, payload uncoded) of a :data:`CODED_CASES` step: the logged bytes lie strictly between."""
    from lightning_pdist.compression.exchange import gather_wire_bytes
    from lightning_pdist.compression.sparse import dgc_density, keep_count
    from lightning_pdist.compression.strategy import REGISTERED

    compressor, shapes = REGISTERED[name][0], _shapes(module)
    numels = [math.prod(s) for s in shapes]
    if name == "qsgd":
        scales = 4 * len(shapes) + 4  # a scale per tensor, the code's length prefix
        return gather_wire_bytes(scales, WORLD), gather_wire_bytes(scales + sum(numels), WORLD)  # int8 levels
    density = compressor.ratio
    if name == "dgc":
        density = dgc_density(compressor.ratio, step - 1, compressor.warmup_steps, compressor.warmup_stages)
    k = sum(keep_count(density, d) for d in numels)
    return gather_wire_bytes(4 + 4 * k, WORLD), gather_wire_bytes(4 + 8 * k, WORLD)  # prefix, fp32 values, int32 indices


def _diloco(name: str, kwargs: dict, module, step: int, policy: str) -> int:
    """The flag every step (each rank's own gradients), plus each fragment exchange the schedule starts after ``step``."""
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_pdist.core.accounting import all_gather_bytes, all_reduce_bytes
    from lightning_pdist.diloco.fragments import fragment_modules, fragment_tensors
    from lightning_pdist.diloco.quantize import code_bytes

    strategy = StrategyRegistry[name]["strategy"](**kwargs)
    schedule = strategy.schedule
    groups = fragment_modules(module, schedule.num_fragments, None, name, schedule.balance)
    parts = fragment_tensors(module, groups)
    sent = 0 if policy == "propagate" else _flag_bytes(WORLD)
    for p in schedule.starts_after(step):
        params, buffers = parts[p]
        n = sum(t.numel() for t in params)
        b = sum(t.numel() for t in buffers if t.is_floating_point())
        if schedule.quantize is None:
            sent += all_reduce_bytes(4 * (n + b), WORLD)
        else:
            sent += all_gather_bytes(sum(code_bytes(n, schedule.quantize)), WORLD)
            sent += all_reduce_bytes(4 * b, WORLD) if b else 0
    return sent


def step_bytes(name: str, kwargs: dict, model: str, step: int, rank: int, policy: str) -> int:
    """Bytes rank ``rank`` sends in optimizer step ``step`` (1-based) of strategy ``name`` at ``kwargs``."""
    module = _module(model)
    model_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    if name in ("pdist_ddp", "local_sgd", "simuparallel_sgd", "bmuf", "easgd"):
        return _averaging(name, kwargs, model_bytes, step, policy)
    if name in ("signsgd_mv", "it_signsgd"):
        return _sign(kwargs, module)
    if name.startswith("parameter_server"):
        return _parameter_server(kwargs, module, step, rank)
    if name.startswith("pipe"):
        return _pipeline(name, module, step, policy)
    if name == "tensor_parallel":
        return _tensor_parallel(module, policy)
    if name in ("terngrad", "powersgd"):
        return _compressed(name, module, step)
    if name in ("diloco", "streaming_diloco"):
        return _diloco(name, kwargs, module, step, policy)
    raise ValueError(f"step_bytes(name={name!r}): no byte model for this strategy")


def compute(command: str = "python -m lightning_pdist.bench bytes --out docs/results") -> dict[str, Any]:
    """The document: per strategy and policy, every rank's bytes in each listed step."""
    doc = new_document(SUITE, command, {"world_size": WORLD, "batch_size": BATCH})
    doc.pop("created", None)  # a pure function of the code: no timestamp, so an unchanged file stays unchanged
    doc.pop("host", None)
    doc.pop("networks", None)
    for name, kwargs, model, steps in CASES:
        module = _module(model)
        row: dict[str, Any] = {"strategy": name, "settings": kwargs, "model": model,
                               "params": sum(p.numel() for p in module.parameters()), "steps": steps}  # fmt: skip
        for policy in POLICIES:
            row[policy] = [[step_bytes(name, kwargs, model, t, r, policy) for t in range(1, steps + 1)]
                           for r in range(WORLD)]  # fmt: skip
        doc["rows"].append(row)
    doc["coded_rows"] = []
    for name, kwargs, model, steps in CODED_CASES:
        module = _module(model)
        bounds = [coded_bounds(name, module, t) for t in range(1, steps + 1)]
        doc["coded_rows"].append({"strategy": name, "settings": kwargs, "model": model,
                                  "params": sum(p.numel() for p in module.parameters()), "steps": steps,
                                  "exact_part": [b[0] for b in bounds], "uncoded": [b[1] for b in bounds]})  # fmt: skip
    doc["sign_examples"] = sign_examples()
    doc["pipeline_replicas"] = pipeline_replicas()
    doc["tensor_parallel_recipe"] = tensor_parallel_recipe()
    return doc


def tensor_parallel_recipe() -> dict[str, Any]:
    """``recipes/tensor_parallel.yaml`` (BERT-like, 2 layers, hidden 128, batch 16 × 128 tokens, t = 2): TP's
    activation all-reduces (:func:`~lightning_pdist.tensor_parallel.cost.tp_encoder_bytes`) plus the non-finite
    flag, against DP's gradient all-reduce of the same model. Needs ``transformers`` (the ``encoders`` extra) for the
    parameter count; without it, ``{}``."""
    from lightning_pdist.tensor_parallel.cost import dp_bytes, tp_encoder_bytes

    try:
        from lightning_pdist.models import ClassifierModule
        from lightning_pdist.models.encoder import EncoderClassifier

        encoder = EncoderClassifier(family="bert", vocab_size=5000, max_len=128, hidden_size=128, num_layers=2,
                                    num_heads=4, intermediate_size=512, dropout=0.1)  # fmt: skip
        params = sum(p.numel() for p in ClassifierModule(model=encoder, num_classes=2, vocab_size=5000).parameters())
    except ImportError:
        return {}
    tp = tp_encoder_bytes(16, 128, 128, 2, 2).total
    return {"params": params, "dp": dp_bytes(params, 2).total, "tp": tp, "flag": _flag_bytes(2), "tp_raise": tp + _flag_bytes(2)}


def sign_examples() -> list[dict[str, Any]]:
    """The sign card's table: :func:`~lightning_pdist.sign.hooks.sign_hook_bytes` by collective for one bucket of
    ``d`` coordinates in ``T`` tensors on ``M`` ranks, against the fp32 ring all-reduce of the same gradient."""
    from lightning_pdist.core.accounting import all_reduce_bytes
    from lightning_pdist.sign.hooks import sign_hook_bytes

    rows = []
    for model, d, tensors, world in (("TinyRegression", 58, 4, 3), ("SmallCNN", 19178, 8, 2), ("SmallCNN", 19178, 8, 15)):
        row: dict[str, Any] = {"model": model, "d": d, "tensors": tensors, "world_size": world,
                               "fp32_all_reduce": all_reduce_bytes(4 * d, world)}  # fmt: skip
        for name, estimator in (("signsgd_mv", None), ("it_signsgd", "worker")):
            kinds = sign_hook_bytes(d, world, tensors, estimator=estimator)
            row[name] = {**kinds, "total": sum(kinds.values()), "fp32_over_sign": row["fp32_all_reduce"] / sum(kinds.values())}
        rows.append(row)
    return rows


def pipeline_replicas() -> dict[str, Any]:
    """``recipes/pipeline.yaml`` with ``--trainer.devices=4``: 2 stages × 2 replicas; per stage, a steady step's bytes
    (the activations or gradients across the cut, the replicas' all-reduce of the stage's gradient, the flag of 4)."""
    from lightning_pdist.core.accounting import all_reduce_bytes
    from lightning_pdist.pipeline.partition import find_network, list_layers, partition

    module = _module("cnn")
    path, network = find_network(module)
    layers = list_layers(network, path)
    cut = partition(layers, 2)
    params = [sum(p.numel() for _, layer in layers[a:b] for p in layer.parameters()) for a, b in cut.bounds]
    p2p = _pipeline("pipeline_1f1b", module, 2, "propagate")
    replicas = [all_reduce_bytes(4 * n, 2) for n in params]
    flag = _flag_bytes(4)
    return {"stage_params": params, "p2p": p2p, "replica_all_reduce": replicas, "flag": flag,
            "total": [p2p + r + flag for r in replicas]}  # fmt: skip


def _summary(per_step: list[list[int]]) -> str:
    """``a (steps 1-20), b (21-27), c (28)``: each distinct run of equal figures on rank 0, then rank 1 if it differs."""

    def runs(values: list[int]) -> str:
        parts, start = [], 0
        for i in range(1, len(values) + 1):
            if i == len(values) or values[i] != values[start]:
                span = f"{start + 1}" if i - start == 1 else f"{start + 1}-{i}"
                parts.append(f"{values[start]:,} ({span})")
                start = i
        return ", ".join(parts)

    text = runs(per_step[0])
    return text if all(r == per_step[0] for r in per_step[1:]) else f"rank 0: {text}; rank 1: {runs(per_step[1])}"


def docs_section(doc: dict[str, Any], path: str) -> str:
    """The table docs/benchmarks.md shows: bytes per rank per step (step numbers in brackets)."""
    rows = [{"strategy": r["strategy"], "settings": ", ".join(f"{k}={v}" for k, v in r["settings"].items()) or "defaults",
             "model": f"{r['model']} ({r['params']:,})", "raise": _summary(r["raise"]),
             "propagate": _summary(r["propagate"])} for r in doc["rows"]]  # fmt: skip
    table = markdown_table(rows, [("strategy", "strategy", None), ("settings", "settings", None),
                                  ("model (params)", "model", None),
                                  ('B/step, nonfinite="raise" (steps)', "raise", None),
                                  ('B/step, nonfinite="propagate" (steps)', "propagate", None)])  # fmt: skip
    coded = [{"strategy": r["strategy"], "model": f"{r['model']} ({r['params']:,})",
              "exact": _summary([r["exact_part"]]), "uncoded": _summary([r["uncoded"]])} for r in doc.get("coded_rows", [])]
    coded_table = markdown_table(coded, [("strategy (registered defaults)", "strategy", None),
                                         ("model (params)", "model", None),
                                         ("exact part, B/step (steps)", "exact", None),
                                         ("uncoded payload, B/step (steps)", "uncoded", None)])  # fmt: skip
    return (f"Command: `{doc['command']}`  \nOutput: `{path}`\n\n{table}\n\nZstandard-coded payloads (both policies; "
            f"the logged bytes lie strictly between the two figures, the code's length depending on the gradients):"
            f"\n\n{coded_table}\n")


@dataclass(frozen=True)
class SuiteConfig:
    """No options: every figure is computed from the code's byte models, nothing is timed."""

    quick: bool = False


CLI = SuiteCli(config=SuiteConfig, quick={}, full={}, out="bytes.json and docs_section.md")


def run(config: SuiteConfig, out: Path, argv: Sequence[str]) -> int:
    """Compute the figures, write bytes.json and the docs section, print the table."""
    doc = compute(command_line(SUITE, argv))
    write_json(doc, out / f"{SUITE}.json")
    section = docs_section(doc, str(out / f"{SUITE}.json"))
    (out / "docs_section.md").write_text(section)
    print(section)
    return 0


if __name__ == "__main__":  # pragma: no cover
    print(json.dumps(compute(), indent=1))
