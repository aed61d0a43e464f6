"""Surgery on the user's LightningModule for a pipeline: keep one stage's layers, call the rest remotely.

* :class:`StageSplit` cuts the module's ``nn.Sequential`` network (see
  :mod:`lightning_pdist.pipeline.partition`) and keeps only this stage's layers: the others
  move to the ``meta`` device (no memory) behind :class:`OnAnotherStage` placeholders, so the module's
  parameter names, ``state_dict`` keys and ``configure_optimizers`` see exactly this stage's part.
  :meth:`StageSplit.restore` puts every layer back (after ``fit``, every rank holds the whole model).
* :meth:`StageSplit.calling` swaps the network for a :class:`NetworkProxy` while a user hook runs:
  the hook calls ``self.net(x)`` as always and gets what the pipeline computed (the last stage), or
  hands ``x`` over (:class:`NetworkInput`, the first stage's way to learn the network's input).
* :func:`split_batch` cuts a batch into micro-batches along dimension 0.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from lightning_pdist.pipeline.ownership import OwnedStage, StageRefused, check_stages, pack, rebuild, record_calls, split_constants
from lightning_pdist.pipeline.partition import Partition, find_network, layer_times, list_layers, partition, split_by_names
from lightning_pdist.pipeline.split import END, auto_split_points, check_split_points, owners

__all__ = ["NetworkInput", "NetworkProxy", "OnAnotherStage", "OwnedSplit", "StageSplit", "batch_size_of", "make_split",
           "split_batch"]


class NetworkInput(Exception):
    """Raised by the first stage's proxy to hand over the network's input."""

    def __init__(self, value: Any) -> None:
        super().__init__("network input captured")
        self.value = value


class NetworkProxy(nn.Module):
    """Stands in for the network while a user hook runs; calls ``fn`` instead."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self._fn = fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)


class OnAnotherStage(nn.Module):
    """Placeholder for a layer that lives on another pipeline stage."""

    def __init__(self, stage: int) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"this layer runs on pipeline stage {self.stage}; call the network through the pipeline")

    def extra_repr(self) -> str:
        return f"stage={self.stage}"


def batch_size_of(batch: Any) -> int:
    """Leading dimension of the batch's first tensor."""
    sizes: list[int] = []
    apply_to_collection(batch, Tensor, lambda t: sizes.append(t.shape[0]) if t.ndim else None)
    if not sizes:
        raise ValueError("the batch holds no tensor with a batch dimension; a pipeline cuts batches along dimension 0")
    return sizes[0]


def split_batch(batch: Any, n: int) -> list[Any]:
    """``n`` micro-batches: every tensor of the batch's size along dim 0 is cut, the rest is shared."""
    size = batch_size_of(batch)
    return [
        apply_to_collection(batch, Tensor, lambda t, i=i: t.tensor_split(n)[i] if t.ndim and t.shape[0] == size else t)
        for i in range(n)
    ]


