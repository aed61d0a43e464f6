"""Running one pipeline stage of any module: the module's own forward, with other stages' work skipped.

Every stage runs the network's Python ``forward`` as written (control flow, loops, keyword
arguments, ``transformers`` model outputs: nothing is traced into a graph), on the network call of
the micro-batch (every stage of a replica reads the same batch, so each captures the call itself).
What differs per stage is which modules hold real weights (:func:`split.owners`): the others hold
``meta`` tensors, so the work before this stage's first split point runs on shapes only (an op
mixing meta and real tensors runs on meta: no compute, no memory), while what depends only on the
inputs (masks, positions) is computed for real. Then

* entering the split point that starts stage ``s``, its call's tensors (positional and keyword) are
  replaced by the real ones received from stage ``s - 1`` (the *boundary*); their meta stand-ins map
  to them for every later use (a residual ``h + block(h)``, a mask handed to every later block), and
  the substitution happens above autograd, so gradients reach the boundary along every path;
* entering the split point that starts stage ``s + 1``, its call's tensors are this stage's output,
  and the forward stops there (:class:`_StageDone`); after the last split point the network's output
  is the output.

A value computed from earlier stages' weights that reaches a later stage by any other path (a skip
connection around the split point, a weight used outside its module) is refused, naming the split
point. :func:`check_stages` runs all stages in one process at split time against the whole network
on one batch, so a cut that cannot run, or computes something else, is refused before training.

Between stages the boundary travels as one 1-D float tensor (:func:`pack`): a header with the
micro-batch's key and the values' shapes and dtypes, then the values. Its dtype is float32 when that
holds every number exactly (values of fp32/bf16/fp16/bool/int8/uint8/int16, header entries below
2^24: a fp32 activation then travels as itself, no conversion, half float64's bytes), else float64
(which holds integers below 2^53 exactly); gradients flow through the float parts. The header marks which
values carry a gradient (computed from some stage's weights: a hidden state, not a mask or positions
built from the inputs); the receiver detaches the others, so their gradient is zero on every later
stage, and :func:`gradient_parts` names the marked ones (what a synthetic-gradient module predicts).
"""

from __future__ import annotations

import math
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_pdist.pipeline.earlier import Recorder, Replay, Signatures, Stale, signature
from lightning_pdist.pipeline.split import END

__all__ = ["OwnedStage", "StageRefused", "check_stages", "gradient_parts", "pack", "rebuild", "record_calls",
           "split_constants", "unpack"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool)  # fmt: skip
_CODE = {d: i for i, d in enumerate(_DTYPES)}
_GRAD = 64  # added to a value's dtype code in the header: the value carries a gradient
# dtypes whose every value float32 holds exactly; a header entry must be below 2^24 (float32's 24-bit significand)
_EXACT32 = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.bool, torch.int8, torch.uint8, torch.int16})
_LIMIT32 = float(1 << 24)


def tensor_leaves(tree: Any) -> tuple[list[Any], Any]:
    return tree_flatten(tree)


def record_calls(network: nn.Module, call: Callable[[], Any]) -> tuple[list[str], Any]:
    """``call()`` with every submodule's entry recorded: (names in pre-order, the output)."""
    trace: list[str] = []
    handles = [m.register_forward_pre_hook(lambda mod, args, name=name: trace.append(name))
               for name, m in network.named_modules(remove_duplicate=False) if name]  # fmt: skip
    try:
        out = call()
    finally:
        for h in handles:
            h.remove()
    return trace, out


