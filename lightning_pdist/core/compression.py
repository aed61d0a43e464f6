"""The seam between the strategies and gradient compression: what a compressor is, and the DDP hook that runs one.

The strategies (:class:`~lightning_pdist.core.strategy.PdistStrategy`, the averaging family, ...) accept a
``compression=`` value and know it only through :class:`Compressor`; the compressors themselves live in the
``compression/`` family (``from lightning_pdist.compression import TopK, DGC, ...``), which implements this protocol.
So no family imports another, and a strategy composes with any compressor.

A compressor is a *value* (its settings); its run-time state (error-feedback residuals, DGC's momentum, random
generators, step counts) lives in a :class:`CompressionState` that the strategy owns and checkpoints, one per rank.
Everything is keyed by a stable *key* per tensor (the parameter's index in ``module.parameters()``), never by DDP's
bucket index, so DDP's bucket rebuild after the first step, or any bucket layout, changes nothing.

:meth:`Compressor.mean` is the one call every user makes: the (compressed) mean of each tensor over the group, with
error feedback applied and the bytes this rank sends counted in ``meter``.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at run time.

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_pdist.core.accounting import CommMeter

__all__ = ["CompressedHookState", "CompressionState", "Compressor", "compressed_hook", "refuse_compression"]

#: What a strategy asks a compressor to carry: a step's gradients (DDP hook), a model delta since the last
#: synchronization (averaging), a worker's push to a parameter server.
USES = ("gradients", "deltas", "pushes")


class CompressionState:
    """A rank's run-time compression state: named tensors per key, plus small counters, all checkpointable.

    ``tensors[name][key]`` holds e.g. the residual ``e`` of parameter ``key``; ``counters`` plain numbers;
    ``generator`` a ``torch.Generator`` state (bytes) where a compressor samples.
    """

    def __init__(self) -> None:
        self.tensors: dict[str, dict[Hashable, Tensor]] = {}
        self.counters: dict[str, int] = {}
        self.extra: dict[str, Any] = {}

    def buffer(self, name: str, key: Hashable, like: Tensor) -> Tensor:
        """The ``name`` buffer of ``key`` (zeros shaped like ``like`` in fp32 the first time)."""
        table = self.tensors.setdefault(name, {})
        if key not in table:
            table[key] = torch.zeros(like.shape, dtype=torch.float32, device=like.device)
        return table[key]

    def state_dict(self) -> dict:
        extra = {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in self.extra.items()}
        return {"tensors": {n: {k: v.detach().cpu().clone() for k, v in t.items()} for n, t in self.tensors.items()},
                "counters": dict(self.counters), "extra": extra}  # fmt: skip

    def load_state_dict(self, state: dict, device: torch.device | None = None) -> None:
        self.tensors = {n: {k: v.to(device) if device is not None else v.clone() for k, v in t.items()}
                        for n, t in state.get("tensors", {}).items()}  # fmt: skip
        self.counters = dict(state.get("counters", {}))
        for name, value in state.get("extra", {}).items():
            held = self.extra.get(name)
            if hasattr(held, "load_state_dict"):  # an object the hook holds (torch's PowerSGD state)
                held.load_state_dict(value)
            else:
                self.extra[name] = value


class Compressor(ABC):
    """A gradient compressor (the protocol the ``compression/`` family implements).

    Subclasses give :meth:`mean`; the per-tensor ``compress``/``decompress``/``aggregate`` and the byte model are
    theirs. ``uses`` says what a compressor can carry (:data:`USES`); a strategy refuses the others at construction
    (:func:`refuse_compression`).
    """

    #: Short name in logs and errors.
    name: str = "compressor"
    #: What it can carry: a subset of :data:`USES`.
    uses: tuple[str, ...] = USES
    #: Whether ``decompress(compress(x)) == x`` always (then error feedback is meaningless and off).
    lossless: bool = False
    error_feedback: bool = False
    #: Why a use outside :attr:`uses` cannot work (``use -> reason``), quoted by :func:`refuse_compression`.
    refusals: dict[str, str] = {}

    def new_state(self) -> CompressionState:
        """A fresh run-time state (one per rank and per use)."""
        return CompressionState()

    @abstractmethod
    def mean(self, tensors: Sequence[Tensor], keys: Sequence[Hashable], state: CompressionState,
             group: dist.ProcessGroup | None, meter: CommMeter | None, kind: str) -> list[Tensor] | None:
        """The compressed mean over ``group`` of each of ``tensors`` (this rank's), error feedback applied.

        A collective: every rank calls it with the same keys and shapes. Returns ``None`` on every rank when some
        rank's input was not finite; the state is then left as it was (the non-finite policy decides, before
        anything is compressed into a residual).
        """

    def compress_push(self, g: Tensor, key: Hashable, state: CompressionState, rank: int,
                      world_size: int) -> tuple[bytes, Tensor]:  # fmt: skip
        """One tensor of a parameter-server push, on the worker: ``(its bytes, x̂)``.

        The bytes are one :mod:`~lightning_pdist.core.push_codec` form (what the server decodes, knowing only the
        tensor's size); ``x̂`` is exactly what the server will decode from them. Error feedback stays on the worker:
        ``e ← x − x̂`` (and the per-key step counts) are committed here, in ``state``. ``rank`` seeds a compressor's
        own random draws; ``world_size`` is the number of workers. Only for compressors whose :attr:`uses` include
        ``"pushes"``.
        """
        raise ValueError(f"{type(self).__name__} does not carry parameter-server pushes")

    def ddp_hook(self, state: CompressionState, meter: CommMeter | None, keys: dict[int, Hashable],
                 track_nonfinite: bool) -> tuple[object, Callable]:
        """The ``(hook_state, hook)`` pair that compresses DDP's gradient buckets (default: :func:`compressed_hook`)."""
        return CompressedHookState(self, state, meter, keys, track_nonfinite), compressed_hook

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.settings().items())
        return f"{type(self).__name__}({fields})"

    def settings(self) -> dict[str, Any]:
        """The constructor arguments (for ``repr``, logs and checkpoints)."""
        return {}


