"""DDP communication hooks for gradient averaging, in PyTorch's ``hook(state, bucket) -> Future`` form.

They can be registered on any ``DistributedDataParallel`` model with
``model.register_comm_hook(state, hook)``, CPU/gloo included.

* :func:`allreduce_hook` averages each gradient bucket with a counted ring all-reduce: the same
  arithmetic as DDP's built-in reduction (divide by ``N``, then sum), plus byte accounting.
* :func:`periodic_allreduce_hook` does that only while ``state.allreduce`` is True and
  otherwise hands the local gradient back untouched: the gradient side of local SGD, BMUF and
  EASGD, whose strategies flip the flag after warm-up (like PyTorch's ``post_localSGD_hook``).

A hook's ``Future.then`` callback runs on one of gloo's threads, which takes the GIL to run it and again to free it.
While such a callback is in flight, a process must neither free its process group holding the GIL
(``~ProcessGroupGloo`` waits for that thread, which waits for the GIL: a deadlock) nor finalize the interpreter (the
thread is made to exit inside C++ frames that cannot unwind: ``terminate called without an active exception``,
SIGABRT). :func:`handed_then` remembers each callback until gloo's thread has freed it, and
:func:`settle_comm_callbacks` waits, the GIL released, until none is left: the strategies call it in ``teardown``
and every process calls it at exit (``atexit``, with a short grace: :func:`_settle_at_exit`).

No ``from __future__ import annotations`` here: DDP checks the hook's annotations at run time.
"""


import atexit
import os
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lightning_pdist.core.accounting import CommMeter, all_reduce_bytes

__all__ = ["AllReduceState", "allreduce_hook", "handed_then", "periodic_allreduce_hook", "settle_comm_callbacks"]

#: The callbacks this process handed to torch's communication threads that those threads have not freed yet.
_HANDED: "weakref.WeakSet" = weakref.WeakSet()


def handed_then(fut: torch.futures.Future, callback) -> torch.futures.Future:
    """``fut.then(callback)``, with ``callback`` (a new function object per call) remembered until it is freed."""
    _HANDED.add(callback)
    return fut.then(callback)


def settle_comm_callbacks(timeout: float = 10.0) -> bool:
    """Sleep (the GIL released) until torch's threads have run and freed every :func:`handed_then` callback.

    Returns whether none is left; after ``timeout`` seconds (a work that never completes: a peer gone) it gives up.
    """
    deadline = time.monotonic() + timeout
    while len(_HANDED):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def _settle_at_exit(timeout: float = 5.0, grace: float = 0.1) -> None:
    """At exit: :func:`settle_comm_callbacks`, then, if a callback was in flight, ``grace`` seconds more (the GIL
    released). torch frees the callback first and then, on the same gloo thread, what the callback's future and the
    work still hold (``PythonFutureWrapper.then`` destroys its closure's guard before the parent future; a work's tensors
    whose Python objects are gone were preserved by their ``TensorImpl``): that thread takes the GIL once more after
    the callback is gone. Finalizing in that gap aborted a rank once in CI (tests/core/test_exit_settle.py); not
    reproduced in 80 runs, so the grace is sized from torch's code, not measured."""
    if len(_HANDED) and settle_comm_callbacks(timeout):
        time.sleep(grace)


atexit.register(_settle_at_exit)  # registered at import, so it runs after the program's own exit handlers
os.register_at_fork(after_in_child=_HANDED.clear)  # a forked child has none of its parent's gloo threads to wait for


@dataclass
class AllReduceState:
    """State of the gradient-averaging hooks.

    Attributes:
        process_group: group to average over (``None``: the default group).
        meter: where the bytes this rank sends are counted (``None``: not counted).
        allreduce: whether :func:`periodic_allreduce_hook` communicates on this step.
        track_nonfinite: note whether this rank's own bucket held NaN/Inf before the average (its
            minimum and maximum, one pass per bucket, no host sync), so that a non-finite average can be
            blamed on its ranks; read and cleared by :meth:`take_nonfinite`.
    """

    process_group: dist.ProcessGroup | None = None
    meter: CommMeter | None = None
    allreduce: bool = True
    track_nonfinite: bool = False
    nonfinite: torch.Tensor | None = field(default=None, init=False, repr=False)  # bool scalar: some bucket was
    # (min, max) of the buckets noted since the last fold: read only on the failure path, so the hook's note is one
    # reduction and nothing else (each further tiny op costs microseconds that a small model's step feels).
    _extremes: list[torch.Tensor] = field(default_factory=list, init=False, repr=False)

    def note_bucket(self, buffer: torch.Tensor) -> None:
        """Note whether ``buffer`` (this rank's own gradients, before the average) holds NaN/Inf."""
        values = buffer._values() if buffer.is_sparse else buffer  # an nn.Embedding(sparse=True) gradient: its rows
        if self.track_nonfinite and values.numel():
            self._extremes.extend(torch.aminmax(values))  # NaN propagates; far cheaper than isfinite(buffer).all()
            if len(self._extremes) > 128:  # bounded memory: fold into the flag now and then
                self._fold()

    def _fold(self) -> None:
        if self._extremes:
            bad = ~torch.isfinite(torch.stack([e.float() for e in self._extremes])).all()
            self.nonfinite = bad if self.nonfinite is None else self.nonfinite | bad
            self._extremes = []

    def take_nonfinite(self) -> bool:
        """Whether a bucket noted since the last call held NaN/Inf on this rank; clears the note."""
        self._fold()
        noted, self.nonfinite = self.nonfinite, None
        return noted is not None and bool(noted)


def allreduce_hook(state: AllReduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over ``state.process_group`` and count the bytes sent."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world_size = group.size()
    buffer = bucket.buffer()
    state.note_bucket(buffer)  # this rank's own gradients, before the average (a NaN average is blamed on them)
    buffer.div_(world_size)
    if state.meter is not None:  # a sparse bucket (gloo all-gathers it): counted as the bytes of its indices and rows
        size = (buffer._values().nbytes + buffer._indices().nbytes) if buffer.is_sparse else buffer.numel() * buffer.element_size()
        state.meter.add("grad_all_reduce", all_reduce_bytes(size, world_size))
    # The process group's own call (DDP's built-in reduction makes the same one): dist.all_reduce's Python checks
    # and logging wrapper cost more than the rest of this hook on a small model.
    fut = group.allreduce([buffer]).get_future()
    return handed_then(fut, lambda f: f.value()[0])


def periodic_allreduce_hook(state: AllReduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket while ``state.allreduce`` is set; otherwise return the local gradient."""
    if state.allreduce:
        return allreduce_hook(state, bucket)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut
