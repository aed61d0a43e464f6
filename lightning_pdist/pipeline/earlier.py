"""The earlier stages' modules skipped: their meta outputs recorded once per input signature, then replayed.

A stage after the first runs the network's forward from its start (:mod:`.ownership`), the earlier stages' modules on
``meta`` weights. That computes nothing, but every op still goes through the stage's ``__torch_function__`` and
torch's Python meta implementations (``torch._refs``/``_prims``): on the benchmark's BERT cut at its second block,
as long as the stage's own real work. What such a run yields before the split point is shapes, dtypes and the
Python path taken, which follow from the call's input shapes, not from its values. So:

* the first forward with a given :func:`signature` (the call's tensor shapes, dtypes and devices, grad and inference
  mode, autocast, every module's training flag) runs as before and *records* (:class:`Recorder`): a module call that
  returns before the split point is entered, whose tensor outputs are all ``meta`` (none of them one of its own
  inputs) and whose other outputs are plain constants, is a candidate; the outermost candidates are kept, per module
  in call order, with their outputs' layout (:class:`Output`: tree, constants, each tensor's shape, stride, dtype,
  ``requires_grad``, and which leaves are the same tensor);
* a later forward with the same signature *replays* (:class:`Replay`): until the stage reaches its split point, each
  kept module's ``forward`` returns fresh meta tensors of the recorded layout instead of running (after it, the
  module runs as itself). The code between module calls, and every module that returned a real tensor (masks,
  positions built from the inputs), still runs, so the split point's inputs are found as before;
* nothing is taken on trust: the boundary's shapes are still checked at the split point, and a replay that meets a
  kept module more often than recorded, reaches the split point with a kept call not made, or is refused, is thrown
  away (the random stream rewound) and the forward runs again unskipped; that signature is never replayed again.

The one assumption: a module whose outputs are all ``meta`` gets their shapes from its inputs' shapes (a meta run
cannot read values anyway; one that reads an input's values to size its output is caught by the shape check when
that shape reaches the split point). :data:`MAX_SIGNATURES` bounds the recordings (the last short batch of an epoch,
evaluation without grad: each its own).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from contextlib import ExitStack
from functools import partial
from itertools import count
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["MAX_SIGNATURES", "Output", "Recorder", "Replay", "Stale", "Signatures", "signature"]

MAX_SIGNATURES = 8
_CONSTANTS = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.Size)  # leaves a replay may share


class Stale(Exception):
    """A replay met another Python path than its recording did."""


def signature(network: nn.Module, call: Any) -> tuple:
    """What the earlier stages' output shapes may depend on besides the code."""
    leaves = [t for t in tree_flatten(call)[0] if isinstance(t, Tensor)]
    device = leaves[0].device.type if leaves else "cpu"
    return (tuple((tuple(t.shape), t.dtype, t.device) for t in leaves), torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(), torch.is_autocast_enabled(device), torch.get_autocast_dtype(device),
            tuple(m.training for m in network.modules()))  # fmt: skip


class Output:
    """One module call's output as a layout: ``fresh()`` rebuilds it from new meta tensors."""

    def __init__(self, out: Any) -> None:
        flat, self.spec = tree_flatten(out)
        self.leaves: list[tuple[str, Any]] = []
        first: dict[int, int] = {}
        for x in flat:
            if isinstance(x, Tensor):
                if id(x) in first:
                    self.leaves.append(("same", first[id(x)]))
                else:
                    first[id(x)] = len(self.leaves)
                    self.leaves.append(("tensor", (tuple(x.shape), x.stride(), x.dtype, x.requires_grad)))
            else:
                self.leaves.append(("constant", x))

    @staticmethod
    def fits(out: Any, inputs: set[int]) -> bool:
        """Whether ``out`` can be replayed: tensors all meta (at least one, none an input), the rest constants."""
        flat = tree_flatten(out)[0]
        tensors = [x for x in flat if isinstance(x, Tensor)]
        return (bool(tensors) and all(t.is_meta and id(t) not in inputs for t in tensors)
                and all(isinstance(x, (Tensor, *_CONSTANTS)) for x in flat))  # fmt: skip

    def fresh(self) -> Any:
        made: list[Any] = []
        with torch._C.DisableTorchFunction():  # not the stage's mode: it would move a meta device to the real one
            for kind, value in self.leaves:
                if kind == "tensor":
                    shape, stride, dtype, grad = value
                    t = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
                    made.append(t.requires_grad_().clone() if grad else t)  # not a leaf: in-place ops stay allowed
                else:
                    made.append(made[value] if kind == "same" else value)
        return tree_unflatten(made, self.spec)


