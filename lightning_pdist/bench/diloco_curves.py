"""The DiLoCo suite's curves: loss against bytes and wall time, when each run reaches DDP's loss, peak bytes/s.

Per run (:func:`curve_fields`, from the ranks' per-step records of :mod:`lightning_pdist.bench.diloco_worker`):

* the loss curve: the rank-mean training loss at each step, smoothed by a trailing mean of ``SMOOTH`` steps (the
  loss of each replica on its own batches: between synchronizations that is not the global model's loss, which
  only the final validation measures), against the slowest rank's seconds since the loop's start and against the
  cumulative bytes one rank sends by the byte model; kept at about ``POINTS`` steps in the row;
* ``peak_kernel_bytes`` / ``peak_kernel_bytes_per_s``: the most one rank's emulated link sent in one step, and
  the most bytes per second over one step (that step's bytes over its duration); ``None`` on loopback.

:func:`add_reach` then gives every row the first step at which its smoothed loss is within ``REACH`` (2%) of DDP's
final smoothed loss on the same network, with the seconds and the cumulative model bytes at that step
(``None``: not reached within the run). :func:`plot` draws loss against bytes and against wall time per network.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_pdist.bench.report import pyplot, save_figure

SMOOTH = 20
POINTS = 60
REACH = 1.02
FULL = "_curve_full"  # the full-resolution curve while the suite computes the reach; dropped before writing


def curve_fields(ranks: Sequence[dict[str, Any]], step_bytes: Sequence[float]) -> dict[str, Any]:
    """The row's curve and peak kernel rates from the ranks' records and the byte model's bytes at each step."""
    steps = len(step_bytes)
    mean = [sum(r["losses"][t] for r in ranks) / len(ranks) for t in range(steps)]
    smooth, total = [], 0.0
    for t, value in enumerate(mean):
        total += value - (mean[t - SMOOTH] if t >= SMOOTH else 0.0)
        smooth.append(total / min(t + 1, SMOOTH))
    seconds = [max(r["step_end_s"][t] for r in ranks) for t in range(steps)]
    cum, acc = [], 0.0
    for b in step_bytes:
        acc += b
        cum.append(acc)
    every = max(1, steps // POINTS)
    keep = sorted({*range(every - 1, steps, every), steps - 1})
    out: dict[str, Any] = {
        "curve": {"step": [t + 1 for t in keep], "seconds": [round(seconds[t], 3) for t in keep],
                  "model_bytes": [round(cum[t]) for t in keep], "loss": [round(smooth[t], 4) for t in keep]},
        FULL: {"seconds": seconds, "model_bytes": cum, "loss": smooth},
        "peak_kernel_bytes": None, "peak_kernel_bytes_per_s": None,
    }  # fmt: skip
    if all(r.get("step_tx_bytes") for r in ranks):
        rates, peak = [], 0
        for r in ranks:
            ends = r["step_end_s"]
            for t, sent in enumerate(r["step_tx_bytes"]):
                peak = max(peak, sent)
                rates.append(sent / max(ends[t] - (ends[t - 1] if t else 0.0), 1e-6))
        out.update(peak_kernel_bytes=peak, peak_kernel_bytes_per_s=round(max(rates)))
    return out


def add_reach(rows: list[dict[str, Any]]) -> None:
    """Each row's first step within ``REACH`` of DDP's final smoothed loss on its network with as many ranks (see
    the module)."""
    for row in rows:
        full = row.pop(FULL, None)
        ddp = next((r for r in rows if r["network"] == row["network"] and r.get("world_size") == row.get("world_size")
                    and r["strategy"] == "ddp" and r.get("curve")), None)  # fmt: skip
        row.update(target_loss=None, reach_step=None, reach_s=None, reach_model_bytes=None)
        if full is None or ddp is None:
            continue
        target = round(ddp["curve"]["loss"][-1] * REACH, 4)
        row["target_loss"] = target
        for t, loss in enumerate(full["loss"]):
            if loss <= target:
                row.update(reach_step=t + 1, reach_s=round(full["seconds"][t], 2),
                           reach_model_bytes=round(full["model_bytes"][t]))  # fmt: skip
                break


def plot(doc: dict[str, Any], path: Path) -> Path | None:
    """Loss against cumulative bytes (left, the runs of the network with the most; bytes do not depend on the link)
    and against wall time (one panel per network), one line per run."""
    rows = [r for r in doc["rows"] if not r.get("error") and r.get("curve")]
    if not rows:
        return None
    plt = pyplot()
    networks = list(dict.fromkeys(r["network"] for r in rows))
    sizes = sorted({r["world_size"] for r in rows})
    name = lambda r: r["label"] + (f" ×{r['world_size']}" if len(sizes) > 1 else "")  # noqa: E731
    fig, axes = plt.subplots(1, 1 + len(networks), figsize=(6 * (1 + len(networks)), 5.5), squeeze=False)
    most = max(networks, key=lambda n: sum(r["network"] == n for r in rows))
    first = [r for r in rows if r["network"] == most]
    ax = axes[0][0]
    for r in first:
        c = r["curve"]  # from the first byte sent (a log axis has no 0)
        points = [(b, loss) for b, loss in zip(c["model_bytes"], c["loss"]) if b > 0]
        ax.plot([b for b, _ in points], [loss for _, loss in points], label=name(r), lw=1, drawstyle="steps-post")
    ax.set_xscale("log")
    ax.set_xlabel("cumulative bytes sent per rank (byte model, log)")
    ax.set_ylabel(f"training loss, rank mean, trailing mean of {SMOOTH} steps")
    ax.set_title(f"loss against bytes ({most})", fontsize=9)
    ax.legend(fontsize=6)
    for ax, net in zip(axes[0][1:], networks):
        for r in (r for r in rows if r["network"] == net):
            ax.plot(r["curve"]["seconds"], r["curve"]["loss"], label=name(r), lw=1)
        ax.set_xlabel("seconds since the loop's start (slowest rank)")
        ax.set_title(f"loss against wall time ({net})", fontsize=9)
        ax.legend(fontsize=6)
    return save_figure(fig, path, dpi=100, title=f"diloco suite, {doc['created']}, {' and '.join(map(str, sizes))} ranks")
