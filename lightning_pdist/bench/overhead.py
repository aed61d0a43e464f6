"""The overhead row of the averaging suite: ``pdist_ddp`` against Lightning's own ``ddp``, step for step.

``pdist_ddp`` is Lightning's ``DDPStrategy`` plus what every algorithm here relies on (a counted comm hook, the
non-finite check, ``pdist/*`` logging); on a small model those are Python work that a step of a few milliseconds
feels. The target: within 5% per step of ``ddp`` on the same module.

One launch of ``world_size`` loopback ranks (``python -m lightning_pdist.bench.overhead --spec JSON --out-dir
DIR``); each rank trains ``ClassifierModule(model="cnn", width=w)`` on the digits with ``ddp``, ``pdist_ddp`` and
``ddp`` once more (a control: two identical strategies' ratio is the measurement's own noise) in turn, in the same
process, ``repeats`` times per width, rotating which goes first, so slow drifts of the machine's background load
fall on all alike. Per fit it records the wall time of every step after
``warmup_steps`` (from one ``on_train_batch_end`` to the next: the whole Lightning step, data loading, logging
and the hook included) and writes ``DIR/overhead<r>.json``: ``{"rank", "fits": [{"strategy", "width",
"repeat", "step_ms": [...]}]}``.

:func:`overhead_rows` turns the ranks' files into one row per width: the median step time of each fit (the ranks'
steps share one collective rhythm; their medians are averaged), the median over repeats per strategy, each
repeat's ratio ``pdist_ddp / ddp`` (two fits back to back: the pair shares the machine's load of that moment) and
the median of those ratios, the row's ``ratio``. Medians, not means: a step or a repeat that another process on
the machine delayed is an outlier, not part of the cost. Other processes only ever add time, so the same figures
from each fit's 20th percentile (``ratio_p20``) are the less disturbed estimate on a busy machine, and each
rank's CPU time per step (``ratio_cpu``, the process's threads included) the least.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_pdist.bench.report import check_spec_keys
from lightning_pdist.bench.launch import bench_trainer, worker_main

#: ``ddp_again`` is Lightning's ``ddp`` once more: its ratio to ``ddp`` is the noise of the measurement itself.
STRATEGIES = ("ddp", "pdist_ddp", "ddp_again")
#: Defaults in one place: SmallCNN's default width and the suite's width; steps per fit scale with the step time.
OVERHEAD = {"widths": (16, 64), "steps": {16: 120, 64: 36}, "warmup_steps": 12, "repeats": 14, "batch_size": 32}
SPEC_KEYS = ("world_size", "widths", "steps", "warmup_steps", "repeats", "batch_size", "seed")
ROW_KEYS = ("width", "model_params", "ddp_ms_per_step", "pdist_ddp_ms_per_step", "ratio", "ratio_by_repeat")


def overhead_spec(world_size: int = 2, seed: int = 0, widths: Sequence[int] = OVERHEAD["widths"],
                  repeats: int = OVERHEAD["repeats"]) -> dict[str, Any]:  # fmt: skip
    """The spec of one overhead launch (a plain dict: it travels on the command line)."""
    return {"world_size": world_size, "widths": list(widths), "repeats": repeats, "seed": seed,
            "steps": {str(w): OVERHEAD["steps"].get(w, max(36, 120 * 16 // w)) for w in widths},
            "warmup_steps": OVERHEAD["warmup_steps"], "batch_size": OVERHEAD["batch_size"]}  # fmt: skip


def _strategy(name: str) -> Any:
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_pdist import PdistStrategy

    # At their defaults, as a user gets them by name; gloo on CPU.
    if name == "pdist_ddp":
        return PdistStrategy(process_group_backend="gloo")
    return DDPStrategy(process_group_backend="gloo")


def run_rank(spec: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """One rank: every (repeat, width, strategy) fit in turn; write and return its step times."""
    from lightning.pytorch import Callback, seed_everything

    from lightning_pdist.data import DigitsDataModule
    from lightning_pdist.models.classifier import ClassifierModule

    check_spec_keys(spec, SPEC_KEYS, "overhead")
    env = dict(os.environ)  # Lightning's teardown drops the launcher's variables; each fit starts from them

    class Clock(Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.cpu: list[float] = []

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.ends.append(time.perf_counter())
            self.cpu.append(time.process_time())

    fits, rank = [], int(env["RANK"])
    for repeat in range(spec["repeats"]):
        for width in spec["widths"]:
            shift = repeat % len(STRATEGIES)  # each strategy takes each place in the order equally often
            order = STRATEGIES[shift:] + STRATEGIES[:shift]
            for name in order:
                os.environ.clear()
                os.environ.update(env)
                seed_everything(spec["seed"], workers=True, verbose=False)
                clock = Clock()
                trainer = bench_trainer(devices=1, num_nodes=spec["world_size"], strategy=_strategy(name),
                                        max_steps=spec["steps"][str(width)], callbacks=[clock])  # fmt: skip
                module = ClassifierModule(model="cnn", width=width, optimizer="sgd", lr=0.05, momentum=0.9)
                trainer.fit(module, datamodule=DigitsDataModule(batch_size=spec["batch_size"], seed=spec["seed"]))
                ends, cpu = clock.ends[spec["warmup_steps"] :], clock.cpu[spec["warmup_steps"] :]
                fits.append({"strategy": name, "width": width, "repeat": repeat,
                             "model_params": sum(p.numel() for p in module.parameters()),
                             "step_ms": [round(1000 * (b - a), 4) for a, b in zip(ends, ends[1:])],
                             "cpu_ms_per_step": 1000 * (cpu[-1] - cpu[0]) / max(1, len(cpu) - 1)})  # fmt: skip
    result = {"rank": rank, "fits": fits}
    return result


def overhead_rows(ranks: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per width from every rank's :func:`run_rank` result (see the module docstring).

    Raises:
        ValueError: ``ranks`` is empty or a fit has no timed steps.
    """
    if not ranks:
        raise ValueError("overhead_rows(ranks=[]): need every rank's result")
    per_fit: dict[tuple[int, str, int], list[tuple[float, float]]] = {}
    params: dict[int, int] = {}
    for rank in ranks:
        for fit in rank["fits"]:
            if not fit["step_ms"]:
                raise ValueError(f"overhead_rows: the {fit['strategy']} fit at width {fit['width']} timed no step; "
                                 "raise steps above warmup_steps + 1")  # fmt: skip
            times = sorted(fit["step_ms"])
            per_fit.setdefault((fit["width"], fit["strategy"], fit["repeat"]), []).append(
                (statistics.median(times), times[len(times) // 5], fit["cpu_ms_per_step"]))
            params[fit["width"]] = fit["model_params"]
    rows = []
    for width in sorted(params):
        repeats = sorted({r for w, _, r in per_fit if w == width})
        by = {(name, q): [statistics.fmean(t[q] for t in per_fit[(width, name, r)]) for r in repeats]
              for name in STRATEGIES for q in (0, 1, 2)}  # q: the fit's median, its 20th percentile, CPU per step
        ddp, ours = statistics.median(by["ddp", 0]), statistics.median(by["pdist_ddp", 0])
        paired = {q: [b / a for a, b in zip(by["ddp", q], by["pdist_ddp", q])] for q in (0, 1, 2)}
        control = [b / a for a, b in zip(by["ddp", 0], by["ddp_again", 0])]
        rows.append({
            "width": width, "model_params": params[width], "repeats": len(repeats),
            "ddp_ms_per_step": round(ddp, 3), "pdist_ddp_ms_per_step": round(ours, 3),
            "ratio": round(statistics.median(paired[0]), 4), "ratio_by_repeat": [round(r, 4) for r in paired[0]],
            "ratio_p20": round(statistics.median(paired[1]), 4), "ratio_cpu": round(statistics.median(paired[2]), 4),
            "control_ratio": round(statistics.median(control), 4),
            "control_ratio_by_repeat": [round(r, 4) for r in control],
            "ddp_cpu_ms_per_step": round(statistics.median(by["ddp", 2]), 3),
            "pdist_ddp_cpu_ms_per_step": round(statistics.median(by["pdist_ddp", 2]), 3),
            "ddp_ms_by_repeat": [round(x, 3) for x in by["ddp", 0]],
            "pdist_ddp_ms_by_repeat": [round(x, 3) for x in by["pdist_ddp", 0]],
        })  # fmt: skip
    return rows


if __name__ == "__main__":
    raise SystemExit(worker_main("lightning_pdist.bench.overhead", __doc__, lambda spec: spec, run_rank, prefix="overhead"))