class StageSplit:
    """One stage's view of the module: which layers it runs, and how to call the rest."""

    def __init__(self, module: nn.Module, num_stages: int, stage: int, network: str | None = None,
                 balance: str | None = None, split_points: list[str] | None = None,
                 example_input: Any = None, agree: Callable[[Partition], Partition] | None = None) -> None:  # fmt: skip
        self.module, self.stage, self.num_stages = module, stage, num_stages
        self.path, net = find_network(module, network)
        self.layers = list_layers(net, self.path)
        self.full_keys = list(module.state_dict().keys())
        if split_points is not None:
            self.partition = split_by_names(self.layers, list(split_points))
        elif balance == "time":
            self.partition = partition(self.layers, num_stages, layer_times(self.layers, _network_input(module, self.path, example_input)))
        else:
            self.partition = partition(self.layers, num_stages)
        if agree is not None:  # e.g. every rank takes rank 0's timing-based cut
            self.partition = agree(self.partition)
        self._check_shared_parameters()
        a, b = self.partition.bounds[stage]
        self.stage_module = nn.Sequential(*[layer for _, layer in self.layers[a:b]])
        self._removed: list[tuple[nn.Module, str, nn.Module]] = []
        for s, (lo, hi) in enumerate(self.partition.bounds):
            if s == stage:
                continue
            for name, layer in self.layers[lo:hi]:
                parent_name, _, child = name.rpartition(".")
                parent = module.get_submodule(parent_name)
                self._removed.append((parent, child, layer.to("meta")))
                parent._modules[child] = OnAnotherStage(s)

    def _check_shared_parameters(self) -> None:
        owner: dict[int, int] = {}
        for s, (a, b) in enumerate(self.partition.bounds):
            for name, layer in self.layers[a:b]:
                for p in layer.parameters():
                    if owner.setdefault(id(p), s) != s:
                        raise ValueError(
                            f"{name} shares a parameter with a layer of stage {owner[id(p)]}; tied weights across stages are "
                            "not supported (keep tied layers in one stage with split_points)"
                        )

    @property
    def parent_and_attr(self) -> tuple[nn.Module, str]:
        parent_name, _, attr = self.path.rpartition(".")
        return self.module.get_submodule(parent_name), attr

    @contextmanager
    def calling(self, fn: Callable[..., Any]) -> Iterator[list[int]]:
        """While active, the module's network is ``NetworkProxy(fn)``; yields a one-item call counter."""
        parent, attr = self.parent_and_attr
        original, calls = parent._modules[attr], [0]

        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] > 1:
                raise RuntimeError(
                    f"{type(self.module).__name__} called its network {self.path!r} twice in one step; under a pipeline "
                    "each training/validation step must call it exactly once"
                )
            return fn(*args, **kwargs)

        parent._modules[attr] = NetworkProxy(counted)
        try:
            yield calls
        finally:
            parent._modules[attr] = original

    ready = True  # cut at construction

    def local_state(self) -> dict[str, Tensor]:
        """This stage's part of the module's ``state_dict`` (the layers of other stages are not in it)."""
        return {k: v.detach().cpu() for k, v in self.module.state_dict().items()}

    def needs_call(self, is_first: bool, is_last: bool) -> bool:
        """Whether this stage needs the network's call (the first stage feeds it to the pipeline)."""
        return is_first and not is_last

    def microbatch_inputs(self, call: tuple[tuple, dict], n: int, hook: str, batch_size: int, first_key: int) -> tuple[Tensor, ...]:
        """The network's input cut into ``n`` micro-batches (one tensor with the batch along dimension 0)."""
        args, kwargs = call
        x = args[0] if args else next(iter(kwargs.values()), None)
        if not isinstance(x, Tensor) or x.ndim == 0 or x.shape[0] != batch_size or len(args) + len(kwargs) != 1:
            raise RuntimeError(f"PipelineStrategy: {hook} fed the network a {type(x).__name__} "
                               f"{tuple(getattr(x, 'shape', ()))}; the pipeline needs one tensor with the batch's "
                               f"{batch_size} samples along dimension 0")  # fmt: skip
        return x.tensor_split(n)

    def stage_input(self, args: tuple, kwargs: dict) -> Any:
        """What a one-stage pipeline's executor feeds its stage when the user's hook calls the network."""
        return args[0] if args else next(iter(kwargs.values()), None)

    def join_outputs(self, outputs: list[Any]) -> Any:
        return torch.cat(outputs)

    def restore(self, state: dict[str, Tensor], device: torch.device) -> None:
        """Put every layer back, weights from ``state`` (the whole model's ``state_dict``; what it lacks is NaN)."""
        for parent, child, layer in self._removed:
            parent._modules[child] = layer.to_empty(device=device)
            with torch.no_grad():
                for t in (*layer.parameters(), *layer.buffers()):
                    if t.is_floating_point():
                        t.fill_(float("nan"))
        self._removed = []
        self.module.load_state_dict(state, strict=False)


