"""One process of the pipeline suite: ``python -m lightning_pdist.bench.pipeline_worker --spec JSON --out-dir DIR``.

Launched once per rank by :func:`~lightning_pdist.bench.netns.launch_ranks` on loopback or emulated
links (rank ``r`` is pipeline stage ``r``); ``spec["job"]`` says
what the rank runs, and each rank writes ``DIR/rank<r>.json``:

* ``engines``: every case of ``spec["cases"]`` in turn on the same MLP (:func:`mlp_layers`), the same batches
  and the same stage cut: ours (:class:`~lightning_pdist.pipeline.executor.StageExecutor` driven directly,
  one ``admit(m); run()`` per batch), ``torch.distributed.pipelining`` (``PipelineStage`` + ``ScheduleGPipe`` /
  ``Schedule1F1B``) and DDP (the whole model per rank, the batch split over the ranks). Per case and rank:
  each timed step's seconds, seconds blocked in ``recv`` (ours) and bytes sent.
* ``deepspeed``: DeepSpeed's ``PipelineModule`` + ``engine.train_batch`` on the same model (its own launch, so a
  failure cannot take the other engines with it; ``{"error": ...}`` when DeepSpeed cannot be imported).
* ``fairscale``: fairscale's ``Pipe`` over ``num_stages`` ``'cpu'`` devices in **one process** (world size 1).
* ``lightning``: ``Trainer(strategy=PipelineStrategy(...))`` on the same model and batches (Lightning's overhead).
* ``stash``: one schedule on a stage with large weights; weight versions alive (``executor.max_versions``), the
  bytes :meth:`~lightning_pdist.pipeline.executor.StageExecutor.weight_versions` counts at the same instants,
  and the process's resident-memory growth (``/proc/self/status`` VmRSS before, VmHWM after).
* ``converge``: ``Trainer`` with ``PipelineStrategy`` (any schedule, DNI as ``synthetic_gradients=True``) or
  ``PdistStrategy`` (Lightning's DDP with byte accounting), SGD with momentum, on
  :class:`~lightning_pdist.data.DigitsDataModule` and ``ClassifierModule(model="cnn")`` or on synthetic IMDB reviews
  and a small BERT (:data:`TRANSFORMER`, cut by ``split_points`` at :data:`BERT_SPLIT`); validation accuracy after
  every epoch, and the training bytes (evaluation traffic is counted apart).
* ``bert``: the same BERT, the same batches and the same cut under ``engine="ours"`` (``Trainer`` with
  ``PipelineStrategy(split_points=[BERT_SPLIT])``, the only way a module that is not one ``nn.Sequential``
  pipelines here) or ``engine="torch"`` (``torch.distributed.pipelining.pipeline()`` traced at the same point,
  ``build_stage`` and ``ScheduleGPipe``/``Schedule1F1B``); a failure of either is its row's reason.

Every rank uses one thread (``torch.set_num_threads(1)``): the ranks already share the machine's cores.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from lightning_pdist.bench.report import check_spec_keys
from lightning_pdist.bench.launch import bench_trainer, close_group, worker_main

SCHEDULES = ("gpipe", "1f1b", "pipedream", "2bw")
DELAYED = ("spectrain", "ddg", "features_replay", "dni", "cdni")  # dni: pipedream with synthetic_gradients=True; cdni: + labels
CONVERGE_MODELS = ("cnn", "transformer")
ENGINES = ("ours", "torch", "ddp")
#: The BERT of the ``converge`` (model "transformer") and ``bert`` jobs: recipes/pipeline_bert.yaml's sizes, no dropout
#: (torch's tracer and ours then run the same deterministic forward), on reviews cut to ``max_len`` tokens.
TRANSFORMER = {"family": "bert", "vocab_size": 5000, "max_len": 128, "hidden_size": 128, "num_layers": 2, "num_heads": 4,
               "intermediate_size": 512, "dropout": 0.0}  # fmt: skip
BERT_SPLIT = "encoder.bert.encoder.layer.1"  # in EncoderClassifier; under ClassifierModule: "model." + this
REVIEWS_PER_CLASS = 300
TORCH_SCHEDULES = ("gpipe", "1f1b")
MLP_KEYS = ("job", "num_stages", "seed", "width", "depth", "batch_size", "warmup_steps", "steps", "lr")
SPEC_KEYS = {
    "engines": (*MLP_KEYS, "cases"),
    "deepspeed": (*MLP_KEYS, "num_microbatches"),
    "fairscale": (*MLP_KEYS, "num_microbatches"),
    "lightning": (*MLP_KEYS, "num_microbatches", "schedule"),
    "stash": ("job", "num_stages", "seed", "width", "depth", "batch_size", "num_microbatches", "batches", "lr", "schedule",
              "weight_stashing"),
    "converge": ("job", "num_stages", "seed", "strategy", "weight_stashing", "num_microbatches", "batch_size", "lr", "momentum",
                 "epochs", "model"),
    "bert": ("job", "num_stages", "seed", "batch_size", "num_microbatches", "warmup_steps", "steps", "lr", "engine", "schedule"),
}
HEADER_BYTES = 16 * 8  # lightning_pdist.pipeline.p2p.HEADER_BYTES (not imported: this module imports torch lazily)


def check_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """Validate a run spec (a plain dict, as it travels on the command line); return it.

    Raises:
        ValueError: the job is unknown, a key is missing or unknown, or a value breaks its rule.
    """
    job = spec.get("job")
    if job not in SPEC_KEYS:
        raise ValueError(f"pipeline_worker spec(job={job!r}): job must be one of {tuple(SPEC_KEYS)}")
    check_spec_keys(spec, SPEC_KEYS[job], f"pipeline_worker[{job}]")
    for key in ("num_stages", "width", "depth", "batch_size", "steps", "num_microbatches", "batches", "epochs"):
        if key in spec and (isinstance(spec[key], bool) or not isinstance(spec[key], int) or spec[key] < 1):
            raise ValueError(f"pipeline_worker spec({key}={spec[key]!r}): {key} must be an int >= 1")
    if "depth" in spec and spec["depth"] % spec["num_stages"]:
        raise ValueError(f"pipeline_worker spec(depth={spec['depth']}): depth must be a multiple of num_stages ({spec['num_stages']})")
    if "warmup_steps" in spec and (not isinstance(spec["warmup_steps"], int) or spec["warmup_steps"] < 1):
        raise ValueError(f"pipeline_worker spec(warmup_steps={spec['warmup_steps']!r}): warmup_steps must be an int >= 1")
    if not spec["lr"] > 0:
        raise ValueError(f"pipeline_worker spec(lr={spec['lr']!r}): lr must be > 0")
    if spec.get("schedule", "gpipe") not in SCHEDULES:
        raise ValueError(f"pipeline_worker spec(schedule={spec['schedule']!r}): schedule must be one of {SCHEDULES}")
    if job == "converge" and spec["strategy"] not in ("ddp", *SCHEDULES, *DELAYED):
        raise ValueError(f"pipeline_worker spec(strategy={spec['strategy']!r}): strategy must be 'ddp' or one of {SCHEDULES + DELAYED}")
    if job == "converge" and spec["model"] not in CONVERGE_MODELS:
        raise ValueError(f"pipeline_worker spec(model={spec['model']!r}): model must be one of {CONVERGE_MODELS}")
    if job == "bert" and (spec["engine"] not in ("ours", "torch") or spec["schedule"] not in TORCH_SCHEDULES):
        raise ValueError(f"pipeline_worker spec(engine={spec['engine']!r}, schedule={spec['schedule']!r}): the bert job runs "
                         f"engine 'ours' or 'torch' with a schedule of {TORCH_SCHEDULES}")  # fmt: skip
    for case in spec.get("cases", []):
        if case.get("engine") not in ENGINES or (case["engine"] != "ddp" and case.get("schedule") not in SCHEDULES):
            raise ValueError(f"pipeline_worker spec(cases=[..., {case!r}]): engine must be one of {ENGINES}, schedule one of {SCHEDULES}")
        if case["engine"] == "torch" and case["schedule"] not in TORCH_SCHEDULES:
            raise ValueError(f"pipeline_worker spec(cases=[..., {case!r}]): torch's schedules here are {TORCH_SCHEDULES}")
        if case.get("post_ahead") not in (None, True, False) or (case["engine"] != "ours" and "post_ahead" in case):
            raise ValueError(f"pipeline_worker spec(cases=[..., {case!r}]): post_ahead is ours', True or False")
        if not isinstance(case.get("num_microbatches"), int) or case["num_microbatches"] < 1:
            raise ValueError(f"pipeline_worker spec(cases=[..., {case!r}]): num_microbatches must be an int >= 1")
    return spec


# -- the model and its data -------------------------------------------------------------------------


def mlp_layers(width: int, depth: int, seed: int) -> list[Any]:
    """``depth`` × (``Linear(width, width)``, ``ReLU``), the last without ReLU: equal stages under any even cut."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i in range(depth):
        layers.append(nn.Linear(width, width))
        if i < depth - 1:
            layers.append(nn.ReLU())
    return layers


