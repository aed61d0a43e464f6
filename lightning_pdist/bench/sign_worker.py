"""One rank of the sign suite's communication benchmark: ``python -m lightning_pdist.bench.sign_worker --spec JSON
--out-dir DIR``.

Plain ``torch.nn.parallel.DistributedDataParallel`` on gloo (no Lightning): the launcher
(:func:`~lightning_pdist.bench.netns.launch_ranks` (loopback or
emulated links)) sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT`` and ``GLOO_SOCKET_IFNAME``. The rank trains ``MLP(in_features, hidden)`` on
synthetic batches with one of :data:`HOOKS` registered, and times ``steps`` optimizer steps after
``warmup_steps`` untimed ones (DDP's bucket rebuild, PowerSGD's vanilla start and IT-signSGD's
warm-up all fall in the untimed part). Around the timed steps it reads its veth's kernel
``tx_bytes`` and ``tx_packets`` (emulated links only) after a barrier on every rank, and writes
``DIR/rank<r>.json``::

    {"rank", "world_size", "hook", "params", "steps", "ms_per_step", "loop_s",
     "loop_cpu_s", "compute_ms_per_step", "logged_bytes", "logged_by_kind", "bytes_source",
     "tx_bytes", "tx_packets"}

``logged_bytes`` are the timed steps' bytes: our hooks count theirs in a
:class:`~lightning_pdist.core.accounting.CommMeter`; for PyTorch's hooks a wrapper applies the
byte model of :mod:`~lightning_pdist.core.accounting` to every bucket they send, and DDP's own
fp32 all-reduce (no hook) is modelled from the parameter count.
"""

# No ``from __future__ import annotations``: DDP inspects comm hooks' annotations at run time.

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from lightning_pdist.bench.launch import WorkerSpec, worker_main

HOOKS = ("fp32_allreduce", "fp16_compress", "powersgd", "signsgd_mv", "it_signsgd")


@dataclass(frozen=True)
class Spec(WorkerSpec):
    """One comm-hook run: plain DDP with ``hook``, ``steps`` timed steps after ``warmup_steps``."""

    WHO: ClassVar[str] = "sign_worker"
    hook: str
    world_size: int
    warmup_steps: int
    steps: int
    batch_size: int
    in_features: int
    hidden: int
    seed: int
    powersgd_rank: int
    it_warmup_rounds: int

    def __post_init__(self) -> None:
        self.one_of("hook", HOOKS)
        self.ints("world_size", "steps", "batch_size", "in_features", "hidden", "powersgd_rank")
        self.ints("warmup_steps", "seed", "it_warmup_rounds", low=0)
        if self.hook == "powersgd" and self.warmup_steps < 3:
            raise self.bad("warmup_steps", "powersgd starts compressing at step 2, so warmup_steps must be >= 3 for the "
                           "timed steps to be compressed")  # fmt: skip


check_spec = Spec.check


def powersgd_bytes(shapes: list, world_size: int, rank: int, min_compression_rate: float = 2) -> dict[str, int]:
    """Bytes one rank sends for one bucket in one compressed PowerSGD step (torch's ``powerSGD_hook``).

    The hook views each tensor as ``(n, m)``; it compresses it to ``P (n, r)`` and ``Q (m, r)`` when
    ``(n + m)·r·min_compression_rate < n·m`` and all-reduces the rest uncompressed, in fp32:
    three all-reduces (uncompressed, Ps, Qs).
    """
    from lightning_pdist.core.accounting import all_reduce_bytes

    uncompressed = ps = qs = 0
    for shape in shapes:
        n = shape[0] if shape else 1
        m = 1
        for s in shape[1:]:
            m *= s
        r = min(n, m, rank)
        if (n + m) * r * min_compression_rate < n * m:
            ps, qs = ps + n * r, qs + m * r
        else:
            uncompressed += n * m
    return {
        "powersgd_uncompressed": all_reduce_bytes(4 * uncompressed, world_size),
        "powersgd_p": all_reduce_bytes(4 * ps, world_size),
        "powersgd_q": all_reduce_bytes(4 * qs, world_size),
    }


def metered_hook(hook, kind: str, meter):
    """Wrap one of PyTorch's hooks so that ``meter`` counts each bucket by the accounting byte model."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    from lightning_pdist.core.accounting import all_reduce_bytes

    def wrapped(state, bucket):  # the parameter must be named ``bucket``: DDP checks it
        world_size = state.process_group.size() if hasattr(state, "process_group") and state.process_group else None
        world_size = world_size or int(os.environ["WORLD_SIZE"])
        numel = bucket.buffer().numel()
        if kind == "fp16_compress":
            meter.add("fp16_all_reduce", all_reduce_bytes(2 * numel, world_size))
        elif isinstance(state, PowerSGDState) and state.iter >= state.start_powerSGD_iter:
            shapes = [tuple(g.shape) for g in bucket.gradients()]
            for name, n in powersgd_bytes(shapes, world_size, state.matrix_approximation_rank).items():
                meter.add(name, n)
        else:  # PowerSGD's vanilla start, fp32
            meter.add("all_reduce", all_reduce_bytes(4 * numel, world_size))
        return hook(state, bucket)

    return wrapped


def build_hook(spec: dict[str, Any], model: Any, meter: Any) -> str:
    """Register ``spec["hook"]`` on the DDP ``model``; return how its bytes are counted."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    from lightning_pdist.sign.hooks import ITSignSGDState, SignSGDState, it_signsgd_hook, signsgd_mv_hook

    name = spec["hook"]
    if name == "fp32_allreduce":
        return "accounting model (DDP's built-in all-reduce, no hook)"
    if name == "fp16_compress":
        model.register_comm_hook(dist.group.WORLD, metered_hook(default_hooks.fp16_compress_hook, name, meter))
        return "accounting model (wrapper)"
    if name == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=dist.group.WORLD, matrix_approximation_rank=spec["powersgd_rank"], start_powerSGD_iter=2
        )
        model.register_comm_hook(state, metered_hook(powerSGD_hook.powerSGD_hook, name, meter))
        return "accounting model (wrapper)"
    if name == "signsgd_mv":
        model.register_comm_hook(SignSGDState(meter=meter), signsgd_mv_hook)
    else:
        model.register_comm_hook(ITSignSGDState(meter=meter, warmup_rounds=spec["it_warmup_rounds"]), it_signsgd_hook)
    return "meter (the hook counts its own collectives)"