def pack(key: int, values: Sequence[Tensor]) -> Tensor:
    """One float vector ``[header length, key, #values, (dtype, ndim, *shape)..., values...]`` (the values' float
    parts keep their autograd history). ``key`` names the micro-batch, whose network call each stage holds. The
    vector is float32 when every value's dtype and every header entry (``|x| < 2^24``) is exact in float32, else
    float64: each value arrives bit-identical either way.

    A float value's dtype code carries ``+_GRAD`` when it carries a gradient: it requires grad, or grad mode is off
    (a forward without a graph, e.g. features replay's first one, cannot tell, so it marks every float value)."""
    head: list[float] = [0.0, float(key), float(len(values))]
    unknown = not torch.is_grad_enabled()
    for v in values:
        if v.dtype not in _CODE:
            raise ValueError(f"a pipeline boundary cannot carry a {v.dtype} tensor")
        grad = v.is_floating_point() and (v.requires_grad or unknown)
        head += [float(_CODE[v.dtype] + (_GRAD if grad else 0)), float(v.ndim), *map(float, v.shape)]
    head[0] = float(len(head))
    device = values[0].device if values else torch.device("cpu")
    exact32 = all(v.dtype in _EXACT32 for v in values) and all(abs(x) < _LIMIT32 for x in head)
    dtype = torch.float32 if exact32 else torch.float64
    parts = [torch.tensor(head, dtype=dtype, device=device)]
    parts += [v.reshape(-1).to(dtype) for v in values]
    return torch.cat(parts)


def _layout(packed: Tensor) -> tuple[int, list[tuple[int, tuple[int, ...], torch.dtype, bool]]]:
    """(key, ``(offset, shape, dtype, carries a gradient)`` of each value) from :func:`pack`'s header."""
    n_head = int(packed[0].item())
    head = packed[:n_head].tolist()
    i, layout, offset = 3, [], n_head
    for _ in range(int(head[2])):
        code, ndim = int(head[i]), int(head[i + 1])
        shape = tuple(int(d) for d in head[i + 2 : i + 2 + ndim])
        i += 2 + ndim
        layout.append((offset, shape, _DTYPES[code % _GRAD], code >= _GRAD))
        offset += math.prod(shape)
    return int(head[1]), layout


def unpack(packed: Tensor) -> tuple[int, list[Tensor]]:
    """(key, values) from :func:`pack`'s vector; values that carry no gradient are detached."""
    key, layout = _layout(packed)
    values = []
    for offset, shape, dtype, grad in layout:
        value = packed[offset : offset + math.prod(shape)].view(shape).to(dtype)
        values.append(value if grad else value.detach())
    return key, values


def gradient_parts(packed: Tensor) -> list[tuple[int, tuple[int, ...]]]:
    """``(offset, shape)`` in :func:`pack`'s vector of each value that carries a gradient (the header, integer values
    and values built from the inputs alone get none)."""
    return [(offset, shape) for offset, shape, _, grad in _layout(packed)[1] if grad]


class _StageDone(Exception):
    def __init__(self, values: list[Tensor]) -> None:
        super().__init__("stage done")
        self.values = values


class StageRefused(ValueError):
    """A cut this machinery cannot run (named split point, reason)."""


_LEAVES = (int, float, bool, str, complex, type(None), slice, type(Ellipsis), torch.dtype, torch.layout, torch.memory_format)


def _plain(values: Any) -> bool:
    """Whether ``values`` (an op's positional arguments or keyword values) are all real tensors, non-meta devices or
    plain scalars: no meta tensor or device, no container that could hold one (pytree nodes of any kind). The mode's
    one check before it flattens anything; most ops after the split point pass it."""
    for v in values:
        if isinstance(v, Tensor):
            if v.is_meta:
                return False
        elif isinstance(v, torch.device):
            if v.type == "meta":
                return False
        elif not isinstance(v, _LEAVES):
            return False
    return True