def stage_bounds(depth: int, num_stages: int, stage: int) -> tuple[int, int]:
    """Slice of :func:`mlp_layers` that stage ``stage`` runs: ``depth / K`` Linear layers and their ReLUs."""
    per = depth // num_stages
    return 2 * per * stage, min(2 * per * (stage + 1), 2 * depth - 1)


def batches(spec: dict[str, Any], count: int = 4) -> list[tuple[Any, Any]]:
    """``count`` synthetic batches ``(x (B, width), y (B,))`` cycled through by every engine."""
    import torch

    g = torch.Generator().manual_seed(1000 + spec["seed"])
    B, W = spec["batch_size"], spec["width"]
    return [(torch.randn(B, W, generator=g), torch.randint(0, W, (B,), generator=g)) for _ in range(count)]


def rss_status() -> dict[str, int]:
    """This process's ``VmRSS`` and ``VmHWM`` in bytes (``/proc/self/status``)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


# -- engines --------------------------------------------------------------------------------------------


def _usage() -> tuple[float, ...]:
    """(process CPU s, main thread CPU s, voluntary, involuntary context switches of the process, threads, minor
    page faults of the process)."""
    import resource

    me, main = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_THREAD)
    threads = len(os.listdir("/proc/self/task"))
    return (me.ru_utime + me.ru_stime, main.ru_utime + main.ru_stime, me.ru_nvcsw, me.ru_nivcsw, threads, me.ru_minflt)


def _timed_loop(step: Callable[[int], None], spec: dict[str, Any], counters: Callable[[], tuple[float, int]],
                tag: str = "") -> dict[str, Any]:
    """Run ``warmup_steps`` untimed and ``steps`` timed steps between barriers; per-step seconds, wait and bytes.

    With ``PDIST_PROBE=DIR`` in the environment, per step also the process's and the main thread's CPU seconds,
    context switches and thread count (``getrusage``), written to ``DIR/probe_<tag>_<rank>.json`` (a diagnosis aid;
    never in a results file)."""
    import torch.distributed as dist

    probe = os.environ.get("PDIST_PROBE")
    for i in range(spec["warmup_steps"]):
        step(i)
    dist.barrier()
    step_s, wait_s, sent, rows = [], [], [], []
    _BY_NAME.clear()
    t_loop = time.perf_counter()
    for i in range(spec["warmup_steps"], spec["warmup_steps"] + spec["steps"]):
        if probe:
            c0, u0 = list(_COMM), _usage()
        wait0, bytes0, t0 = *counters(), time.perf_counter()
        step(i)
        wait1, bytes1 = counters()
        step_s.append(time.perf_counter() - t0)
        wait_s.append(wait1 - wait0)
        sent.append(bytes1 - bytes0)
        if probe:
            u1 = _usage()
            rows.append([step_s[-1], wait_s[-1], *(b - a for a, b in zip(u0[:4], u1[:4])), u1[4], _COMM[0] - c0[0],
                         _COMM[1] - c0[1], u1[5] - u0[5]])  # fmt: skip
    loop_s = time.perf_counter() - t_loop
    if probe:
        _write_probe(Path(probe), tag, dist.get_rank(), rows)
    return {"step_s": step_s, "wait_s": wait_s, "bytes": sent, "loop_s": loop_s}


_COMM = [0.0, 0.0]  # under PDIST_PROBE: main-thread CPU seconds and wall seconds inside the transport's calls
_BY_NAME: dict[str, list[float]] = {}  # name -> [calls, main-thread CPU s, wall s], over the whole process


def _probe_comm(owner: Any, names: tuple[str, ...], prefix: str = "", total: bool = True) -> None:
    """Under ``PDIST_PROBE``: count the main thread's CPU and wall time inside ``owner.<name>`` calls (``total``:
    into the per-step sum too; calls nested in counted ones pass ``False``)."""
    if not os.environ.get("PDIST_PROBE"):
        return
    for name in names:
        if hasattr(getattr(owner, name), "_probed"):  # a module's function, wrapped in an earlier round
            continue

        def timed(*args: Any, _f: Any = getattr(owner, name), _name: str = prefix + name, **kwargs: Any) -> Any:
            c0, t0 = time.thread_time(), time.perf_counter()
            try:
                return _f(*args, **kwargs)
            finally:
                cpu, wall = time.thread_time() - c0, time.perf_counter() - t0
                if total:
                    _COMM[0] += cpu
                    _COMM[1] += wall
                row = _BY_NAME.setdefault(_name, [0, 0.0, 0.0])
                row[0], row[1], row[2] = row[0] + 1, row[1] + cpu, row[2] + wall
        timed._probed = True  # type: ignore[attr-defined]
        setattr(owner, name, timed)


def _write_probe(out: Path, tag: str, rank: int, rows: list[list[float]]) -> None:
    import json

    out.mkdir(parents=True, exist_ok=True)
    (out / f"probe_{tag}_{rank}_{os.getpid()}_{time.time_ns()}.json").write_text(json.dumps(
        {"cols": ["wall_s", "wait_s", "cpu_s", "main_cpu_s", "vcsw", "ivcsw", "threads", "comm_cpu_s", "comm_wall_s",
                 "minflt"], "rows": rows, "by_name": _BY_NAME}))  # fmt: skip


def run_ours(spec: dict[str, Any], case: dict[str, Any], rank: int) -> dict[str, Any]:
    """Our executor, driven as the strategy drives it: ``admit(m); run()`` per batch, a drain at the end."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn import functional as F

    from lightning_pdist.core.accounting import CommMeter
    from lightning_pdist.pipeline.executor import StageExecutor
    from lightning_pdist.pipeline.p2p import P2P

    K, m = spec["num_stages"], case["num_microbatches"]
    a, b = stage_bounds(spec["depth"], K, rank)
    stage = nn.Sequential(*mlp_layers(spec["width"], spec["depth"], spec["seed"])[a:b])
    data = batches(spec)
    optimizer = torch.optim.SGD(stage.parameters(), lr=spec["lr"])
    meter = CommMeter()
    p2p = P2P(None, meter=meter, post_ahead=bool(case.get("post_ahead")))  # the strategy's default: off
    _probe_comm(p2p, ("send", "recv", "release", "post"))
    _probe_comm(p2p, ("_frame", "_parse"), total=False)
    if os.environ.get("PDIST_PROBE"):  # the transport's own torch.distributed calls, through a proxy of the module
        import types

        import lightning_pdist.pipeline.p2p as p2p_module

        proxy = types.SimpleNamespace(**{k: getattr(dist, k) for k in ("isend", "irecv", "recv", "ProcessGroup", "Work")})
        _probe_comm(proxy, ("isend", "irecv", "recv"), prefix="dist.", total=False)
        p2p_module.dist = proxy

    def chunk(j: int, i: int) -> Any:
        return data[(j // m) % len(data)][i].tensor_split(m)[j % m]

    executor = StageExecutor(
        stage, rank, K, case["schedule"], p2p, prev_rank=rank - 1 if rank else None, next_rank=rank + 1 if rank < K - 1 else None,
        input_fn=lambda j: chunk(j, 0), loss_fn=lambda j, forward: F.cross_entropy(forward(chunk(j, 0)), chunk(j, 1)),
        update_fn=optimizer.step,
    )  # fmt: skip

    def step(_: int) -> None:
        executor.admit(m)
        executor.run()

    result = _timed_loop(step, spec, lambda: (p2p.wait_s, meter.total_bytes), tag=case["schedule"] + "_ours")
    executor.run(draining=True)
    dist.barrier()
    return {**result, "max_versions": executor.max_versions, "post_ahead": p2p.post_ahead}


def run_torch(spec: dict[str, Any], case: dict[str, Any], rank: int) -> dict[str, Any]:
    """``torch.distributed.pipelining``: ``PipelineStage`` + ``ScheduleGPipe`` or ``Schedule1F1B``, SGD after each batch."""
    import torch
    from torch import nn
    from torch.distributed.pipelining import PipelineStage

    K = spec["num_stages"]
    a, b = stage_bounds(spec["depth"], K, rank)
    stage_module = nn.Sequential(*mlp_layers(spec["width"], spec["depth"], spec["seed"])[a:b])
    stage = PipelineStage(stage_module, rank, K, torch.device("cpu"))
    return torch_timed(stage, stage_module.parameters(), spec, case["schedule"], case["num_microbatches"], batches(spec), rank)


def torch_timed(stage: Any, params: Any, spec: dict[str, Any], schedule_name: str, m: int, data: list[tuple[Any, Any]],
                rank: int) -> dict[str, Any]:
    """Time torch's ``ScheduleGPipe``/``Schedule1F1B`` over ``stage`` (a ``PipelineStage``, whatever built it), SGD on
    ``params`` after each batch, the batches of ``data`` in turn."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, schedules
    from torch.nn import functional as F

    _probe_comm(schedules, ("_batch_p2p", "_wait_batch_p2p"))

    K = spec["num_stages"]
    optimizer = torch.optim.SGD(params, lr=spec["lr"])

    def loss_fn(output: Any, target: Any) -> Any:  # a traced stage returns its one output in a tuple
        return F.cross_entropy(output[0] if isinstance(output, (tuple, list)) else output, target)

    schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name](stage, m, loss_fn=loss_fn)

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        if rank == 0:
            schedule.step(x)
        elif rank == K - 1:
            schedule.step(target=y, losses=[], return_outputs=False)
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    result = _timed_loop(step, spec, lambda: (0.0, 0), tag=schedule_name + "_torch")
    dist.barrier()
    return {**result, "wait_s": None, "bytes": None}


def run_ddp(spec: dict[str, Any], case: dict[str, Any], rank: int) -> dict[str, Any]:
    """``DistributedDataParallel``: the whole model on every rank, each rank ``1/K`` of the batch."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn import functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_pdist.core.accounting import all_reduce_bytes

    K = spec["num_stages"]
    model = DDP(nn.Sequential(*mlp_layers(spec["width"], spec["depth"], spec["seed"])))
    data = [(x.tensor_split(K)[rank], y.tensor_split(K)[rank]) for x, y in batches(spec)]
    optimizer = torch.optim.SGD(model.parameters(), lr=spec["lr"])
    per_step = all_reduce_bytes(4 * sum(p.numel() for p in model.parameters()), K)
    count = [0]

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        count[0] += per_step

    result = _timed_loop(step, spec, lambda: (0.0, count[0]))
    dist.barrier()
    return {**result, "wait_s": None}


RUNNERS = {"ours": run_ours, "torch": run_torch, "ddp": run_ddp}


def job_engines(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        cases = [{**case, **RUNNERS[case["engine"]](spec, case, rank)} for case in spec["cases"]]
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return {"cases": cases}


def job_deepspeed(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    """DeepSpeed's PipelineEngine (synchronous 1F1B) with the same layers cut uniformly, plain SGD (no JIT op)."""
    try:
        import deepspeed
        from deepspeed.pipe import PipelineModule
    except Exception as err:  # not installed, or a broken install: the row says why
        return {"error": f"deepspeed cannot be imported: {type(err).__name__}: {err}"}
    import torch
    import torch.distributed as dist
    from torch import nn

    # DeepSpeed's CPU backend JIT-builds a shared-memory all-reduce op (75-80 s on first use); the pipeline's
    # p2p never uses it, so it is switched off and every engine's traffic goes over gloo alike.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    K, m, B = spec["num_stages"], spec["num_microbatches"], spec["batch_size"]
    module = PipelineModule(layers=mlp_layers(spec["width"], spec["depth"], spec["seed"]), num_stages=K,
                            loss_fn=nn.CrossEntropyLoss(), partition_method="uniform")  # fmt: skip
    config = {"train_batch_size": B, "train_micro_batch_size_per_gpu": B // m, "gradient_accumulation_steps": m,
              "steps_per_print": 10**9, "wall_clock_breakdown": False}  # fmt: skip
    optimizer = torch.optim.SGD(module.parameters(), lr=spec["lr"])
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    data = batches(spec)

    def micro_batches():
        i = 0
        while True:
            x, y = data[(i // m) % len(data)]
            yield x.tensor_split(m)[i % m], y.tensor_split(m)[i % m]
            i += 1

    stream = micro_batches()
    result = _timed_loop(lambda _: engine.train_batch(data_iter=stream), spec, lambda: (0.0, 0))
    dist.barrier()
    dist.destroy_process_group()
    return {"cases": [{"engine": "deepspeed", "schedule": "1f1b", "num_microbatches": m, **result, "wait_s": None, "bytes": None}]}


def job_fairscale(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    """fairscale's ``Pipe`` over ``num_stages`` 'cpu' devices: one process, the stages share it."""
    try:
        from fairscale.nn import Pipe
    except Exception as err:
        return {"error": f"fairscale cannot be imported: {type(err).__name__}: {err}"}
    import torch
    from torch import nn
    from torch.nn import functional as F

    K, m = spec["num_stages"], spec["num_microbatches"]
    layers = mlp_layers(spec["width"], spec["depth"], spec["seed"])
    balance = [b - a for a, b in (stage_bounds(spec["depth"], K, s) for s in range(K))]
    pipe = Pipe(nn.Sequential(*layers), balance=balance, devices=["cpu"] * K, chunks=m, checkpoint="never")
    optimizer = torch.optim.SGD(pipe.parameters(), lr=spec["lr"])
    data = batches(spec)
    step_s = []
    for i in range(spec["warmup_steps"] + spec["steps"]):
        x, y = data[i % len(data)]
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(pipe(x), y).backward()
        optimizer.step()
        if i >= spec["warmup_steps"]:
            step_s.append(time.perf_counter() - t0)
    return {"cases": [{"engine": "fairscale", "schedule": "gpipe", "num_microbatches": m, "step_s": step_s,
                       "loop_s": sum(step_s), "wait_s": None, "bytes": None}]}  # fmt: skip


def job_lightning(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    """``Trainer(strategy=PipelineStrategy(...))`` on the same layers and batches; each step timed by a callback."""
    from torch import nn

    from lightning_pdist.models.classifier import ClassifierModule

    module = ClassifierModule(model=nn.Sequential(*mlp_layers(spec["width"], spec["depth"], spec["seed"])),
                              num_classes=spec["width"], optimizer="sgd", lr=spec["lr"])  # fmt: skip
    return {"cases": [lightning_timed(module, batches(spec), spec, "ours+lightning")]}


def lightning_timed(module: Any, data: list[tuple[Any, Any]], spec: dict[str, Any], engine: str, **strategy: Any) -> dict[str, Any]:
    """Fit ``module`` under ``PipelineStrategy(schedule, num_microbatches, **strategy)`` for ``warmup_steps + steps``
    batches of ``data`` in turn; each step timed by a callback (the warm-up dropped)."""
    import torch
    from lightning.pytorch import Callback
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pdist.pipeline.strategy import PipelineStrategy

    total = spec["warmup_steps"] + spec["steps"]
    xs = torch.cat([data[i % len(data)][0] for i in range(total)])
    ys = torch.cat([data[i % len(data)][1] for i in range(total)])
    times: list[float] = []

    class Clock(Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            times.append(time.perf_counter() - self.t0)

    K = spec["num_stages"]
    pipeline = PipelineStrategy(schedule=spec["schedule"], num_microbatches=spec["num_microbatches"], process_group_backend="gloo",
                                **strategy)  # fmt: skip
    trainer = bench_trainer(devices=1, num_nodes=K, strategy=pipeline, max_steps=total, callbacks=[Clock()])
    trainer.fit(module, DataLoader(TensorDataset(xs, ys), batch_size=spec["batch_size"]))
    close_group()
    step_s = times[spec["warmup_steps"] :]
    return {"engine": engine, "schedule": spec["schedule"], "num_microbatches": spec["num_microbatches"], "step_s": step_s,
            "loop_s": sum(step_s), "wait_s": None, "bytes": None}  # fmt: skip


def bert_model(seed: int) -> Any:
    """:data:`TRANSFORMER` (an ``EncoderClassifier``), seeded."""
    import torch

    from lightning_pdist.models.encoder import EncoderClassifier

    torch.manual_seed(seed)
    return EncoderClassifier(num_classes=2, **{k: v for k, v in TRANSFORMER.items()})


def token_batches(spec: dict[str, Any], count: int = 4) -> list[tuple[Any, Any]]:
    """``count`` batches of token ids ``(B, max_len)`` (each row padded with 0 after a random length >= 16) and labels."""
    import torch

    g = torch.Generator().manual_seed(1000 + spec["seed"])
    B, L = spec["batch_size"], TRANSFORMER["max_len"]
    out = []
    for _ in range(count):
        x = torch.randint(1, TRANSFORMER["vocab_size"], (B, L), generator=g)
        x[torch.arange(L) >= torch.randint(16, L + 1, (B, 1), generator=g)] = 0
        out.append((x, torch.randint(0, 2, (B,), generator=g)))
    return out


def job_bert(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    """The BERT cut at :data:`BERT_SPLIT`: ours through Lightning, or torch's ``pipeline()`` on the same cut."""
    data = token_batches(spec)
    if spec["engine"] == "ours":
        from lightning_pdist.models.classifier import ClassifierModule

        module = ClassifierModule(model=bert_model(spec["seed"]), num_classes=2, optimizer="sgd", lr=spec["lr"])
        return {"cases": [lightning_timed(module, data, spec, "ours+lightning", split_points=[f"model.{BERT_SPLIT}"])]}
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import SplitPoint, pipeline

    dist.init_process_group("gloo")
    try:
        m = spec["num_microbatches"]
        try:
            pipe = pipeline(bert_model(spec["seed"]), mb_args=(data[0][0].tensor_split(m)[0],),
                            split_spec={BERT_SPLIT: SplitPoint.BEGINNING})  # fmt: skip
            stage = pipe.build_stage(rank, torch.device("cpu"))
        except Exception as err:  # the row says why torch cannot run this cut
            dist.barrier()
            return {"error": f"torch pipeline() on split {BERT_SPLIT!r}: {type(err).__name__}: {str(err).splitlines()[0][:300]}"}
        case = torch_timed(stage, stage.submod.parameters(), spec, spec["schedule"], m, data, rank)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return {"cases": [{"engine": "torch", "schedule": spec["schedule"], "num_microbatches": m, **case}]}


def job_stash(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    """One schedule on large stages: weight versions, their bytes and the resident memory they cost."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn import functional as F

    from lightning_pdist.pipeline.executor import StageExecutor
    from lightning_pdist.pipeline.p2p import P2P

    class MeteredExecutor(StageExecutor):
        """Also keeps the most bytes :meth:`weight_versions` reports, at the instants ``max_versions`` is taken."""

        max_bytes = 0

        def _measure(self) -> None:
            super()._measure()
            self.max_bytes = max(self.max_bytes, self.weight_versions()[1])

    dist.init_process_group("gloo")
    K, m = spec["num_stages"], spec["num_microbatches"]
    a, b = stage_bounds(spec["depth"], K, rank)
    stage = nn.Sequential(*mlp_layers(spec["width"], spec["depth"], spec["seed"])[a:b])
    data = batches(spec, count=1)
    optimizer = torch.optim.SGD(stage.parameters(), lr=spec["lr"])
    param_bytes = sum(p.numel() * p.element_size() for p in stage.parameters())

    def chunk(j: int, i: int) -> Any:
        return data[0][i].tensor_split(m)[j % m]

    executor = MeteredExecutor(
        stage, rank, K, spec["schedule"], P2P(None), prev_rank=rank - 1 if rank else None,
        next_rank=rank + 1 if rank < K - 1 else None, input_fn=lambda j: chunk(j, 0),
        loss_fn=lambda j, forward: F.cross_entropy(forward(chunk(j, 0)), chunk(j, 1)), update_fn=optimizer.step,
        weight_stashing=spec["weight_stashing"],
    )  # fmt: skip
    dist.barrier()
    before = rss_status()
    try:  # "5" resets VmHWM to the current VmRSS (Linux >= 4.0), so VmHWM is this run's peak
        Path("/proc/self/clear_refs").write_text("5")
        hwm_reset = True
    except OSError:
        hwm_reset = False
    for _ in range(spec["batches"]):
        executor.admit(m)
        executor.run()
    executor.run(draining=True)
    after = rss_status()
    dist.barrier()
    dist.destroy_process_group()
    return {"stage": rank, "param_bytes": param_bytes, "max_versions": executor.max_versions, "max_weight_bytes": executor.max_bytes,
            "rss_before": before["VmRSS"], "hwm_after": after["VmHWM"], "rss_growth": after["VmHWM"] - before["VmRSS"],
            "hwm_reset": hwm_reset}  # fmt: skip


def job_converge(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    """Lightning on digits: validation accuracy per epoch, training bytes, and the activation size at every cut."""
    import torch
    from lightning.pytorch import Callback, seed_everything

    from lightning_pdist.core.strategy import PdistStrategy
    from lightning_pdist.data import DigitsDataModule, IMDBDataModule
    from lightning_pdist.models.classifier import ClassifierModule
    from lightning_pdist.pipeline.strategy import PipelineStrategy

    K, B, m = spec["num_stages"], spec["batch_size"], spec["num_microbatches"]
    seed_everything(spec["seed"], verbose=False)
    cnn = spec["model"] == "cnn"
    model = "cnn" if cnn else bert_model(spec["seed"])
    module = ClassifierModule(model=model, num_classes=10 if cnn else 2, optimizer="sgd", lr=spec["lr"], momentum=spec["momentum"])
    batch = B // K if spec["strategy"] == "ddp" else B  # DDP: the same global batch, split over the ranks
    scratch = tempfile.TemporaryDirectory(prefix="pdist-imdb-")  # each rank writes the same reviews (seeded) apart
    data = (DigitsDataModule(batch_size=batch, seed=spec["seed"]) if cnn else
            IMDBDataModule(data_dir=scratch.name, vocab_size=TRANSFORMER["vocab_size"], max_len=TRANSFORMER["max_len"],
                           batch_size=batch, seed=spec["seed"], synthetic_reviews_per_class=REVIEWS_PER_CLASS))  # fmt: skip
    if spec["strategy"] == "ddp":
        strategy = PdistStrategy(process_group_backend="gloo")
    else:
        synthetic = spec["strategy"] in ("dni", "cdni")
        schedule = "pipedream" if synthetic else spec["strategy"]
        strategy = PipelineStrategy(schedule=schedule, synthetic_gradients=synthetic, num_microbatches=m,
                                    synthetic_conditioning="labels" if spec["strategy"] == "cdni" else None,
                                    weight_stashing=spec["weight_stashing"], process_group_backend="gloo",
                                    split_points=None if cnn else [f"model.{BERT_SPLIT}"])  # fmt: skip
    log: dict[str, Any] = {"epochs": [], "samples": 0, "microbatches": 0, "eval_bytes": 0, "bounds": None, "announced_after": []}
    sizes: list[int] = []  # micro-batch sizes in order: a change of shape costs an announce frame of the old size

    class Probe(Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            split = getattr(trainer.strategy, "split", None)  # the CNN's cut (bytes against Table 1's formula)
            log["bounds"] = None if split is None or not cnn else [list(bd) for bd in split.partition.bounds]

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            log["samples"] += len(batch[1])
            log["microbatches"] += min(m, len(batch[1]))
            for chunk in batch[1].tensor_split(min(m, len(batch[1]))):
                if not sizes or sizes[-1] != len(chunk):
                    log["announced_after"].append(sizes[-1] if sizes else 0)
                sizes.append(len(chunk))

        def on_validation_batch_start(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
            self.sent = trainer.strategy.comm_meter.total_bytes

        def on_validation_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
            log["eval_bytes"] += trainer.strategy.comm_meter.total_bytes - self.sent

        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            log["epochs"].append({"epoch": trainer.current_epoch + 1, "samples": log["samples"],
                                  "val_acc": float(trainer.callback_metrics["val/acc"])})  # fmt: skip

    trainer = bench_trainer(devices=1, num_nodes=K, strategy=strategy, max_epochs=spec["epochs"],
                            limit_val_batches=None, callbacks=[Probe()])  # Lightning's validation: the curves
    t0 = time.perf_counter()
    trainer.fit(module, datamodule=data)
    fit_s = time.perf_counter() - t0
    close_group()
    scratch.cleanup()
    activation_numel = []
    if log["bounds"]:  # per-sample numel of what crosses each cut
        from lightning_pdist.pipeline.partition import list_layers

        layers = [layer for _, layer in list_layers(module.model, "")]
        with torch.no_grad():
            x = module.model.example_input
            for a, b in log["bounds"][:-1]:
                x = torch.nn.Sequential(*layers[a:b])(x)
                activation_numel.append(x.numel())
    meter = trainer.strategy.comm_meter
    return {**log, "fit_s": fit_s, "train_steps": trainer.global_step, "train_bytes": meter.total_bytes - log["eval_bytes"],
            "comm_by_kind": dict(meter.by_kind), "params": sum(p.numel() for p in module.parameters()), "activation_numel": activation_numel,
            "train_size": len(data.train_set)}  # fmt: skip


JOBS = {"engines": job_engines, "deepspeed": job_deepspeed, "fairscale": job_fairscale, "lightning": job_lightning,
        "stash": job_stash, "converge": job_converge, "bert": job_bert}  # fmt: skip


def run(spec: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """One stage (rank) of the launch: run the spec's job; its result (``rank<r>.json``)."""
    rank = int(os.environ.get("RANK", "0"))
    return {"rank": rank, "job": spec["job"], **JOBS[spec["job"]](spec, rank)}


if __name__ == "__main__":
    raise SystemExit(worker_main("lightning_pdist.bench.pipeline_worker", __doc__, check_spec, run))