#: Every DDP wrap this process made, kept alive until the process ends (``os._exit``: no destructor runs). Freeing
#: one frees its Reducer's gloo group, and torch's ``~ProcessGroupGloo`` joins the group's work thread while holding
#: the GIL; that thread may still be freeing the last barrier's work, whose tensors need the GIL to drop their Python
#: objects: a deadlock (both ranks stuck for good; gdb: ``Reducer::~Reducer`` → ``ProcessGroupGloo::~ProcessGroupGloo``
#: → ``thread::join`` against ``runLoop`` → ``~AsyncBarrierWork`` → ``decref_pyobject`` → ``take_gil``), seen about once
#: in 5 runs of the comm test on a fast host.
_KEPT: list[Any] = []


def run(spec: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """Run one rank as ``spec`` says; write and return its result dict."""
    import torch
    import torch.distributed as dist
    from torch.nn import functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_pdist.bench.worker import read_tx
    from lightning_pdist.core.accounting import CommMeter, all_reduce_bytes
    from lightning_pdist.models.mlp import MLP

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(spec["seed"])
    model = MLP(in_features=spec["in_features"], num_classes=10, hidden=spec["hidden"])
    params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(1000 * spec["seed"] + rank)
    batches = [(torch.randn(spec["batch_size"], spec["in_features"], generator=g),
                torch.randint(0, 10, (spec["batch_size"],), generator=g)) for _ in range(4)]  # fmt: skip

    def step(net: Any, optimizer: Any, i: int) -> None:
        x, y = batches[i % len(batches)]
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()
        optimizer.step()

    # Compute alone (no DDP, no communication): what a step costs on this core before any hook.
    local_opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    step(model, local_opt, 0)
    t0 = time.perf_counter()
    for i in range(3):
        step(model, local_opt, i)
    compute_ms = 1000 * (time.perf_counter() - t0) / 3

    # env:// (MASTER_ADDR/MASTER_PORT) by default; PDIST_INIT_METHOD (e.g. file://...) lets a caller that runs
    # several specs in a row give each a fresh rendezvous without picking ports.
    dist.init_process_group("gloo", init_method=os.environ.get("PDIST_INIT_METHOD", "env://"), rank=rank,
                            world_size=world_size)  # fmt: skip
    try:
        ddp = DDP(model)
        _KEPT.append(ddp)
        meter = CommMeter()
        source = build_hook(spec, ddp, meter)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-4)
        per_step_model = all_reduce_bytes(4 * params, world_size) if spec["hook"] == "fp32_allreduce" else 0
        for i in range(spec["warmup_steps"]):
            step(ddp, optimizer, i)
        ifname = os.environ.get("GLOO_SOCKET_IFNAME")
        dist.barrier()
        tx0, logged0, by_kind0 = read_tx(ifname), meter.total_bytes, dict(meter.by_kind)
        t0, cpu0 = time.perf_counter(), time.process_time()
        for i in range(spec["steps"]):
            step(ddp, optimizer, i)
            if per_step_model:
                meter.add("all_reduce", per_step_model)
        # The barrier makes sure every rank's last sends have left before the counter is read.
        dist.barrier()
        loop_s, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
        tx1 = read_tx(ifname)
        dist.barrier()  # see sign/hooks.py: a barrier before teardown avoids a gloo hang
    finally:
        dist.destroy_process_group()
    result = {
        "rank": rank,
        "world_size": world_size,
        "hook": spec["hook"],
        "params": params,
        "steps": spec["steps"],
        "ms_per_step": 1000 * loop_s / spec["steps"],
        "loop_s": loop_s,
        "loop_cpu_s": cpu_s,
        "compute_ms_per_step": compute_ms,
        "logged_bytes": meter.total_bytes - logged0,
        "logged_by_kind": {k: v - by_kind0.get(k, 0) for k, v in meter.by_kind.items()},
        "bytes_source": source,
        "tx_bytes": None if tx0 is None or tx1 is None else tx1[0] - tx0[0],
        "tx_packets": None if tx0 is None or tx1 is None else tx1[1] - tx0[1],
    }
    return result


if __name__ == "__main__":
    raise SystemExit(worker_main("lightning_pdist.bench.sign_worker", __doc__, check_spec, run))