def _network_input(module: nn.Module, path: str, example_input: Any) -> Any:
    """The network's input for ``module(example_input)`` (``balance='time'`` profiles on it)."""
    if example_input is None:
        raise ValueError(
            f"balance='time' times each layer on the module's example_input_array; set it on {type(module).__name__} "
            "(e.g. self.example_input_array = torch.zeros(32, 1, 8, 8)) or use balance='parameters'"
        )
    parent_name, _, attr = path.rpartition(".")
    parent = module.get_submodule(parent_name)
    original = parent._modules[attr]

    def capture(x: Any, *_: Any, **__: Any) -> Any:
        raise NetworkInput(x)

    parent._modules[attr] = NetworkProxy(capture)
    try:
        with torch.no_grad():
            module(*example_input) if isinstance(example_input, tuple) else module(example_input)
    except NetworkInput as captured:
        return captured.value
    finally:
        parent._modules[attr] = original
    raise ValueError(f"{type(module).__name__}.forward(example_input_array) never called its network {path!r}")


def make_split(module: nn.Module, num_stages: int, stage: int, network: str | None = None, balance: str | None = None,
               split_points: list[str] | None = None, example_input: Any = None,
               agree: Callable[[Partition], Partition] | None = None) -> StageSplit | OwnedSplit:  # fmt: skip
    """A :class:`StageSplit` where one ``nn.Sequential`` holds the network (or ``network=`` names one), else an
    :class:`OwnedSplit` of the smallest submodule holding every trainable parameter, cut at its first batch."""
    if network is None:
        try:
            find_network(module)
        except ValueError as err:
            if balance == "time":
                raise ValueError(f"balance='time' times the layers of one nn.Sequential, and {err}") from None
            split = OwnedSplit(module, num_stages, stage, split_points)
            split.reason = str(err)
            if not split.path and type(module).forward is LightningModule.forward:
                raise ValueError(f"{err}; and {type(module).__name__} has no forward, so no one submodule its steps "
                                 "call holds every trainable parameter (the pipeline cuts that submodule)") from None
            return split
    return StageSplit(module, num_stages, stage, network, balance, split_points, example_input, agree)


def _smallest_holder(module: nn.Module) -> tuple[str, nn.Module]:
    everything = {id(p) for p in module.parameters() if p.requires_grad}
    if not everything:
        raise ValueError(f"{type(module).__name__} has no trainable parameters: nothing to pipeline")
    holding = [(name, sub) for name, sub in module.named_modules() if {id(p) for p in sub.parameters()} >= everything]
    return max(holding, key=lambda item: item[0].count(".") + bool(item[0]))  # the deepest (they nest)