def refuse_compression(owner: str, compression: Any, use: str) -> Compressor | None:
    """Check a strategy's ``compression=`` argument: ``None`` or a :class:`Compressor` that can carry ``use``."""
    if compression is None:
        return None
    if not isinstance(compression, Compressor):
        raise TypeError(f"{owner}(compression={compression!r}): compression must be None or a compressor from "
                        "lightning_pdist.compression, e.g. TopK(0.01)")  # fmt: skip
    if use not in compression.uses:
        why = compression.refusals.get(use)
        raise ValueError(f"{owner}(compression={compression!r}): {owner} compresses {use}, which "
                         f"{type(compression).__name__} cannot carry (it carries {', '.join(compression.uses)})"
                         + (f": {why}" if why else ""))  # fmt: skip
    return compression


@dataclass
class CompressedHookState:
    """State of :func:`compressed_hook`: the compressor, its run-time state, and each parameter's key."""

    compressor: Compressor
    state: CompressionState
    meter: CommMeter | None
    keys: dict[int, Hashable]  # id(parameter) -> stable key
    track_nonfinite: bool = False
    process_group: dist.ProcessGroup | None = None
    nonfinite: bool = field(default=False, init=False)  # this rank's bucket was not finite since the last take

    def take_nonfinite(self) -> bool:
        noted, self.nonfinite = self.nonfinite, False
        return noted


def compressed_hook(hook_state: CompressedHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Replace the bucket's gradients by their compressed mean over the group (per parameter tensor).

    Runs synchronously and returns a completed future, so every rank issues its collectives in the same order.
    When some rank's bucket was not finite, the bucket comes back NaN on every rank and no state changes.
    """
    buffer = bucket.buffer()
    grads = bucket.gradients()
    keys = [hook_state.keys[id(p)] for p in bucket.parameters()]
    own_bad = hook_state.track_nonfinite and not bool(torch.isfinite(buffer).all())  # this rank's, before anything
    out = hook_state.compressor.mean(grads, keys, hook_state.state, hook_state.process_group, hook_state.meter,
                                     "grad_" + hook_state.compressor.name)  # fmt: skip
    if out is None:
        hook_state.nonfinite = hook_state.nonfinite or own_bad
        buffer.fill_(float("nan"))
    else:
        for grad, value in zip(grads, out):
            grad.copy_(value.view_as(grad))
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buffer)
    return fut
