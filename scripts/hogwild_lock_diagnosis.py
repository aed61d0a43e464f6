"""Why Hogwild!'s locking baseline can diverge where one process does not: per-process momentum taking turns.

``HogwildStrategy(lock=True)`` (and lock-free Hogwild!) gives each process its own optimizer state, as issue 22 asks.
With SGD momentum ``m`` every process keeps its own buffer ``b_r ← m·b_r + g`` and writes ``w ← w − lr·b_r`` to the
one shared ``w``. How stable that is depends on the *order* of the writes, which the lock changes:

* **one process**: heavy ball, stable on ``f = h·w²/2`` for ``lr·h < 2(1 + m)``;
* **paired** (lock-free processes in phase on two cores: both read the same ``w``, then both write): the sum of the
  two buffers is one heavy ball at ``2·lr``, stable for ``lr·h < 1 + m``;
* **alternating** (the lock: a process whose gradient is ready waits for the other's write, so the writes take strict
  turns and each gradient was read before the other's last write): the two buffers' difference is a mode that one
  process does not have, and it grows for ``lr·h`` above about ``0.19`` at ``m = 0.9``: 20 times narrower.

Part 1 (``--part quadratic``) prints those edges (the spectral radius of the two-write period map, bisected), part 2
(``--part cnn``) trains the asynchronous benchmark's digits CNN (width 32, SGD lr 0.05, momentum 0.9, batches of 32,
each process on its ``DistributedSampler`` shard) in ONE process, replaying each schedule deterministically from
the same weights: 384 updates, validation accuracy every 32; ``--jitter J`` makes each read a further 0 to J writes
older (uniform, seeded), as when the operating system delays one process.

    python scripts/hogwild_lock_diagnosis.py --part quadratic
    python scripts/hogwild_lock_diagnosis.py --part cnn --seeds 0 1 2 3
    python scripts/hogwild_lock_diagnosis.py --part cnn --seeds 0 1 2 3 --jitter 2
    python scripts/hogwild_lock_diagnosis.py --part cnn --seeds 0 1 2 3 --lr 0.1
    python scripts/hogwild_lock_diagnosis.py --part cnn --seeds 0 1 2 3 --jitter 2 --momentum 0.4
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

#: schedule -> for each of the two writes of a period, how many writes old the weights its gradient was read at are.
SCHEDULES = {"alternating, read before the other's write": (1, 1), "alternating, read fresh": (0, 0), "paired": (0, 1)}


def period_radius(a: float, m: float, stale: tuple[int, int]) -> float:
    """Per-write spectral radius on ``f = h w²/2`` (``a = lr·h``); state ``(w_t, w_{t−1}, b_0, b_1)``, ``b`` in units
    of ``h``; write ``k`` of the period: ``b_k ← m·b_k + w_{t−stale[k]}``, ``w ← w − a·b_k``."""
    period = np.eye(4)
    for k in (0, 1):
        step = np.zeros((4, 4))
        step[1, 0] = 1.0
        step[2, 2] = step[3, 3] = 1.0
        step[2 + k, 2 + k] = m
        step[2 + k, stale[k]] += 1.0
        step[0] = step[0] - a * step[2 + k]
        step[0, 0] += 1.0
        period = step @ period
    return float(max(abs(np.linalg.eigvals(period)))) ** 0.5


def edge(m: float, stale: tuple[int, int] | None) -> float:
    """The largest ``lr·h`` whose iteration does not grow (``None``: one process, ``2(1 + m)``)."""
    if stale is None:
        return 2 * (1 + m)
    lo, hi = 1e-6, 2 * (1 + m)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if period_radius(mid, m, stale) <= 1 + 1e-12 else (lo, mid)
    return lo


def quadratic() -> None:
    for m in (0.9, 0.4, 0.0):
        edges = [f"one process {edge(m, None):.2f}"] + [f"{name} {edge(m, s):.3f}" for name, s in SCHEDULES.items()]
        print(f"momentum {m}: largest stable lr*h: " + "; ".join(edges))


def cnn(seed: int, stale: tuple[int, int] | None, jitter: int = 0, lr: float = 0.05, m: float = 0.9,
        updates: int = 384) -> list[float]:  # fmt: skip
    """Validation accuracy every 32 updates of the benchmark's CNN under ``stale`` (``None``: one process), each read
    a further 0 to ``jitter`` writes old (uniform, seeded: a process the OS delayed)."""
    import random

    import torch.nn.functional as F
    from lightning.fabric.utilities.seed import seed_everything
    from torch.nn.utils import parameters_to_vector, vector_to_parameters
    from torch.utils.data import DataLoader, DistributedSampler

    from lightning_pdist.data import DigitsDataModule
    from lightning_pdist.models import ClassifierModule

    seed_everything(seed, verbose=False)
    data = DigitsDataModule(batch_size=32, seed=seed)
    data.setup("fit")
    module = ClassifierModule(model="cnn", width=32, optimizer="sgd", lr=lr, momentum=m)
    params = list(module.parameters())
    world = 1 if stale is None else 2
    shards = []
    for rank in range(world):
        sampler = DistributedSampler(data.train_set, num_replicas=world, rank=rank, shuffle=True, seed=seed)
        batches, epoch = [], 0
        while len(batches) < updates:
            sampler.set_epoch(epoch)
            batches += list(DataLoader(data.train_set, batch_size=32, sampler=sampler))
            epoch += 1
        shards.append(iter(batches))
    history = [parameters_to_vector(params).detach().clone()]
    buffers: list[torch.Tensor | None] = [None] * world
    val_x = torch.stack([x for x, _ in data.val_set])
    val_y = torch.tensor([int(y) for _, y in data.val_set])
    accs, rng = [], random.Random(seed)
    for t in range(updates):
        k = t % world
        back = 0 if stale is None else min(stale[k] + rng.randint(0, jitter), len(history) - 1)
        vector_to_parameters(history[-1 - back], params)
        x, y = next(shards[k])
        g = torch.cat([p.reshape(-1) for p in torch.autograd.grad(F.cross_entropy(module(x), y), params)])
        buffers[k] = g if buffers[k] is None else buffers[k].mul_(m).add_(g)
        history = (history + [history[-1] - lr * buffers[k]])[-(3 + jitter):]
        if (t + 1) % 32 == 0:
            vector_to_parameters(history[-1], params)
            with torch.no_grad():
                accs.append(round(float((module(val_x).argmax(1) == val_y).float().mean()), 3))
    return accs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("quadratic", "cnn"), default="quadratic")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--jitter", type=int, default=0, help="cnn: each read up to this many writes older")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.part == "quadratic":
        return quadratic()
    for name, stale in {"one process": None, **SCHEDULES}.items():
        for seed in args.seeds:
            accs = cnn(seed, stale, jitter=0 if stale is None else args.jitter, lr=args.lr, m=args.momentum)
            print(f"{name:45s} seed {seed}: at update 32 {accs[0]:.3f}, lowest after 96 {min(accs[2:]):.3f}, "
                  f"final {accs[-1]:.3f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