class OwnedSplit:
    """Any module (see :mod:`lightning_pdist.pipeline.ownership`): the *network* is the smallest submodule
    holding every trainable parameter; it is cut at its first batch (:meth:`plan`), where one real call
    gives the forward's order of submodule calls. Until then every rank holds the whole module, so the
    optimizer is built over all of it; afterwards the modules of other stages hold ``meta`` stand-ins
    and the optimizer's copies of their parameters are emptied (they never get a gradient).
    """

    ready = False
    reason = ""  # why the nn.Sequential path did not apply (said again if the hooks never call the network)

    def __init__(self, module: nn.Module, num_stages: int, stage: int, split_points: list[str] | None) -> None:
        self.module, self.num_stages, self.stage = module, num_stages, stage
        self.path, self.network = _smallest_holder(module)
        self.split_points = split_points
        self.full_keys = list(module.state_dict().keys())
        self.partition: Partition | None = None
        self.stage_module: OwnedStage | None = None
        self._foreign: set[str] = set()
        self._removed: list[tuple[nn.Module, str, str, Tensor, tuple]] = []
        self._call_spec: Any = None
        known = {n for n, _ in self.network.named_modules() if n}
        for point in split_points or ():
            if point != END and self._relative(point) not in known:
                near = sorted(known, key=lambda n: (n.rsplit(".", 1)[-1] != point.rsplit(".", 1)[-1], n.count("."), n))[:3]
                raise ValueError(f"PipelineStrategy(split_points=[..., {point!r}, ...]): {point!r} is not a submodule of "
                                 f"{self.path or type(module).__name__} (split points name submodules in execution order, "
                                 f"e.g. {', '.join(map(repr, near))})")  # fmt: skip

    # ------------------------------------------------------------------ the network slot
    def _invoke(self, *args: Any, **kwargs: Any) -> Any:
        """Call the network itself (while a hook runs, its slot holds a proxy)."""
        if self.path:
            return self.network(*args, **kwargs)
        return type(self.network).forward(self.network, *args, **kwargs)

    @contextmanager
    def calling(self, fn: Callable[..., Any]) -> Iterator[list[int]]:
        """While active, calls of the network go to ``fn``; yields a one-item call counter."""
        calls = [0]
        label = self.path or f"{type(self.module).__name__}.forward"

        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] > 1:
                raise RuntimeError(f"{type(self.module).__name__} called its network {label!r} twice in one step; under "
                                   "a pipeline each training/validation step must call it exactly once")  # fmt: skip
            return fn(*args, **kwargs)

        if not self.path:
            self.module.forward = counted  # instance attribute: self(...) reaches it
            try:
                yield calls
            finally:
                del self.module.forward
            return
        parent_name, _, attr = self.path.rpartition(".")
        parent = self.module.get_submodule(parent_name)
        original = parent._modules[attr]
        parent._modules[attr] = NetworkProxy(counted)
        try:
            yield calls
        finally:
            parent._modules[attr] = original

    # ------------------------------------------------------------------ the cut
    def _relative(self, point: str) -> str:
        prefix = self.path + "." if self.path else ""
        return point[len(prefix):] if prefix and point.startswith(prefix) else point

    def plan(self, call: tuple[tuple, dict]) -> None:
        """Cut the network, given its call on one micro-batch (the same on every rank of a replica's stages)."""
        net, label = self.network, self.path or type(self.module).__name__
        args, kwargs = call
        was_training = net.training
        net.eval()  # the check compares outputs: no dropout; BatchNorm reads its running statistics
        try:
            with torch.no_grad():
                trace, expected = record_calls(net, lambda: self._invoke(*args, **kwargs))
            trace.insert(0, "")  # the network itself, entered first (its own weights: stage 0)
            modules = [n for n, _ in net.named_modules() if n]
            holders = {n: [id(t) for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))]
                       for n, m in net.named_modules()}  # fmt: skip
            holders = {n: ids for n, ids in holders.items() if ids}
            if self.split_points is not None:
                points = [self._relative(p) for p in self.split_points]
                positions = check_split_points(points, trace, modules, label)
                self._check(trace, positions, holders, call, expected, user=True)
            else:
                positions = self._auto(trace, holders, call, expected)
        finally:
            net.train(was_training)
        self._cut(trace, positions, holders, call, expected)

    def _auto(self, trace: list[str], holders: dict, call: tuple, expected: Any) -> list[int]:
        net, K = self.network, self.num_stages
        counts = {n: trace.count(n) for n in trace}
        params = {n: sum(p.numel() for p in m.parameters(recurse=False) if p.requires_grad) for n, m in net.named_modules()}
        weights, seen = [], set()
        for name in trace:
            weights.append(float(params.get(name, 0)) if name not in seen else 0.0)
            seen.add(name)
        kinds = dict(net.named_modules())
        candidates = [i for i, n in enumerate(trace) if counts[n] == 1 and params_below(kinds[n])
                      and ("." not in n or isinstance(kinds[n.rpartition(".")[0]], (nn.ModuleList, nn.Sequential)))]  # fmt: skip
        excluded: set[int] = set()
        while True:
            positions = auto_split_points(K, weights, candidates, frozenset(excluded))
            try:
                self._check(trace, positions, holders, call, expected, user=False)
                return positions
            except StageRefused as err:
                blame = positions[err.stage - 1] if getattr(err, "stage", 0) else None
                if blame is None or blame >= len(trace) or blame in excluded:
                    raise
                excluded.add(blame)

    def _check(self, trace: list[str], positions: list[int], holders: dict, call: tuple, expected: Any, user: bool) -> None:
        names = [trace[p] if p < len(trace) else END for p in positions]
        placement = owners(trace, positions, holders)
        try:
            check_stages(self.network, self._invoke, call, names, placement, expected)
        except StageRefused as err:
            if user:
                raise ValueError(f"PipelineStrategy(split_points={list(self.split_points)!r}): {err}") from err
            raise

    def _cut(self, trace: list[str], positions: list[int], holders: dict, call: tuple, expected: Any) -> None:
        net, prefix = self.network, (self.path + "." if self.path else "")
        names = [trace[p] if p < len(trace) else END for p in positions]
        placement = owners(trace, positions, holders)
        _, spec, constants = split_constants(call)
        _, out_spec, out_constants = split_constants(expected)
        self._call_spec = (spec, [c for c in constants])
        mine = [n for n, s in placement.items() if s == self.stage]
        self.stage_module = OwnedStage(net, names, self.stage, mine, spec, constants, (out_spec, out_constants), self._invoke)
        bounds = tuple(zip([0, *positions], [*positions, len(trace)]))
        counts = [0.0] * self.num_stages
        for n, s in placement.items():
            counts[s] += sum(p.numel() for p in (net.get_submodule(n) if n else net).parameters(recurse=False))
        self.partition = Partition(tuple(f"{prefix}{n}" if n != END else END for n in names), bounds, tuple(counts))
        for n, s in placement.items():
            if s == self.stage:
                continue
            m = net.get_submodule(n) if n else net
            for kind in ("_parameters", "_buffers"):
                for key, t in list(getattr(m, kind).items()):
                    if t is None:
                        continue
                    self._foreign.add(f"{prefix}{n + '.' if n else ''}{key}")
                    self._removed.append((m, kind, key, t, tuple(t.shape)))
                    meta = t.detach().to("meta")
                    getattr(m, kind)[key] = nn.Parameter(meta, requires_grad=t.requires_grad) if kind == "_parameters" else meta
                    if kind == "_parameters":
                        t.data = torch.empty(0, dtype=t.dtype, device=t.device)  # the optimizer's reference holds nothing
        self.ready = True

    def __str__(self) -> str:
        return "; ".join(f"stage {s}: from {n}" for s, n in enumerate(["the start", *self.partition.names]))

    # ------------------------------------------------------------------ per step
    def needs_call(self, is_first: bool, is_last: bool) -> bool:
        return self.num_stages > 1  # every stage runs the forward on its micro-batches' calls

    def microbatch_inputs(self, call: tuple[tuple, dict], n: int, hook: str, batch_size: int, first_key: int) -> list[Tensor]:
        """Every micro-batch's network call (tensors with the batch along dimension 0 are cut): kept by the stage
        under keys ``first_key + j``, and packed (what the first stage feeds the pipeline)."""
        leaves, spec, constants = split_constants(call)
        if self._call_spec is not None and (spec, constants) != self._call_spec:
            raise RuntimeError(f"PipelineStrategy: {hook} calls the network {self.path!r} with arguments of another "
                               f"structure than at its first batch ({spec} vs {self._call_spec[0]}); the stages rebuild "
                               "the call from that structure")  # fmt: skip
        cut = [t.tensor_split(n) if t.ndim and t.shape[0] == batch_size else [t] * n for t in leaves]
        packed = []
        for j in range(n):
            mine = [c[j] for c in cut]
            self.stage_module.calls[first_key + j] = rebuild(spec, constants, mine)
            packed.append(pack(first_key + j, mine))
        return packed

    def stage_input(self, args: tuple, kwargs: dict) -> Tensor:
        leaves, _, _ = split_constants((args, kwargs))
        return pack(0, leaves)

    def join_outputs(self, outputs: list[Any]) -> Any:
        """The micro-batches' network outputs as one (tensors concatenated along dimension 0)."""
        flat = [split_constants(o) for o in outputs]
        leaves = [torch.cat(ts) if ts[0].ndim else ts[0] for ts in zip(*(f[0] for f in flat))]
        return rebuild(flat[0][1], flat[0][2], leaves)

    def local_state(self) -> dict[str, Tensor]:
        return {k: v.detach().cpu() for k, v in self.module.state_dict().items() if k not in self._foreign}

    def restore(self, state: dict[str, Tensor], device: torch.device) -> None:
        """Put every stage's weights back (from ``state``, the whole model's ``state_dict``; parameters it lacks are
        NaN, e.g. after a failed fit, where a rank never held the other stages' weights)."""
        for m, kind, key, t, shape in self._removed:
            if kind == "_parameters":
                t.data = torch.full(shape, float("nan"), dtype=t.dtype, device=device)
            getattr(m, kind)[key] = t
        self._removed, self._foreign, self.ready = [], set(), False
        self.module.load_state_dict(state, strict=False)


def params_below(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())
