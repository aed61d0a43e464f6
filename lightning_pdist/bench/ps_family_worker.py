"""One rank of the parameter_server suite: ``python -m lightning_pdist.bench.ps_family_worker --spec JSON --out-dir DIR``.

Started once per rank by :class:`~lightning_pdist.bench.launch.Launcher` (each rank its own Lightning node, gloo
over TCP). The strategies start their own servers (server ``i`` on node ``i mod N``, authenticated, as in a real
job). ``spec["method"]`` (:data:`METHODS`) picks the strategy, ``spec["task"]`` the module and data:

* ``cnn``: the digits CNN (``ClassifierModule(model="cnn")``), ``DigitsDataModule``;
* ``logreg``: multinomial logistic regression on the digits (``Flatten`` + ``Linear(64, 10)``: a convex loss);
* ``mlp``: the digits MLP (non-convex);
* ``text``: ``BagOfEmbeddings(vocab, embed_dim)`` on :func:`text_data` (generated token ids, log-uniform over
  the vocabulary, with each class's marker tokens planted), the table named in Parallax's ``sparse_params``.

Per rank it records the step times after ``warmup_steps``, the bytes its strategy counted and this host's kernel
``tx_bytes`` over the same window (emulated links), every ``eval_every`` steps on rank 0 the validation accuracy
and full training loss of the model rank 0 holds, with the training time so far (evaluations not timed), and after
``fit`` the same of the model ``fit`` leaves (the center for the EASGD modes, the whole table for Parallax).
Rank ``spec["slow_rank"]`` sleeps ``slow_factor - 1`` times its measured forward + backward before every batch:
a straggler ``slow_factor`` times slower. Writes ``DIR/rank<r>.json``.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from lightning_pdist.bench.launch import WorkerSpec, bench_trainer, worker_main
from lightning_pdist.bench.worker import read_tx

#: method -> (part, what it runs).
METHODS: dict[str, tuple[str, str]] = {
    "ps_easgd": ("easgd", "ParameterServerStrategy(mode='easgd', easgd_period=τ): asynchronous EASGD on the servers"),
    "downpour": ("easgd", "ParameterServerStrategy(mode='async'): Downpour SGD"),
    "sync_easgd": ("easgd", "EASGDStrategy(period=τ): synchronous EASGD, all-reduce"),
    "sandblaster": ("sandblaster", "SandblasterStrategy(): L-BFGS sharded on the servers, portions to the workers"),
    "lbfgs": ("sandblaster", "torch.optim.LBFGS in one process on the whole batch"),
    "sgd_ddp": ("sandblaster", "PdistStrategy() DDP with SGD (momentum), the batch split over the ranks"),
    "parallax": ("parallax", "ParallaxStrategy(sparse_params=[the table]): rows on the servers, dense all-reduced"),
    "ddp": ("parallax", "PdistStrategy() DDP: the whole table's gradient all-reduced"),
    "ps": ("parallax", "ParameterServerStrategy(mode='sync'): the whole model pushed and pulled"),
}
TASKS = ("cnn", "logreg", "mlp", "text")
TABLE = "model.embedding.weight"


@dataclass(frozen=True)
class Spec(WorkerSpec):
    """One launch: ``method`` on ``task`` with ``world_size`` ranks for ``steps`` optimizer steps."""

    WHO: ClassVar[str] = "ps_family_worker"
    method: str
    task: str
    world_size: int
    steps: int
    warmup_steps: int
    batch_size: int
    lr: float
    momentum: float
    period: int
    seed: int
    eval_every: int
    slow_rank: int | None
    slow_factor: float
    vocab: int
    embed_dim: int
    seq_len: int
    samples: int

    def __post_init__(self) -> None:
        self.one_of("method", tuple(METHODS))
        self.one_of("task", TASKS)
        self.ints("world_size", "steps", "batch_size", "period", "eval_every", "vocab", "embed_dim", "seq_len", "samples")
        self.ints("warmup_steps", "seed", low=0)
        if not self.warmup_steps < self.steps:
            raise self.bad("warmup_steps", f"warmup_steps must be < steps={self.steps} (the clock starts after it)")
        if not self.lr > 0 or not 0 <= self.momentum < 1:
            raise self.bad("lr" if not self.lr > 0 else "momentum", "lr must be > 0 and momentum in [0, 1)")
        if self.slow_rank is not None and not (isinstance(self.slow_rank, int) and 0 <= self.slow_rank < self.world_size):
            raise self.bad("slow_rank", f"slow_rank must be None or in [0, {self.world_size})")
        if not isinstance(self.slow_factor, (int, float)) or self.slow_factor < 1:
            raise self.bad("slow_factor", "slow_factor must be >= 1 (1: no straggler)")
        if (self.task == "text") != (METHODS[self.method][0] == "parallax"):
            raise self.bad("task", f"method {self.method!r} runs task 'text' if and only if it is a parallax row")
        if self.method == "lbfgs" and self.world_size != 1:
            raise self.bad("world_size", "lbfgs is the one-process reference: world_size must be 1")


check_spec = Spec.check


def text_data(vocab: int, seq_len: int, n: int, seed: int, markers: int = 200, signal: float = 0.25) -> Any:
    """``n`` reviews of ``seq_len`` token ids in ``[2, vocab)``, log-uniform (a long tail of rare words), and labels.

    Each class owns ``markers`` ids scattered over the vocabulary (fixed by ``vocab`` alone); a token of a review of
    class ``c`` is one of ``c``'s markers with probability ``signal``. Train and validation sets differ in ``seed``.
    """
    import torch

    owned = torch.randperm(vocab - 2, generator=torch.Generator().manual_seed(vocab))[: 2 * markers].add(2).view(2, markers)
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (n,), generator=g)
    ids = torch.exp(torch.rand(n, seq_len, generator=g) * math.log(vocab - 2)).long().add(1).clamp_(2, vocab - 1)
    marked = torch.rand(n, seq_len, generator=g) < signal
    picks = owned[labels.unsqueeze(1).expand(n, seq_len), torch.randint(0, markers, (n, seq_len), generator=g)]
    return torch.utils.data.TensorDataset(torch.where(marked, picks, ids), labels)


def build_strategy(spec: dict[str, Any]) -> Any:
    """The strategy of ``spec["method"]`` on gloo (``None``: one process, Lightning's own)."""
    from lightning_pdist import EASGDStrategy, ParallaxStrategy, ParameterServerStrategy, PdistStrategy, SandblasterStrategy

    method, gloo = spec["method"], {"process_group_backend": "gloo"}
    if method == "ps_easgd":
        return ParameterServerStrategy(mode="easgd", easgd_period=spec["period"])
    if method == "downpour":
        return ParameterServerStrategy(mode="async")
    if method == "sync_easgd":
        return EASGDStrategy(period=spec["period"], **gloo)
    if method == "sandblaster":
        return SandblasterStrategy()
    if method == "parallax":
        return ParallaxStrategy(sparse_params=[TABLE])
    if method == "ps":
        return ParameterServerStrategy(mode="sync")
    if method == "lbfgs":
        return "auto"
    return PdistStrategy(**gloo)


def build_module(spec: dict[str, Any]) -> Any:
    from torch import nn

    from lightning_pdist.models.classifier import ClassifierModule

    task, lbfgs = spec["task"], spec["method"] in ("sandblaster", "lbfgs")
    opt = {"optimizer": "lbfgs", "lr": spec["lr"]} if lbfgs else {"optimizer": "sgd", "lr": spec["lr"], "momentum": spec["momentum"]}
    if task == "logreg":
        return ClassifierModule(model=nn.Sequential(nn.Flatten(), nn.Linear(64, 10)), **opt)
    if task == "text":
        return ClassifierModule(model="text", vocab_size=spec["vocab"], width=spec["embed_dim"], num_classes=2, **opt)
    return ClassifierModule(model=task, **opt)


def build_data(spec: dict[str, Any], rank: int = 0) -> tuple[Any, Any, Any]:
    """(data module or train loader, train set, validation set); the batch per rank follows the method.

    The Sandblaster part's loaders are final: the Trainer runs them with ``use_distributed_sampler=False``
    (:func:`sampler_kwargs`), because Lightning otherwise puts every distributed strategy's training loader behind a
    ``DistributedSampler(shuffle=True)`` (even Sandblaster's one replica) while one process reads it in order, so
    the two L-BFGS rows saw different batches from step 1.
    """
    import torch
    from torch.utils.data import DataLoader

    from lightning_pdist.data import DigitsDataModule
    from lightning_pdist.parameter_server.sandblaster import portion_bounds

    per_rank = spec["batch_size"]
    if spec["method"] in ("sgd_ddp",):  # the global batch split over the ranks, as Sandblaster/LBFGS see it whole
        per_rank = spec["batch_size"] // spec["world_size"]
    if spec["task"] == "text":
        train = text_data(spec["vocab"], spec["seq_len"], spec["samples"], spec["seed"])
        val = text_data(spec["vocab"], spec["seq_len"], 1024, spec["seed"] + 1)
        return DataLoader(train, batch_size=per_rank, shuffle=False), train, val
    data = DigitsDataModule(batch_size=per_rank, seed=spec["seed"])
    data.setup("fit")
    if METHODS[spec["method"]][0] != "sandblaster":
        return data, data.train_set, data.val_set
    # The same global batch at every step for LBFGS (one process), Sandblaster (every worker the whole batch) and
    # sgd_ddp (rank r the r-th contiguous slice of it): one fixed shuffle, read in order, every epoch alike.
    order = torch.randperm(len(data.train_set), generator=torch.Generator().manual_seed(spec["seed"])).tolist()
    batch, ranks = spec["batch_size"], spec["world_size"] if spec["method"] == "sgd_ddp" else 1
    batches = []
    for start in range(0, len(order), batch):
        whole = order[start : start + batch]
        lo, hi = portion_bounds(len(whole), ranks)[rank if ranks > 1 else 0]
        batches.append(whole[lo:hi])
    return DataLoader(data.train_set, batch_sampler=batches), data.train_set, data.val_set


def sampler_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    """Trainer arguments for the data: the Sandblaster part's loaders go unchanged (see :func:`build_data`)."""
    return {"use_distributed_sampler": False} if METHODS[spec["method"]][0] == "sandblaster" else {}


def measure(module: Any, dataset: Any) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``module`` on ``dataset``, in this process."""
    import torch
    from torch.nn import functional as F
    from torch.utils.data import DataLoader

    module.eval()
    correct = total = 0
    loss = 0.0
    with torch.no_grad():
        for x, y in DataLoader(dataset, batch_size=512, shuffle=False):
            logits = module(x)
            loss += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(dim=1) == y).sum())
            total += len(y)
    module.train()
    return correct / total, loss / total


def compute_ms(module: Any, dataset: Any, batch_size: int) -> float:
    """Forward + backward of one batch on this core, no communication (mean of 3 after 1)."""
    from torch.nn import functional as F
    from torch.utils.data import DataLoader

    x, y = next(iter(DataLoader(dataset, batch_size=batch_size)))
    times = []
    for _ in range(4):
        t0 = time.perf_counter()
        F.cross_entropy(module(x), y).backward()
        times.append(time.perf_counter() - t0)
    module.zero_grad(set_to_none=True)
    return 1000 * sum(times[1:]) / 3


def sent(trainer: Any) -> int:
    """Bytes the strategy's own meter counted so far (0 for the one-process reference)."""
    meter = getattr(trainer.strategy, "comm_meter", None)
    return meter.total_bytes if meter is not None else 0


def run(spec: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """Train this rank as ``spec`` says; its result."""
    from lightning.pytorch import Callback, seed_everything

    rank, ifname = int(os.environ.get("RANK", "0")), os.environ.get("GLOO_SOCKET_IFNAME")
    seed_everything(spec["seed"], workers=True, verbose=False)
    module = build_module(spec)
    data, train_set, val_set = build_data(spec, rank)
    own_ms = compute_ms(module, train_set, spec["batch_size"])
    sleep_s = (spec["slow_factor"] - 1) * own_ms / 1000 if spec["slow_rank"] == rank else 0.0
    evaluating = rank == 0 and spec["task"] != "text"  # Parallax's workers hold only the rows they pulled

    class Probe(Callback):
        def __init__(self) -> None:
            self.evals: list[list[float]] = []
            self.eval_s = 0.0
            self.rows: list[float] = []

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.t0 = self.last = time.perf_counter()

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
            if sleep_s:
                time.sleep(sleep_s)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
            now, step = time.perf_counter(), trainer.global_step
            if step == spec["warmup_steps"]:
                self.warm = (now, sent(trainer), read_tx(ifname))
            rows = trainer.callback_metrics.get("pdist/parallax/rows")
            if rows is not None and step > spec["warmup_steps"]:
                self.rows.append(float(rows))
            if evaluating and step % spec["eval_every"] == 0:
                acc, loss = measure(pl_module, val_set)[0], measure(pl_module, train_set)[1]
                self.evals.append([step, round(now - self.t0 - self.eval_s, 4), acc, round(loss, 5)])
                self.eval_s += time.perf_counter() - now

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.end = (time.perf_counter(), sent(trainer), read_tx(ifname))
            meter = getattr(trainer.strategy, "comm_meter", None)  # the one-process reference has none
            self.by_kind = dict(meter.by_kind) if meter is not None else {}

    probe = Probe()
    nodes = spec["world_size"]
    trainer = bench_trainer(devices=1, num_nodes=nodes, strategy=build_strategy(spec), max_steps=spec["steps"],
                            callbacks=[probe], log_every_n_steps=1, **sampler_kwargs(spec))  # fmt: skip
    trainer.fit(module, data)
    timed = spec["steps"] - spec["warmup_steps"]
    (t_w, b_w, x_w), (t_e, b_e, x_e) = probe.warm, probe.end
    val_acc, _ = measure(module, val_set)
    return {
        "rank": rank, "method": spec["method"], "task": spec["task"], "world_size": nodes,
        "train_steps": trainer.global_step, "timed_steps": timed,
        "ms_per_step": round(1000 * (t_e - t_w - (probe.eval_s if evaluating else 0.0)) / timed, 3),
        "loop_s": round(t_e - probe.t0 - probe.eval_s, 4),
        "bytes_per_step": round((b_e - b_w) / timed, 1), "comm_by_kind": probe.by_kind,
        "kernel_tx_per_step": round((x_e[0] - x_w[0]) / timed, 1) if x_w and x_e else None,
        "rows_per_step": round(sum(probe.rows) / len(probe.rows), 1) if probe.rows else None,
        "evals": probe.evals, "val_acc": val_acc, "train_loss": round(measure(module, train_set)[1], 5),
        "compute_ms": round(own_ms, 3), "slow_sleep_s": round(sleep_s, 5),
        "params": sum(p.numel() for p in module.parameters()),
    }  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(worker_main("lightning_pdist.bench.ps_family_worker", __doc__, check_spec, run))