class _StageMode(TorchFunctionMode):
    """Every torch function call of a stage's forward: a received boundary stands in for its meta twin.

    Before the stage's first split point, an op mixing meta and real tensors runs on meta (the earlier
    stages' work, shapes only). After it, a meta tensor that maps to a received one is replaced by it
    (above autograd, so gradients reach the boundary along every path, residual ones included), and a
    meta tensor mixed with real ones that maps to nothing is a value from before the cut that the cut
    does not carry: refused.
    """

    def __init__(self, mapping: dict[int, Tensor], state: dict, start: str, device: torch.device) -> None:
        super().__init__()
        self.mapping, self.state, self.start, self.device = mapping, state, start, device

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if _plain(args) and _plain(kwargs.values()):  # no meta tensor or device, nothing nested: nothing to replace
            return func(*args, **kwargs)
        flat, spec = tree_flatten((args, kwargs))
        if any(isinstance(t, torch.device) and t.type == "meta" for t in flat):
            # a device read off a meta activation (torch.ones(..., device=h.device), mask.to(h.device)): only the
            # weights are meta here, what the code builds from the inputs stays real
            flat = [self.device if isinstance(t, torch.device) and t.type == "meta" else t for t in flat]
            args, kwargs = tree_unflatten(flat, spec)
        metas = [i for i, t in enumerate(flat) if isinstance(t, Tensor) and t.is_meta]
        if metas:
            if self.state["active"]:
                for i in metas:
                    if id(flat[i]) in self.mapping:
                        flat[i] = self.mapping[id(flat[i])]
            elif getattr(func, "__name__", "") != "__get__":
                self.state["meta_ops"] += 1  # an op of the earlier stages' work, run on meta (reading .shape is none)
            if any(isinstance(t, Tensor) and not t.is_meta and t.ndim for t in flat):
                if any(isinstance(t, Tensor) and t.is_meta for t in flat):
                    if self.state["active"]:
                        raise StageRefused(f"{getattr(func, '__name__', func)} after split point {self.start!r} uses a "
                                           f"value computed before it that is not among {self.start!r}'s inputs (a "
                                           "connection around the cut); choose another split point")  # fmt: skip
                    flat = [t.to("meta") if isinstance(t, Tensor) and not t.is_meta and t.ndim else t for t in flat]
            args, kwargs = tree_unflatten(flat, spec)
        return func(*args, **kwargs)


class OwnedStage(nn.Module):
    """Stage ``stage`` of ``network`` cut at ``boundaries`` (module names in execution order, or ``END``).

    ``forward(packed)`` takes :func:`pack`'s vector (stage 0: the network call's tensors; later stages: the
    previous stage's boundary) and returns the next boundary packed, or on the last stage the network's output.
    Its ``named_parameters`` are this stage's weights only (named through ``net.``), so an executor's
    ``functional_call`` swaps exactly them.
    """

    def __init__(self, network: nn.Module, boundaries: Sequence[str], stage: int, owned: Sequence[str],
                 call_spec: Any, call_constants: list[Any], output_spec: Any = None,
                 invoke: Callable[..., Any] | None = None) -> None:  # fmt: skip
        super().__init__()
        self.net = network
        self.boundaries, self.stage = list(boundaries), stage
        self.owned = [network.get_submodule(n) if n else network for n in owned]
        self.call_spec, self.call_constants, self.output_spec = call_spec, call_constants, output_spec
        self.invoke = invoke or network
        self.start = boundaries[stage - 1] if stage > 0 else None
        self.stop = boundaries[stage] if stage < len(boundaries) else None
        # key -> the network call of that micro-batch (every stage of a replica reads the same batch): stages after
        # the first run the forward before their split point on it, the earlier stages' weights being meta
        self.calls: dict[int, tuple[tuple, dict]] = {}
        self.signatures = Signatures()  # the earlier stages' module outputs, recorded per input signature
        self.meta_ops = 0

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:  # noqa: E501
        mine = {id(p) for m in self.owned for p in m.parameters(recurse=False)}
        for name, p in self.net.named_parameters(prefix="net"):
            if id(p) in mine:
                yield (f"{prefix}.{name}" if prefix else name), p

    def _call(self, leaves: list[Tensor]) -> tuple[tuple, dict]:
        return rebuild(self.call_spec, self.call_constants, leaves)

    def forward(self, packed: Tensor) -> Any:
        key, values = unpack(packed)
        call = self.calls.pop(key, None)
        if self.start == END:  # nothing of the network left: the output itself arrived
            if self.stop is not None:
                return pack(key, [v * 1 for v in values])
            return self._output(values)
        if self.stage == 0:
            call, boundary = self._call(values), None
        elif call is None:
            raise RuntimeError(f"pipeline stage {self.stage}: no network call recorded for micro-batch {key}")
        else:
            boundary = values
        out = self._run(call, boundary)
        if isinstance(out, _StageDone):
            return pack(key, out.values)
        if self.stop == END:
            leaves, _ = tree_flatten(out)
            return pack(key, [t for t in leaves if isinstance(t, Tensor)])
        return out

    def _run(self, call: tuple[tuple, dict], boundary: list[Tensor] | None) -> Any:
        """:func:`run_stage` (its :class:`_StageDone` returned, not raised), the earlier stages' modules replayed
        from the recording of this call's signature (:mod:`.earlier`)."""
        if self.start is None:
            return self._run_with(call, boundary, None)
        key, signatures = signature(self.net, call), self.signatures
        plan = signatures.get(key)
        if isinstance(plan, dict):
            rng = torch.get_rng_state()
            try:
                out = self._run_with(call, boundary, Replay(self.net, plan))
            except (Stale, StageRefused):
                torch.set_rng_state(rng)  # a refused replay may have drawn dropout masks after the split point
                signatures.failed += 1
                plan = None
                signatures.keep(key, plan)  # never replayed again: this signature runs every module on meta
            else:
                signatures.replayed += 1
                return out
        recorder = Recorder(self.net) if plan is Signatures else None  # never seen (None: its replay failed once)
        out = self._run_with(call, boundary, recorder)
        if recorder is not None:
            signatures.recorded += 1
            signatures.keep(key, recorder.plan())
        return out

    def _run_with(self, call: tuple[tuple, dict], boundary: list[Tensor] | None, earlier: Recorder | Replay | None) -> Any:
        counts = {"meta_ops": 0}
        try:
            return run_stage(self.net, self.invoke, call, self.start, self.stop, boundary, earlier, counts)
        except _StageDone as done:
            return done  # the forward reached its stop: the split point's inputs, this stage's normal end
        finally:
            self.meta_ops = counts["meta_ops"]  # ops this forward ran on meta before its split point

    def _output(self, values: list[Tensor]) -> Any:
        return rebuild(*self.output_spec, values)


