"""One process of the asynchronous suite: ``python -m lightning_pdist.bench.asynchronous_worker --spec JSON --out-dir DIR``.

Started once per rank by :class:`~lightning_pdist.bench.launch.Launcher`. The process trains ``spec["model"]``
(:data:`MODELS`: ``ClassifierModule(model="cnn", width=...)`` on the digits, or
``SparseBagClassifier(embed_dim=width, lr, head_lr)`` (Adagrad) on the synthetic IMDB reviews the suite wrote in
``spec["data_dir"]``) with the method of ``spec["method"]`` (:data:`METHODS`) for ``steps`` optimizer steps of
``batch_size``, from the same seed and weights as every other method:

* the Lightning methods run a real ``Trainer``; ``hogwild``/``hogwild_lock`` renumber the launcher's ranks as local
  ranks of one node (``devices=N, num_nodes=1``: Hogwild! shares one machine's memory); ``single`` is one process
  with Lightning's default strategy.
* ``sgp`` is fairscale's ``SlowMoDistributedDataParallel(slowmo_base_algorithm=SGP)`` in a plain torch loop over the
  same shard (``DistributedSampler``); if fairscale refuses to build it here, the process records the exact error.

The process runs one fit per entry of ``spec["stragglers"]``, in turn (a fit that could not be built is not retried:
the later ones carry its error). In a fit with a straggler, that rank sleeps ``slowdown − 1`` times the wall time of
its step after every step, so each of its steps takes ``slowdown``× as long. The clock starts at the end of the first
step (set-up and first-batch costs stay out). Every
``eval_every`` steps rank 0 copies the parameters it holds and the training time so far (the clock excludes the
copies); after ``fit`` it evaluates the copies and the model ``fit`` leaves on the whole validation split.

Writes ``DIR/rank<r>.json``: ``{"rank", "model", "method", "world_size", "fits": [{"straggler", "steps", "loop_s", "slept_s",
"compute_s", "evals": [[step, train_s, acc], ...], "val_acc", "model_params", "error"}]}`` (``evals``/``val_acc`` on
rank 0 only; a fit that could not run holds ``straggler`` and ``error`` alone).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from lightning_pdist.bench.launch import SGDSpec, as_one_node, bench_trainer, worker_main
from lightning_pdist.bench.worker import evaluate

#: method -> what it runs.
METHODS: dict[str, str] = {
    "ddp": "PdistStrategy() (fp32 all-reduce every step)",
    "ps_async": "ParameterServerStrategy(mode='async', implicit_momentum='compensate' for the cnn, None for the text "
                "model's Adagrad) (Downpour; ceil(N/2) servers)",
    "dpsgd": "DecentralizedStrategy(topology='ring') (D-PSGD)",
    "adpsgd": "DecentralizedStrategy(topology='ring', mode='async') (AD-PSGD)",
    "sgp": "fairscale SlowMoDistributedDataParallel(slowmo_base_algorithm=SGP) (peer)",
    "hogwild": "HogwildStrategy(implicit_momentum='compensate' for the cnn, None for the text model's Adagrad) "
               "(lock-free, shared memory)",
    "hogwild_lock": "HogwildStrategy(lock=True, implicit_momentum as hogwild) (locking baseline)",
    "single": "one process, Lightning's default strategy",
}
ONE_NODE = ("hogwild", "hogwild_lock")
#: model -> what it trains.
MODELS: dict[str, str] = {
    "cnn": "ClassifierModule(model='cnn') on the digits",
    "text": "SparseBagClassifier (nn.EmbeddingBag(sparse=True) + linear, Adagrad) on synthetic IMDB reviews",
}
#: Synthetic IMDB reviews per class and split the suite writes for the text model (2,700 training, 300 held out).
TEXT_REVIEWS = 1500


@dataclass(frozen=True)
class Spec(SGDSpec):
    """One launch: ``method`` on ``world_size`` processes, one fit per entry of ``stragglers`` (the rank slowed, or
    ``None``), ``steps`` steps each."""

    WHO: ClassVar[str] = "asynchronous_worker"
    model: str
    method: str
    eval_every: int
    stragglers: list
    slowdown: float
    head_lr: float | None
    data_dir: str | None

    def __post_init__(self) -> None:
        self.one_of("model", tuple(MODELS))
        self.one_of("method", tuple(METHODS))
        text_ok = isinstance(self.data_dir, str) and isinstance(self.head_lr, (int, float)) and self.head_lr > 0
        if (text_ok, self.data_dir is None and self.head_lr is None) != (self.model == "text", self.model == "cnn"):
            raise self.bad("data_dir", "the text model needs data_dir (str) and head_lr > 0; the cnn takes neither")
        super().__post_init__()
        self.ints("eval_every")
        if (self.method == "single") != (self.world_size == 1):
            raise self.bad("world_size", "world_size must be 1 exactly for method 'single'")
        ok = lambda r: r is None or (isinstance(r, int) and not isinstance(r, bool) and 0 < r < self.world_size)  # noqa: E731
        if not isinstance(self.stragglers, list) or not self.stragglers or not all(map(ok, self.stragglers)):
            raise self.bad("stragglers", f"stragglers must be a non-empty list, each None or a rank in "
                                         f"[1, {self.world_size}) (rank 0 keeps the clock)")  # fmt: skip
        if not isinstance(self.slowdown, (int, float)) or self.slowdown < 1:
            raise self.bad("slowdown", "slowdown must be a number >= 1")


check_spec = Spec.check


class Clock:
    """Per step: the main thread's compute CPU, the straggler's sleep, rank 0's parameter copies and times."""

    def __init__(self, spec: dict[str, Any], rank: int, straggler: int | None) -> None:
        self.spec, self.rank, self.straggler = spec, rank, straggler
        self.slow = straggler == rank
        self.copies: list[tuple[int, float, dict[str, Any]]] = []
        self.slept = self.compute = self.copy_s = 0.0
        self.steps = 0

    def batch_start(self) -> None:
        self.cpu0, self.wall0 = time.thread_time(), time.perf_counter()

    def after_backward(self) -> None:
        self.cost = time.thread_time() - self.cpu0
        self.compute += self.cost

    def batch_end(self, module: Any) -> None:
        self.steps += 1
        if self.slow:
            pause = (self.spec["slowdown"] - 1) * (time.perf_counter() - self.wall0)
            time.sleep(pause)
            self.slept += pause
        if self.steps == 1:  # the clock starts after the first step: set-up and first-batch costs stay out
            self.t0 = time.perf_counter()
        if self.rank == 0 and self.steps % self.spec["eval_every"] == 0:
            now = time.perf_counter()
            state = {k: v.detach().clone() for k, v in module.state_dict().items()}
            self.copies.append((self.steps, round(now - self.t0 - self.copy_s, 4), state))
            self.copy_s += time.perf_counter() - now

    def end(self) -> None:
        self.loop_s = time.perf_counter() - self.t0 - self.copy_s

    def result(self, module: Any, val_set: Any) -> dict[str, Any]:
        out = {"straggler": self.straggler, "steps": self.steps, "loop_s": round(self.loop_s, 4),
               "slept_s": round(self.slept, 4), "compute_s": round(self.compute, 4), "evals": [], "val_acc": None,
               "model_params": sum(p.numel() for p in module.parameters()), "error": None}  # fmt: skip
        if self.rank == 0:
            out["val_acc"], _ = evaluate(module, val_set)
            for step, t, state in self.copies:
                module.load_state_dict(state)
                out["evals"].append([step, t, evaluate(module, val_set)[0]])
        return out