class Recorder:
    """Hooks on every submodule while a stage's forward runs: the outermost replayable calls before the split point."""

    def __init__(self, network: nn.Module) -> None:
        self.network, self.state = network, {"active": True}
        self.stack: list[tuple[int, str]] = []
        self.count = count()
        self.calls: list[tuple[int, str, tuple[int, ...], Output | None]] = []

    def install(self, stack: ExitStack, state: dict) -> None:
        self.state = state
        for name, module in self.network.named_modules():
            if name:
                stack.callback(module.register_forward_pre_hook(partial(self._enter, name)).remove)
                stack.callback(module.register_forward_hook(partial(self._exit, name), with_kwargs=True).remove)

    def at_split_point(self) -> None:
        pass

    def _enter(self, name: str, module: nn.Module, args: tuple) -> None:
        if not self.state["active"]:
            self.stack.append((next(self.count), name))

    def _exit(self, name: str, module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        if self.state["active"] or not self.stack or self.stack[-1][1] != name:
            return
        call, _ = self.stack.pop()
        inputs = {id(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)}
        self.calls.append((call, name, tuple(c for c, _ in self.stack), Output(out) if Output.fits(out, inputs) else None))

    def plan(self) -> dict[str, list[Output]]:
        """Per module name, the outputs of its kept calls in call order."""
        candidates = {call for call, _, _, out in self.calls if out is not None}
        kept: dict[str, list[Output]] = {}
        for call, name, ancestors, out in sorted(self.calls):
            if out is not None and not candidates.intersection(ancestors):
                kept.setdefault(name, []).append(out)
        return kept


class Replay:
    """While installed, the planned modules return their recorded outputs, fresh, until the split point."""

    def __init__(self, network: nn.Module, plan: dict[str, list[Output]]) -> None:
        self.network, self.plan, self.state = network, plan, {"active": True}
        self.pending: dict[str, deque[Output]] = {}

    def install(self, stack: ExitStack, state: dict) -> None:
        self.state, missing = state, object()
        for name, outputs in self.plan.items():
            module = self.network.get_submodule(name)
            own = module.__dict__.get("forward", missing)
            original = module.forward
            self.pending[name] = queue = deque(outputs)
            module.forward = partial(self._stub, name, queue, original)
            stack.callback(partial(delattr, module, "forward") if own is missing else partial(setattr, module, "forward", own))

    def _stub(self, name: str, queue: deque[Output], original: Any, *args: Any, **kwargs: Any) -> Any:
        if self.state["active"]:
            return original(*args, **kwargs)
        if not queue:
            raise Stale(f"{name} is called more often before the split point than when recorded")
        return queue.popleft().fresh()

    def at_split_point(self) -> None:
        left = [name for name, queue in self.pending.items() if queue]
        if left:
            raise Stale(f"{left[0]} is called less often before the split point than when recorded")


class Signatures:
    """A stage's recordings: signature -> plan (``None``: a replay failed, run unskipped), the oldest dropped first."""

    def __init__(self) -> None:
        self.plans: OrderedDict[tuple, dict[str, list[Output]] | None] = OrderedDict()
        self.recorded = self.replayed = self.failed = 0  # forwards that recorded, replayed, had their replay thrown away

    def get(self, key: tuple) -> Any:
        return self.plans.get(key, Signatures)  # the class itself: never seen

    def keep(self, key: tuple, plan: dict[str, list[Output]] | None) -> None:
        self.plans[key] = plan
        self.plans.move_to_end(key)
        while len(self.plans) > MAX_SIGNATURES:
            self.plans.popitem(last=False)