class _Tensor:
    def __repr__(self) -> str:
        return "<tensor>"


_TENSOR = _Tensor()  # marks a tensor leaf in a call's or output's constants


def rebuild(spec: Any, constants: list[Any], tensors: Sequence[Tensor]) -> Any:
    """Inverse of :func:`split_constants`."""
    it = iter(tensors)
    return tree_unflatten([next(it) if c is _TENSOR else c for c in constants], spec)


def split_constants(tree: Any) -> tuple[list[Tensor], Any, list[Any]]:
    """(tensor leaves, spec, leaves with tensors replaced by a marker)."""
    flat, spec = tree_flatten(tree)
    return [t for t in flat if isinstance(t, Tensor)], spec, [_TENSOR if isinstance(t, Tensor) else t for t in flat]


def run_stage(network: nn.Module, invoke: Callable[..., Any], call: tuple[tuple, dict], start: str | None,
              stop: str | None, boundary: list[Tensor] | None, earlier: Recorder | Replay | None = None,
              counts: dict | None = None) -> Any:  # fmt: skip
    """The network's forward from entering ``start`` (its inputs: ``boundary``) until entering ``stop``.

    Raises :class:`_StageDone` with ``stop``'s inputs; returns the network's output when ``stop`` is
    ``None`` or ``END``; :class:`StageRefused` when a value from before the cut reaches this stage.
    ``earlier`` records or replays the modules before ``start`` (:mod:`.earlier`); ``counts["meta_ops"]`` counts
    the ops run on meta before ``start``.
    """
    mapping: dict[int, Tensor] = {}
    state = {"active": start is None, "meta_ops": 0}
    where = f"split point {start!r}" if start else "the start"

    def real(tree: Any, who: str) -> Any:
        flat, spec = tree_flatten(tree)
        out = []
        for t in flat:
            if isinstance(t, Tensor) and t.is_meta:
                if id(t) not in mapping:
                    raise StageRefused(f"{who} receives a tensor computed before {where} that is not among "
                                       f"{start!r}'s inputs (a connection around the cut); choose another split point")  # fmt: skip
                t = mapping[id(t)]
            out.append(t)
        return tree_unflatten(out, spec)

    def enter(name: str) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> Any:
            if name == start:
                flat, spec = tree_flatten((args, kwargs))
                slots = [i for i, t in enumerate(flat) if isinstance(t, Tensor)]
                if len(slots) != len(boundary):
                    raise StageRefused(f"split point {start!r} is called with {len(slots)} tensors here and "
                                       f"{len(boundary)} on the previous stage")  # fmt: skip
                for i, v in zip(slots, boundary):
                    if tuple(flat[i].shape) != tuple(v.shape):
                        raise StageRefused(f"split point {start!r}: input shape {tuple(v.shape)} arrived, this stage "
                                           f"computed {tuple(flat[i].shape)}")  # fmt: skip
                    mapping[id(flat[i])] = v
                    flat[i] = v
                if earlier is not None:
                    earlier.at_split_point()
                state["active"] = True
                return tree_unflatten(flat, spec)
            if state["active"] and name == stop:
                args, kwargs = real((args, kwargs), f"split point {stop!r}")
                raise _StageDone([t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)])
            return None

        return hook

    with ExitStack() as stack:
        for name in (start, stop):
            if name not in (None, END):
                module = network.get_submodule(name)
                stack.callback(module.register_forward_pre_hook(enter(name), with_kwargs=True).remove)
        if start is not None:
            device = next((t.device for t in tree_flatten(call)[0] if isinstance(t, Tensor)), torch.device("cpu"))
            stack.enter_context(_StageMode(mapping, state, start, device))
        if earlier is not None:
            earlier.install(stack, state)  # after the split point's hook: a module's hooks run in their order
        args, kwargs = call
        try:
            out = invoke(*args, **kwargs)
        finally:
            if counts is not None:
                counts["meta_ops"] = state["meta_ops"]
    leaves = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor)]
    if any(t.is_meta for t in leaves):
        raise StageRefused(f"the network's output depends on a value computed before {where} that does not pass "
                           f"through {start!r}'s inputs (a connection around the cut); choose another split point")  # fmt: skip
    return out


