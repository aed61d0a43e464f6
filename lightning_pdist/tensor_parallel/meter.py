"""Count the bytes of every collective that DTensor issues (tensor parallelism) into a :class:`CommMeter`.

``torch.distributed.tensor`` turns a redistribution (partial sums to replicated, shards to replicated, ...) into
calls of ``torch.distributed._functional_collectives`` (``funcol.all_reduce``, ``funcol.all_gather_single``,
``funcol.reduce_scatter_single``), forward and backward, through the module attribute at call time. While
:class:`DTensorCommMeter` is active those entry points are wrapped: each call adds the bytes this rank sends
(:mod:`lightning_pdist.core.accounting`'s ring model, from the tensor actually passed) to the meter, then runs.

Why not a ``TorchDispatchMode`` (torch's ``CommDebugMode`` pattern, this module's first version): a mode sees every
aten op of the step in Python, which cost 10-17% of a tensor-parallel BERT step's CPU time here; the wrappers cost
nothing outside the collectives. The price is a dependency on where DTensor calls its collectives: the tests compare
the meter with the byte model on every tensor-parallel plan, so a torch release that moves them fails loudly, and
any collective still unseen is caught by the ``CommDebugMode`` check in ``tests/tensor_parallel/test_meter.py``.

gloo has no reduce-scatter: torch runs it as an all-reduce of the whole tensor, so on gloo a reduce-scatter is
counted as the all-reduce that crosses the wire (``model-parallel-notes.md``).
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from lightning_pdist.core.accounting import CommMeter, all_gather_bytes, all_reduce_bytes, reduce_scatter_bytes

__all__ = ["DTensorCommMeter"]


def _group(group: Any) -> dist.ProcessGroup:
    resolved = funcol._resolve_group(group)
    return resolved if isinstance(resolved, dist.ProcessGroup) else dist.distributed_c10d._resolve_process_group(resolved)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _all_reduce(self: torch.Tensor, reduceOp: str, group: Any, tag: str = "") -> tuple[str, int]:  # noqa: N803
    return "all_reduce", all_reduce_bytes(_nbytes(self), _group(group).size())


def _all_gather(self: torch.Tensor, gather_dim: int, group: Any, tag: str = "") -> tuple[str, int]:
    return "all_gather", all_gather_bytes(_nbytes(self), _group(group).size())


def _reduce_scatter(self: torch.Tensor, reduceOp: str, scatter_dim: int, group: Any,  # noqa: N803
                    tag: str = "") -> tuple[str, int]:  # fmt: skip
    pg = _group(group)
    gloo = dist.get_backend(pg) == "gloo"
    return "reduce_scatter", (all_reduce_bytes if gloo else reduce_scatter_bytes)(_nbytes(self), pg.size())


#: funcol entry point -> (kind, bytes this rank sends), from the same arguments (funcol's own parameter names)
_COUNTERS: dict[str, Callable[..., tuple[str, int]]] = {
    "all_reduce": _all_reduce, "all_gather_single": _all_gather, "reduce_scatter_single": _reduce_scatter,
}  # fmt: skip


class DTensorCommMeter:
    """Context manager: while active, DTensor's collectives add their bytes to ``meter`` under ``prefix + kind``.

    Kinds: ``all_reduce``, ``all_gather``, ``reduce_scatter`` (``prefix`` defaults to ``"tp_"``). Collectives called
    directly through ``torch.distributed`` (not DTensor) are not seen: the strategies count those where they call
    them. Not reentrant; one at a time per process.
    """

    def __init__(self, meter: CommMeter, prefix: str = "tp_"):
        self.meter, self.prefix = meter, prefix
        self.calls: Counter[str] = Counter()  # collectives seen, by kind (the tests compare them with CommDebugMode)
        self._saved: dict[str, Callable] = {}

    def __enter__(self) -> DTensorCommMeter:
        if self._saved:
            raise RuntimeError("DTensorCommMeter is already active")
        for name, counter in _COUNTERS.items():
            original = getattr(funcol, name)
            self._saved[name] = original
            setattr(funcol, name, self._wrap(original, counter))
        return self

    def __exit__(self, *exc_info: object) -> None:
        for name, original in self._saved.items():
            setattr(funcol, name, original)
        self._saved = {}

    def _wrap(self, original: Callable, counter: Callable[..., tuple[str, int]]) -> Callable:
        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            kind, sent = counter(*args, **kwargs)
            self.meter.add(self.prefix + kind, sent)
            self.calls[kind] += 1
            return original(*args, **kwargs)

        return counted