def build_strategy(method: str, model: str = "cnn") -> Any:
    """``method``'s strategy; ``ps_async``, ``hogwild`` and ``hogwild_lock`` compensate implicit momentum only for the
    CNN's SGD (the text model's Adagrad has no momentum to lower: ``implicit_momentum='compensate'`` refuses it). For
    Hogwild! it lowers each process's own momentum 0.9 to 0.4 on 2 processes: with 0.9, the lock's writes in turns
    diverged (docs/algorithms/hogwild.md, "The locking baseline and momentum")."""
    from lightning_pdist import DecentralizedStrategy, HogwildStrategy, ParameterServerStrategy, PdistStrategy

    gloo = {"process_group_backend": "gloo"}
    compensate = "compensate" if model == "cnn" else None
    return {"ddp": lambda: PdistStrategy(**gloo), "ps_async": lambda: ParameterServerStrategy(mode="async", implicit_momentum=compensate),
            "dpsgd": lambda: DecentralizedStrategy(topology="ring", **gloo),
            "adpsgd": lambda: DecentralizedStrategy(topology="ring", mode="async", **gloo),
            "hogwild": lambda: HogwildStrategy(implicit_momentum=compensate),
            "hogwild_lock": lambda: HogwildStrategy(lock=True, implicit_momentum=compensate), "single": lambda: "auto"}[method]()  # fmt: skip


def fit_lightning(spec: dict[str, Any], clock: Clock, module: Any, data: Any) -> str | None:
    from lightning.pytorch import Callback

    class Probe(Callback):
        def on_train_batch_start(self, *_: Any) -> None:
            clock.batch_start()

        def on_after_backward(self, *_: Any) -> None:
            clock.after_backward()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *_: Any) -> None:
            clock.batch_end(pl_module)

        def on_train_end(self, *_: Any) -> None:
            clock.end()

    ws, one_node = spec["world_size"], spec["method"] in ONE_NODE
    if one_node or spec["method"] == "single":  # local ranks of one node, or one process alone
        as_one_node(ws if one_node else None)
    trainer = bench_trainer(devices=ws if one_node else 1, num_nodes=1 if one_node else ws, max_steps=spec["steps"],
                            strategy=build_strategy(spec["method"], spec["model"]), callbacks=[Probe()])  # fmt: skip
    trainer.fit(module, datamodule=data)
    return None


