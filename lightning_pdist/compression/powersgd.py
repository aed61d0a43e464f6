"""PowerSGD (Vogels, Karimireddy, Jaggi, NeurIPS 2019) on torch's own hook and state, counted and guarded.

``PowerSGD(rank)`` builds torch's ``PowerSGDState`` and registers ``powerSGD_hook`` through a thin wrapper that

* first all-reduces one non-finite flag per bucket (4 bytes): a non-finite bucket on some rank comes back NaN on
  every rank and torch's hook does not run, so its error-feedback memory never takes a NaN (the policy applies
  before compression);
* counts the bytes torch's hook sends (:func:`powersgd_bytes`: the uncompressed tensors' all-reduce, then ``P``'s
  and ``Q``'s; ``n·m`` matrices with ``(n + m)·r·min_compression_rate < n·m`` are compressed).

torch keys its state by DDP bucket index, so PowerSGD carries gradients only (a DDP hook); its state goes into the
checkpoint with ``PowerSGDState.__getstate__``. Resuming restores it, but DDP's first step after a restart has the
initial bucket layout, not the rebuilt one, so a resumed PowerSGD run is close to, not bit-identical with, the
uninterrupted one (torch's limitation).
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at run time.

from typing import Callable, Hashable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

from lightning_pdist.core.accounting import CommMeter, all_reduce_bytes
from lightning_pdist.core.compression import CompressionState, Compressor

__all__ = ["PowerSGD", "powersgd_bytes"]


def powersgd_bytes(shapes: list[torch.Size], rank: int, min_compression_rate: float, world_size: int,
                   element_size: int = 4) -> int:  # fmt: skip
    """Bytes one rank sends in one compressed ``powerSGD_hook`` call on a bucket of tensors shaped ``shapes``."""
    raw = p = q = 0
    for shape in shapes:
        numel = int(torch.Size(shape).numel())
        if len(shape) <= 1:
            raw += numel
            continue
        n, m = shape[0], numel // shape[0]
        r = min(n, m, rank)
        if (n + m) * r * min_compression_rate < n * m:
            p, q = p + n * r, q + m * r
        else:
            raw += numel
    return sum(all_reduce_bytes(c * element_size, world_size) for c in (raw, p, q))


class PowerSGD(Compressor):
    """Low-rank gradient compression with error feedback: torch's ``powerSGD_hook`` underneath.

    Args:
        rank: ``r >= 1``, the approximation rank (1: torch's default; 2–4 for accuracy-sensitive models).
        start_iter: steps of plain all-reduce first (2, the earliest torch allows with error feedback or warm
            start: DDP rebuilds its buckets after step 1).
        min_compression_rate: compress a matrix only if it shrinks by more than this (2, torch's).
        error_feedback: default True. warm_start: reuse ``Q`` between steps (default True).
        seed: the random ``Q``'s seed.
    """

    name = "powersgd"
    uses = ("gradients",)
    refusals = {
        "pushes": "PowerSGD needs an all-reduce (every rank's P and Q factors summed in lockstep, torch's state "
                  "keyed by DDP bucket); a parameter server takes each worker's push on its own",
        "deltas": "torch's PowerSGD state is keyed by DDP gradient bucket",
    }

    def __init__(self, rank: int = 1, start_iter: int = 2, min_compression_rate: float = 2.0,
                 error_feedback: bool = True, warm_start: bool = True, seed: int = 0) -> None:  # fmt: skip
        owner = type(self).__name__
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"{owner}(rank={rank!r}): rank must be an int >= 1 (the approximation rank)")
        low = 2 if (error_feedback or warm_start) else 0
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < low:
            raise ValueError(f"{owner}(start_iter={start_iter!r}): start_iter must be an int >= {low} (DDP rebuilds "
                             "its buckets after step 1, which error feedback and warm start need behind them)")
        self.rank, self.start_iter, self.min_compression_rate = rank, start_iter, float(min_compression_rate)
        self.error_feedback, self.warm_start, self.seed = bool(error_feedback), bool(warm_start), seed

    def settings(self) -> dict:
        return {"rank": self.rank, "start_iter": self.start_iter, "min_compression_rate": self.min_compression_rate,
                "error_feedback": self.error_feedback, "warm_start": self.warm_start, "seed": self.seed}

    def mean(self, tensors, keys, state, group, meter, kind):
        raise ValueError("PowerSGD carries DDP gradient buckets only (torch keys its state by bucket)")

    def torch_state(self, group: dist.ProcessGroup | None) -> torch_powersgd.PowerSGDState:
        return torch_powersgd.PowerSGDState(
            process_group=group, matrix_approximation_rank=self.rank, start_powerSGD_iter=self.start_iter,
            min_compression_rate=self.min_compression_rate, use_error_feedback=self.error_feedback,
            warm_start=self.warm_start, random_seed=self.seed, compression_stats_logging_frequency=10**9)  # fmt: skip

    def ddp_hook(self, state: CompressionState, meter: CommMeter | None, keys: dict[int, Hashable],
                 track_nonfinite: bool) -> tuple[object, Callable]:  # fmt: skip
        hook_state = PowerSGDHookState(self, self.torch_state(None), meter)
        state.extra["torch"] = hook_state  # saved through torch's __getstate__ (PowerSGDHookState.state_dict)
        return hook_state, powersgd_hook


class PowerSGDHookState:
    """torch's ``PowerSGDState`` plus our meter and the non-finite note (the base strategy reads it)."""

    track_nonfinite = True

    def __init__(self, compressor: PowerSGD, torch_state: torch_powersgd.PowerSGDState, meter: CommMeter | None):
        self.compressor, self.torch_state, self.meter = compressor, torch_state, meter
        self.nonfinite = False

    def take_nonfinite(self) -> bool:
        noted, self.nonfinite = self.nonfinite, False
        return noted

    def state_dict(self) -> dict:
        return {k: v for k, v in self.torch_state.__getstate__().items()}

    def load_state_dict(self, saved: dict) -> None:
        for slot, value in saved.items():
            setattr(self.torch_state, slot, value)


def powersgd_hook(hook_state: PowerSGDHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's ``powerSGD_hook`` behind one all-reduced non-finite flag, its bytes counted."""
    buffer = bucket.buffer()
    world_size = dist.get_world_size()
    own_bad = not bool(torch.isfinite(buffer).all())
    flag = torch.tensor([float(own_bad)])
    dist.all_reduce(flag)
    ts, meter = hook_state.torch_state, hook_state.meter
    if meter is not None:
        meter.add("grad_powersgd", all_reduce_bytes(4, world_size))
    if float(flag[0]) != 0.0:
        hook_state.nonfinite = own_bad
        buffer.fill_(float("nan"))
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(buffer)
        return fut
    if meter is not None:
        if ts.iter < ts.start_powerSGD_iter:
            sent = all_reduce_bytes(buffer.numel() * buffer.element_size(), world_size)
        else:
            shapes = [g.shape for g in bucket.gradients()]
            sent = powersgd_bytes(shapes, ts.matrix_approximation_rank, ts.min_compression_rate, world_size,
                                  buffer.element_size())  # fmt: skip
        meter.add("grad_powersgd", sent)
    return torch_powersgd.powerSGD_hook(ts, bucket)
