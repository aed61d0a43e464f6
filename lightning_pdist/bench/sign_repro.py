"""Part A of the sign suite: paper 004's Fig. 1 with the one-process simulator.

``M = 15`` logical workers train one shared model with 1-bit votes: each worker draws a batch
from its own shard of the training split, computes its gradient and votes with its sign; the
:class:`~lightning_pdist.sign.simulator.SignSGDSimulator` aggregates the votes with the
same functions as the DDP comm hooks (``signsgd_mv_hook`` / ``it_signsgd_hook``), and every worker
applies ``x ← x − δ·U`` (paper eq. 5) through ``torch.optim.SGD(lr=δ)``. Since every worker
applies the same update, one model stands for all of them.

Batch modes (the paper's Fig. 1): mode ``k`` puts ``BATCH_MODES[k]`` of the 15 workers at the
small batch ``B = 4`` and the rest at the large batch (``64`` here; the paper does not say).

:func:`sign_round_` is the step that the tests check against real gloo ranks running DDP with
the hooks (same batches → same parameters, bit for bit).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BATCH_MODES: dict[int, int] = {1: 0, 2: 9, 3: 12, 4: 14}  # batch mode -> workers at the small batch
METHODS = ("signsgd_mv", "it_signsgd")
AGGREGATION = {"signsgd_mv": "majority", "it_signsgd": "llr"}
DATASETS = ("digits", "mnist", "cifar10")


@dataclass(frozen=True)
class ReproData:
    """A classification split held as tensors: ``train_x (N, F)``, ``train_y (N,)``, ``val_x``, ``val_y``."""

    name: str
    train_x: Any
    train_y: Any
    val_x: Any
    val_y: Any

    @property
    def in_features(self) -> int:
        return int(self.train_x.shape[1])


def _subset_tensors(subset: Any) -> tuple[Any, Any]:
    """Stack a ``Subset`` of a ``TensorDataset`` or ``UInt8ImageDataset`` into flat float32 inputs and labels."""
    import torch

    base, idx = subset.dataset, torch.as_tensor(subset.indices)
    if hasattr(base, "images"):  # UInt8ImageDataset: convert in one go, not sample by sample
        x, y = base.images[idx].float().div_(255.0), base.labels[idx]
    else:
        x, y = base.tensors[0][idx], base.tensors[1][idx]
    return x.reshape(len(idx), -1).contiguous(), y.to(torch.int64)


def load_data(name: str, data_dir: str | Path | None = None, val_limit: int | None = 2000) -> ReproData:
    """The train/validation split of dataset ``name`` as flat tensors (seed 0 split).

    ``digits`` is scikit-learn's bundled set (always there); ``mnist`` and ``cifar10`` are read from
    ``data_dir`` by the package's loaders. ``val_limit`` keeps the first that many validation samples
    (a fixed, stratified-split subset), so evaluating every few rounds stays cheap.

    Raises:
        ValueError: ``name`` is unknown, or ``mnist``/``cifar10`` without a ``data_dir``.
        FileNotFoundError: the files are not under ``data_dir`` (from the loaders).
    """
    if name not in DATASETS:
        raise ValueError(f"load_data(name={name!r}): name must be one of {DATASETS}")
    if name == "digits":
        from lightning_pdist.data import DigitsDataModule

        module = DigitsDataModule(seed=0)
    elif data_dir is None:
        raise ValueError(f"load_data(name={name!r}, data_dir=None): {name} is read from local files; give a data_dir")
    elif name == "mnist":
        from lightning_pdist.data.mnist import MNISTDataModule

        module = MNISTDataModule(data_dir=str(data_dir), seed=0)
    else:
        from lightning_pdist.data.cifar10 import CIFAR10DataModule

        module = CIFAR10DataModule(data_dir=str(data_dir), seed=0)
    module.setup()
    train_x, train_y = _subset_tensors(module.train_set)
    val_x, val_y = _subset_tensors(module.val_set)
    if val_limit is not None:
        val_x, val_y = val_x[:val_limit], val_y[:val_limit]
    return ReproData(name, train_x, train_y, val_x, val_y)


def worker_batch_sizes(num_workers: int, small_workers: int, small_batch: int, large_batch: int) -> list[int]:
    """Per-worker batch sizes: the first ``small_workers`` at ``small_batch``, the others at ``large_batch``.

    Raises:
        ValueError: ``small_workers`` is not in ``[0, num_workers]``.
    """
    if not 0 <= small_workers <= num_workers:
        raise ValueError(
            f"worker_batch_sizes(small_workers={small_workers}): small_workers must be in [0, {num_workers}]"
        )
    return [small_batch] * small_workers + [large_batch] * (num_workers - small_workers)


def make_model(in_features: int, hidden: int, seed: int, num_classes: int = 10) -> Any:
    """The MLP every run trains, seeded (the same initial weights for both methods at one seed)."""
    import torch

    from lightning_pdist.models.mlp import MLP

    torch.manual_seed(seed)
    return MLP(in_features=in_features, num_classes=num_classes, hidden=hidden)


def sign_round_(model: Any, optimizer: Any, simulator: Any, batches: Sequence[tuple[Any, Any]]) -> Any:
    """One round of sign voting over the workers' ``batches``, in place; returns the applied vote ``U``.

    Worker ``m`` computes the cross-entropy gradient of ``batches[m]`` at the shared weights; the
    simulator aggregates the ``(M, d)`` stack as one bucket (the parameters in model order), the
    vote becomes every parameter's ``.grad`` and ``optimizer.step()`` applies it, as DDP with a
    sign hook and the same optimizer would.
    """
    import torch
    from torch.nn import functional as F

    params = [p for p in model.parameters() if p.requires_grad]
    lengths = [p.numel() for p in params]
    grads = torch.empty(len(batches), sum(lengths))  # (M, d)
    for m, (x, y) in enumerate(batches):
        loss = F.cross_entropy(model(x), y)
        torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)], out=grads[m])
    vote = simulator.aggregate(grads, lengths)  # (d,) ±1 fp32
    for p, segment in zip(params, vote.split(lengths)):
        p.grad = segment.view_as(p).to(p.dtype)
    optimizer.step()
    return vote


def accuracy(model: Any, x: Any, y: Any) -> float:
    """Fraction of ``x`` that ``model`` classifies as ``y``."""
    import torch

    with torch.no_grad():
        return float((model(x).argmax(dim=1) == y).float().mean())


def shard_indices(num_samples: int, num_workers: int, seed: int) -> list[Any]:
    """Each worker's own dataset ``D_m``: a seeded random partition of the training indices into equal parts."""
    import torch

    perm = torch.randperm(num_samples, generator=torch.Generator().manual_seed(10_000 + seed))
    return list(perm.tensor_split(num_workers))