@contextmanager
def meta_weights(network: nn.Module, modules: Sequence[str]) -> Iterator[None]:
    """While active, the named modules' own parameters and buffers are meta tensors (restored after)."""
    saved = []
    for name in modules:
        m = network.get_submodule(name) if name else network
        for kind in ("_parameters", "_buffers"):
            for key, t in list(getattr(m, kind).items()):
                if t is not None:
                    saved.append((m, kind, key, t))
                    meta = t.detach().to("meta")
                    getattr(m, kind)[key] = nn.Parameter(meta, requires_grad=t.requires_grad) if kind == "_parameters" else meta
    try:
        yield
    finally:
        for m, kind, key, t in saved:
            getattr(m, kind)[key] = t


def check_stages(network: nn.Module, invoke: Callable[..., Any], call: tuple[tuple, dict], boundaries: Sequence[str],
                 placement: dict[str, int], expected: Any) -> None:  # fmt: skip
    """Run every stage in turn in this process (others' weights meta) and compare with ``expected``.

    Raises :class:`StageRefused` naming the split point that the stages cannot run, or the difference.
    """
    leaves, spec, constants = split_constants(call)
    packed = pack(0, leaves)
    out: Any = None
    exp_leaves, out_spec, out_constants = split_constants(expected)
    for s in range(len(boundaries) + 1):
        others = [n for n, st in placement.items() if st != s]
        stage = OwnedStage(network, boundaries, s, [n for n, st in placement.items() if st == s], spec, constants,
                           (out_spec, out_constants), invoke)  # fmt: skip
        stage.calls[0] = call
        try:
            with meta_weights(network, others):
                out = stage(packed)
        except Exception as err:  # noqa: BLE001 - whatever stopped this stage is reported with the split point
            where = f"the stage starting at split point {boundaries[s - 1]!r}" if s else "stage 0"
            refused = StageRefused(f"{where} cannot run on its own ({type(err).__name__}: {err})")
            refused.stage = s
            raise refused from err
        packed = out if s < len(boundaries) else None
    got = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor)]
    if len(got) != len(exp_leaves):
        raise StageRefused(f"the stages return {len(got)} tensors, the network {len(exp_leaves)}")
    for g, e in zip(got, exp_leaves):
        if g.shape != e.shape or not torch.allclose(g.float(), e.float(), rtol=1e-4, atol=1e-5):
            diff = (g.float() - e.float()).abs().max().item() if g.shape == e.shape else f"shape {tuple(g.shape)} vs {tuple(e.shape)}"
            raise StageRefused(f"the stages together do not compute what the network computes (difference {diff}); "
                               "its forward depends on something the cut does not carry")  # fmt: skip