def fit_sgp(spec: dict[str, Any], clock: Clock, module: Any, data: Any) -> str | None:
    """fairscale's SGP in a plain loop over this rank's shard; the exact error if it cannot be built here."""
    import warnings

    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    rank, ws = clock.rank, spec["world_size"]
    dist.init_process_group("gloo", rank=rank, world_size=ws)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from fairscale.experimental.nn.data_parallel import SlowMoBaseAlgorithm, SlowMoDistributedDataParallel

            wrapped = SlowMoDistributedDataParallel(module, nprocs_per_node=1, slowmo_base_algorithm=SlowMoBaseAlgorithm.SGP,
                                                    comm_device=torch.device("cpu"))  # fmt: skip
    except Exception as err:  # fairscale's own refusal on this machine is the row's result
        dist.destroy_process_group()
        return (f"SlowMoDistributedDataParallel(slowmo_base_algorithm=SGP, comm_device=cpu) on gloo/CPU: "
                f"{type(err).__name__}: {err}")  # fmt: skip
    optimizer = module.configure_optimizers()
    optimizer = optimizer[0][0] if isinstance(optimizer, tuple) else optimizer
    sampler = DistributedSampler(data.train_set, num_replicas=ws, rank=rank, shuffle=True, seed=spec["seed"])
    epoch = 0
    while clock.steps < spec["steps"]:
        sampler.set_epoch(epoch)
        for x, y in DataLoader(data.train_set, batch_size=spec["batch_size"], sampler=sampler, drop_last=False):
            clock.batch_start()
            loss = torch.nn.functional.cross_entropy(wrapped(x), y)
            loss.backward()
            clock.after_backward()
            optimizer.step()
            optimizer.zero_grad()
            wrapped.perform_slowmo(optimizer)
            clock.batch_end(module)
            if clock.steps >= spec["steps"]:
                break
        epoch += 1
    clock.end()
    dist.destroy_process_group()
    return None


def build_task(spec: dict[str, Any]) -> tuple[Any, Any]:
    """The data module and the module of ``spec["model"]``, from ``spec``'s seed (seeded by the caller)."""
    from lightning_pdist.data import DigitsDataModule, IMDBDataModule
    from lightning_pdist.models import ClassifierModule, SparseBagClassifier
    from lightning_pdist.models.sparse_text import SYNTHETIC_VOCAB

    if spec["model"] == "cnn":
        return (DigitsDataModule(batch_size=spec["batch_size"], seed=spec["seed"]),
                ClassifierModule(model="cnn", width=spec["width"], optimizer="sgd", lr=spec["lr"], momentum=spec["momentum"]))  # fmt: skip
    data = IMDBDataModule(data_dir=spec["data_dir"], vocab_size=SYNTHETIC_VOCAB, batch_size=spec["batch_size"],
                          seed=spec["seed"])  # fmt: skip
    return data, SparseBagClassifier(embed_dim=spec["width"], lr=spec["lr"], head_lr=spec["head_lr"])  # Adagrad


def fit_one(spec: dict[str, Any], straggler: int | None, rank: int) -> dict[str, Any]:
    """One fit of ``spec["method"]`` with rank ``straggler`` slowed (``None``: no straggler); its record."""
    from lightning.fabric.utilities.seed import seed_everything

    seed_everything(spec["seed"], verbose=False)
    data, module = build_task(spec)
    clock = Clock(spec, rank, straggler)
    if spec["method"] == "sgp":
        data.setup("fit")
        error = fit_sgp(spec, clock, module, data)
    else:
        error = fit_lightning(spec, clock, module, data)
    return {"straggler": straggler, "error": error} if error else clock.result(module, data.val_set)


def run(spec: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """Every fit of ``spec["stragglers"]`` in turn in this process, each from the launcher's environment."""
    env = dict(os.environ)  # Lightning's teardown and the hogwild renumbering change it; each fit starts from it
    rank, fits = int(env.get("RANK", "0")), []
    for straggler in spec["stragglers"]:
        os.environ.clear()
        os.environ.update(env)
        if fits and fits[0].get("error"):  # not retried: a process group of a failed launch may be half-built
            fits.append({"straggler": straggler, "error": fits[0]["error"]})
            continue
        fits.append(fit_one(spec, straggler, rank))
    os.environ.clear()
    os.environ.update(env)
    return {"rank": rank, "model": spec["model"], "method": spec["method"], "world_size": spec["world_size"], "fits": fits}


if __name__ == "__main__":
    raise SystemExit(worker_main("lightning_pdist.bench.asynchronous_worker", __doc__, check_spec, run))