def train_run(
    data: ReproData,
    method: str,
    small_workers: int,
    seed: int,
    *,
    rounds: int,
    eval_every: int,
    num_workers: int,
    small_batch: int,
    large_batch: int,
    lr: float,
    hidden: int,
    warmup_rounds: int,
    estimator: str,
) -> dict[str, Any]:
    """Train one run; return ``{"curve": [(round, val_acc), ...], "wall_s", "params", "final_weights"}``.

    The curve holds round 0 (the initial model), every ``eval_every`` rounds, and the last round.
    ``final_weights`` are IT-signSGD's last LLR weights per worker, averaged over coordinates for the tensor and
    coordinate estimators (``None`` for the majority vote).
    """
    import torch

    from lightning_pdist.sign.simulator import SignSGDSimulator

    if method not in METHODS:
        raise ValueError(f"train_run(method={method!r}): method must be one of {METHODS}")
    torch.set_num_threads(1)
    model = make_model(data.in_features, hidden, seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    kwargs = {"warmup_rounds": warmup_rounds, "estimator": estimator} if method == "it_signsgd" else {}
    sim = SignSGDSimulator(num_workers, AGGREGATION[method], **kwargs)
    sizes = worker_batch_sizes(num_workers, small_workers, small_batch, large_batch)
    shards = shard_indices(len(data.train_y), num_workers, seed)
    g = torch.Generator().manual_seed(seed)
    curve = [(0, accuracy(model, data.val_x, data.val_y))]
    t0 = time.perf_counter()
    for t in range(1, rounds + 1):
        batches = []
        for shard, b in zip(shards, sizes):
            idx = shard[torch.randperm(len(shard), generator=g)[:b]]
            batches.append((data.train_x[idx], data.train_y[idx]))
        sign_round_(model, optimizer, sim, batches)
        if t % eval_every == 0 or t == rounds:
            curve.append((t, accuracy(model, data.val_x, data.val_y)))
    # One number per worker whatever the estimator: the tensor and coordinate estimators' weights are averaged
    # over their tensors/coordinates (kept whole, the coordinate estimator's would be M·d numbers per run).
    weights = None if sim.last_weights is None else [
        round(float(w), 4) for w in sim.last_weights.reshape(num_workers, -1).mean(1)
    ]
    return {
        "curve": curve,
        "wall_s": time.perf_counter() - t0,
        "params": sum(p.numel() for p in model.parameters()),
        "final_weights": weights,
        "model": model,
    }


def reliability_diagnosis(
    model: Any, data: ReproData, sizes: Sequence[int], seed: int, rounds: int = 30
) -> dict[str, Any]:
    """How reliable each batch size's signs really are, and how reliable eq. 4 says they are, at ``model``.

    Over ``rounds`` fresh draws of every worker's batch (at fixed weights), per batch size:
    ``p_vs_majority`` (the disagreement rate with the majority vote, what eq. 4 estimates),
    ``p_vs_full_batch`` (the disagreement rate with the sign of the full training-set gradient,
    on the coordinates where that gradient is not zero: the real error rate), and ``zero_fraction``
    (coordinates whose gradient is exactly 0, which vote ``+1``).
    """
    import torch
    from torch.nn import functional as F

    from lightning_pdist.sign.vote import binary_sign, majority_vote

    params = [p for p in model.parameters() if p.requires_grad]

    def flat_grad(x: Any, y: Any) -> Any:
        return torch.cat([g.reshape(-1) for g in torch.autograd.grad(F.cross_entropy(model(x), y), params)])

    full = flat_grad(data.train_x, data.train_y)
    informative = full != 0
    truth = binary_sign(full[informative])
    shards = shard_indices(len(data.train_y), len(sizes), seed)
    g = torch.Generator().manual_seed(20_000 + seed)
    stats = torch.zeros(3, len(sizes))  # rows: p_vs_majority, p_vs_full_batch, zero_fraction
    for _ in range(rounds):
        grads = []
        for shard, b in zip(shards, sizes):
            idx = shard[torch.randperm(len(shard), generator=g)[:b]]
            grads.append(flat_grad(data.train_x[idx], data.train_y[idx]))
        grads = torch.stack(grads)  # (M, d)
        signs = binary_sign(grads)
        stats[0] += (signs != majority_vote(signs)).float().mean(1)
        stats[1] += (signs[:, informative] != truth).float().mean(1)
        stats[2] += (grads == 0).float().mean(1)
    stats /= rounds
    out = {}
    for b in sorted(set(sizes)):
        cols = torch.tensor([i for i, s in enumerate(sizes) if s == b])
        mean = stats[:, cols].mean(1).tolist()
        out[f"B={b}"] = {"workers": len(cols), "p_vs_majority": round(mean[0], 4),
                         "p_vs_full_batch": round(mean[1], 4), "zero_fraction": round(mean[2], 4)}  # fmt: skip
    return out


def repro_plan(
    datasets: Sequence[str], batch_modes: Sequence[int], seeds: Sequence[int]
) -> list[tuple[str, int, int, str]]:
    """Every run, as ``(dataset, batch_mode, seed, method)``; both methods of a seed back to back."""
    return [(d, mode, s, m) for d in datasets for mode in batch_modes for s in seeds for m in METHODS]


def curve_rows(
    dataset: str, method: str, batch_mode: int, seed: int, curve: Sequence[tuple[int, float]]
) -> list[dict[str, Any]]:
    """The JSON rows of one run's curve: ``{"dataset", "method", "batch_mode", "small_batch_workers", "seed",
    "round", "val_acc"}``.

    Raises:
        ValueError: ``batch_mode`` or ``method`` is unknown.
    """
    if batch_mode not in BATCH_MODES:
        raise ValueError(f"curve_rows(batch_mode={batch_mode!r}): batch_mode must be one of {sorted(BATCH_MODES)}")
    if method not in METHODS:
        raise ValueError(f"curve_rows(method={method!r}): method must be one of {METHODS}")
    return [
        {"dataset": dataset, "method": method, "batch_mode": batch_mode,
         "small_batch_workers": BATCH_MODES[batch_mode], "seed": seed, "round": t, "val_acc": round(acc, 4)}
        for t, acc in curve
    ]  # fmt: skip


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean ± std (over seeds) of the final validation accuracy, per dataset, batch mode and method.

    Each entry also holds ``gain_vs_majority`` (IT-signSGD's mean minus signSGD-MV's, on the
    it_signsgd entry) and the per-seed paired differences, which cancel the seed's shared
    initialization and data order.
    """
    import statistics

    last: dict[tuple[str, int, str, int], tuple[int, float]] = {}
    for r in rows:
        key = (r["dataset"], r["batch_mode"], r["method"], r["seed"])
        if key not in last or r["round"] > last[key][0]:
            last[key] = (r["round"], r["val_acc"])
    groups: dict[tuple[str, int, str], dict[int, float]] = {}
    for (dataset, mode, method, seed), (_, acc) in last.items():
        groups.setdefault((dataset, mode, method), {})[seed] = acc
    out = []
    for (dataset, mode, method), by_seed in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        accs = [by_seed[s] for s in sorted(by_seed)]
        entry = {
            "dataset": dataset, "method": method, "batch_mode": mode, "small_batch_workers": BATCH_MODES[mode],
            "seeds": len(accs), "final_round": max(last[(dataset, mode, method, s)][0] for s in by_seed),
            "final_val_acc_mean": round(statistics.fmean(accs), 4),
            "final_val_acc_std": round(statistics.stdev(accs), 4) if len(accs) > 1 else 0.0,
        }  # fmt: skip
        base = groups.get((dataset, mode, "signsgd_mv"))
        if method == "it_signsgd" and base:
            diffs = [by_seed[s] - base[s] for s in sorted(by_seed) if s in base]
            entry["gain_vs_majority"] = round(statistics.fmean(diffs), 4) if diffs else None
            entry["gain_by_seed"] = [round(d, 4) for d in diffs]
        out.append(entry)
    return out


def run_repro(config: Any, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every planned Part A run of ``config`` (a :class:`~lightning_pdist.bench.sign.SuiteConfig`).

    Returns ``{"rows", "summary", "datasets": {name: info or {"skipped": reason}}, "runs", "diagnosis"}``;
    ``diagnosis`` holds :func:`reliability_diagnosis` of the first seed's final signSGD-MV model
    in every heterogeneous batch mode.
    """
    datasets: dict[str, dict[str, Any]] = {}
    loaded: dict[str, ReproData] = {}
    for name in config.datasets:
        try:
            loaded[name] = load_data(name, config.data_dir)
        except (FileNotFoundError, ValueError) as err:
            datasets[name] = {"skipped": str(err).splitlines()[0]}
            log(f"sign: dataset {name} skipped: {datasets[name]['skipped']}")
            continue
        data = loaded[name]
        datasets[name] = {"train": len(data.train_y), "val": len(data.val_y), "in_features": data.in_features}
    rows: list[dict[str, Any]] = []
    runs = []
    diagnosis: list[dict[str, Any]] = []
    plan = [p for p in repro_plan(config.datasets, config.batch_modes, config.seeds) if p[0] in loaded]
    for i, (name, mode, seed, method) in enumerate(plan, 1):
        result = train_run(
            loaded[name], method, BATCH_MODES[mode], seed,
            rounds=config.rounds, eval_every=config.eval_every, num_workers=config.num_workers,
            small_batch=config.small_batch, large_batch=config.large_batch, lr=config.lr, hidden=config.hidden,
            warmup_rounds=config.warmup_rounds, estimator=config.estimator,
        )  # fmt: skip
        rows += curve_rows(name, method, mode, seed, result["curve"])
        datasets[name]["model_params"] = result["params"]
        runs.append({"dataset": name, "method": method, "batch_mode": mode, "seed": seed,
                     "wall_s": round(result["wall_s"], 2), "final_llr_weights": result["final_weights"]})  # fmt: skip
        if method == "signsgd_mv" and seed == config.seeds[0] and 0 < BATCH_MODES[mode] < config.num_workers:
            sizes = worker_batch_sizes(config.num_workers, BATCH_MODES[mode], config.small_batch, config.large_batch)
            diagnosis.append({"dataset": name, "batch_mode": mode, "seed": seed, "round": config.rounds,
                              "by_batch_size": reliability_diagnosis(result["model"], loaded[name], sizes, seed)})
        log(f"[A {i}/{len(plan)}] {name} mode {mode} seed {seed} {method}: "
            f"val_acc {result['curve'][-1][1]:.4f} ({result['wall_s']:.1f} s)")  # fmt: skip
    return {"rows": rows, "summary": summarize(rows), "datasets": datasets, "runs": runs, "diagnosis": diagnosis}


def plot_repro(ax_row: Sequence[Any], rows: Sequence[dict[str, Any]], dataset: str) -> None:
    """One panel per batch mode: mean val accuracy vs round for both methods, shaded min–max over seeds."""
    colors = {"signsgd_mv": "tab:gray", "it_signsgd": "tab:red"}
    modes = sorted({r["batch_mode"] for r in rows if r["dataset"] == dataset})
    for ax, mode in zip(ax_row, modes):
        for method in METHODS:
            curves: dict[int, list[float]] = {}
            for r in rows:
                if r["dataset"] == dataset and r["batch_mode"] == mode and r["method"] == method:
                    curves.setdefault(r["round"], []).append(r["val_acc"])
            if not curves:
                continue
            xs = sorted(curves)
            mean = [sum(curves[x]) / len(curves[x]) for x in xs]
            # MV wide and solid, IT-signSGD dashed on top: identical curves stay visible as two lines.
            style = {"linewidth": 3.5, "alpha": 0.6} if method == "signsgd_mv" else {"linestyle": "--", "linewidth": 1.3}
            ax.plot(xs, mean, color=colors[method], label=f"{method} (mean of {len(curves[xs[-1]])})", **style)
            ax.fill_between(xs, [min(curves[x]) for x in xs], [max(curves[x]) for x in xs],
                            color=colors[method], alpha=0.2)  # fmt: skip
        ax.set_title(f"{dataset}, batch mode {mode}: {BATCH_MODES[mode]}/15 workers at B=4", fontsize=8)
        ax.set_xlabel("round")
        ax.grid(True, alpha=0.3)
    if len(ax_row):
        ax_row[0].set_ylabel("validation accuracy")
        ax_row[0].legend(fontsize=7, loc="lower right")
