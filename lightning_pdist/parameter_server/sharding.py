"""Parameter sharding plans for parameter-server training: which server owns which bytes.

Paper 000 (layer-wise vs memory-based sharding; ``seeds-digest.md``) and ``algorithms-reference.md`` A2-A6.
Every plan works on the *flat vector*: all parameters of a model, flattened and concatenated in creation
(registration) order. An element's *offset* counts elements before it; its *byte offset* counts their bytes.

Two strategies:

``layer`` (TensorFlow's ``GreedyLoadBalancingStrategy`` over whole layers)
    Layers (a module's weight and bias together) are taken in creation order; each goes to the server
    with the fewest bytes so far, ties to the lowest index::

        s* = argmin_s load[s];  load[s*] += bytes(layer)

    No server can hold less than the largest layer, so for VGG-16 (``fc6`` = 74.3% of the weights) the
    most loaded server keeps ~106M of 138M parameters however many servers there are (A6).

``memory`` (equal-byte ranges, paper 000's "memory-based" sharding)
    The flat vector is cut into contiguous ranges of ``c = ceil(B / S)`` bytes (rounded up to a whole
    element; with one dtype that is ``ceil(d / S)`` elements), range ``s`` going to server ``s``; the last
    range is shorter. An element belongs to the range that holds its first byte, so a tensor can be split
    between servers. The most loaded server holds ``ceil(d / S)`` elements: loads scale as ``1 / S``.

    With ``partition_bytes=k`` the flat vector is instead cut into ``k``-byte partitions (BytePS uses
    4,096,000 B, :data:`BYTEPS_PARTITION_BYTES`) and partition ``p`` goes to server ``p mod S``, so a
    push or pull of a shard is a sequence of ``k``-byte transfers that can pipeline. Round-robin, not
    least-loaded: all partitions but the last have the same size, so the greedy argmin would visit servers
    in exactly this order anyway, and round-robin lets a worker route partition ``p`` from its index
    alone. Unlike BytePS, which cuts each tensor separately and hashes keys to servers (A3), the cut runs
    over the flat vector, so no partition is a small tensor remainder and loads differ by at most one
    partition.

A plan is a frozen, comparable, printable value (``print(plan)`` shows the per-server table); build it
with :func:`plan_sharding` from :func:`param_specs` of a model (a ``meta``-device model works).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor, nn

__all__ = [
    "BYTEPS_PARTITION_BYTES",
    "SHARDINGS",
    "ParamSlice",
    "ParamSpec",
    "ShardingPlan",
    "param_specs",
    "plan_sharding",
]

SHARDINGS = ("layer", "memory")
BYTEPS_PARTITION_BYTES = 4_096_000  # BytePSGlobal::_partition_bytes default (byteps/common/global.cc)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class ParamSpec:
    """What a sharding plan needs to know about one parameter tensor.

    Attributes:
        name: the parameter's name in ``module.named_parameters()`` (``"classifier.fc6.weight"``).
        numel: number of elements, >= 0.
        element_size: bytes per element (4 for fp32), >= 1.
        layer: name of the module that owns it (``"classifier.fc6"``); ``layer`` sharding keeps the
            parameters of one layer on one server.
    """

    name: str
    numel: int
    element_size: int = 4
    layer: str = ""

    def __post_init__(self) -> None:
        for arg in ("name", "layer"):
            if not isinstance(getattr(self, arg), str):
                raise TypeError(f"ParamSpec({arg}={getattr(self, arg)!r}): {arg} must be a str")
        for arg in ("numel", "element_size"):
            if not _is_int(getattr(self, arg)):
                raise TypeError(f"ParamSpec({arg}={getattr(self, arg)!r}): {arg} must be an int")
        if not self.name:
            raise ValueError("ParamSpec(name=''): name must be non-empty")
        if self.numel < 0:
            raise ValueError(f"ParamSpec(numel={self.numel}): numel must be >= 0")
        if self.element_size < 1:
            raise ValueError(f"ParamSpec(element_size={self.element_size}): element_size must be >= 1")

    @property
    def nbytes(self) -> int:
        """``numel * element_size``."""
        return self.numel * self.element_size


def param_specs(module: nn.Module) -> tuple[ParamSpec, ...]:
    """Descriptors of ``module``'s parameters in creation (registration) order.

    Shared parameters appear once, under their first name (as ``named_parameters`` yields them). Buffers
    are not included: a parameter server trains parameters only. A ``meta``-device module gives the specs
    without allocating the weights.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"param_specs(module={type(module).__name__}): module must be a torch.nn.Module")
    return tuple(
        ParamSpec(name=name, numel=p.numel(), element_size=p.element_size(), layer=name.rpartition(".")[0])
        for name, p in module.named_parameters()
    )


@dataclass(frozen=True)
class ParamSlice:
    """Elements ``[start, stop)`` of parameter ``name`` (its flattened view), owned by ``server``.

    Attributes:
        server: owning server, in ``[0, num_servers)``.
        name: parameter name (a :class:`ParamSpec` name).
        start: first element inside the parameter.
        stop: one past the last element inside the parameter.
        offset: offset of element ``start`` in the flat vector.
        part: index of the transfer unit the slice belongs to: the layer (``layer``), the server's range
            (``memory``), or the partition (``memory`` with ``partition_bytes``).
    """

    server: int
    name: str
    start: int
    stop: int
    offset: int
    part: int

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def flat_range(self) -> tuple[int, int]:
        """``[offset, offset + numel)`` in the flat vector."""
        return self.offset, self.offset + self.numel


@dataclass(frozen=True)
class ShardingPlan:
    """Which server owns which elements of the flat parameter vector; a frozen, comparable value.

    Build it with :func:`plan_sharding`. Construction checks that ``slices`` cover every element of every
    parameter exactly once, in flat order.

    Attributes:
        sharding: ``"layer"`` or ``"memory"``.
        num_servers: ``S``.
        specs: the parameters, in flat order.
        slices: the owned pieces, in flat order (zero-size parameters get one empty slice).
        partition_bytes: partition size of a partitioned ``memory`` plan, else ``None``.
    """

    sharding: str
    num_servers: int
    specs: tuple[ParamSpec, ...]
    slices: tuple[ParamSlice, ...]
    partition_bytes: int | None = None

    def __post_init__(self) -> None:
        _check_arguments("ShardingPlan", self.num_servers, self.sharding, self.partition_bytes)
        object.__setattr__(self, "specs", tuple(self.specs))
        object.__setattr__(self, "slices", tuple(self.slices))
        for arg, items, kind in (("specs", self.specs, ParamSpec), ("slices", self.slices, ParamSlice)):
            bad = next((x for x in items if not isinstance(x, kind)), None)
            if bad is not None:
                raise TypeError(f"ShardingPlan({arg}=[..., {bad!r}, ...]): {arg} must hold {kind.__name__} values")
        names = [s.name for s in self.specs]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"ShardingPlan(specs=...): parameter names must be unique, {dup} repeat")
        # Walk slices and specs together: each spec's slices must run from 0 to numel with no gap.
        pos, flat = 0, 0
        for spec in self.specs:
            start = 0
            while True:
                if pos >= len(self.slices):
                    missing = f"{spec.name}[{start}:{spec.numel}]"
                    raise ValueError(f"ShardingPlan(slices=...): {missing} is owned by no server")
                piece = self.slices[pos]
                if (piece.name, piece.start, piece.offset) != (spec.name, start, flat + start) or not (
                    start <= piece.stop <= spec.numel
                ):
                    raise ValueError(
                        f"ShardingPlan(slices=...): slice {piece} does not continue {spec.name} at element {start} "
                        f"(flat offset {flat + start}); slices must cover each parameter once, in flat order"
                    )
                if not (_is_int(piece.server) and 0 <= piece.server < self.num_servers):
                    raise ValueError(
                        f"ShardingPlan(slices=...): slice {piece} has server outside [0, {self.num_servers})"
                    )
                pos += 1
                start = piece.stop
                if start == spec.numel and (pos == len(self.slices) or self.slices[pos].name != spec.name):
                    break
            flat += spec.numel
        if pos != len(self.slices):
            raise ValueError(f"ShardingPlan(slices=...): slice {self.slices[pos]} is beyond the last parameter")

    # ---- sizes -------------------------------------------------------------------------------------

    @cached_property
    def _byte_offsets(self) -> dict[str, tuple[int, int]]:
        """name -> (flat element offset, flat byte offset) of the parameter's first element."""
        out, elems, nbytes = {}, 0, 0
        for spec in self.specs:
            out[spec.name] = (elems, nbytes)
            elems += spec.numel
            nbytes += spec.nbytes
        return out

    @cached_property
    def _element_size(self) -> dict[str, int]:
        return {s.name: s.element_size for s in self.specs}

    @property
    def numel(self) -> int:
        """``d``, the length of the flat vector."""
        return sum(s.numel for s in self.specs)

    @property
    def nbytes(self) -> int:
        """``B``, the bytes of the flat vector."""
        return sum(s.nbytes for s in self.specs)

    @cached_property
    def numel_per_server(self) -> tuple[int, ...]:
        """Elements owned by each server."""
        out = [0] * self.num_servers
        for piece in self.slices:
            out[piece.server] += piece.numel
        return tuple(out)

    @cached_property
    def bytes_per_server(self) -> tuple[int, ...]:
        """Bytes owned by each server (the load the paper balances)."""
        out = [0] * self.num_servers
        for piece in self.slices:
            out[piece.server] += piece.numel * self._element_size[piece.name]
        return tuple(out)

    @property
    def max_bytes(self) -> int:
        """Bytes of the most loaded server: its push/pull volume bounds a step."""
        return max(self.bytes_per_server)

    @property
    def mean_bytes(self) -> float:
        """``B / S``."""
        return self.nbytes / self.num_servers

    @property
    def imbalance(self) -> float:
        """``max_bytes / mean_bytes`` (1.0 is perfect balance; ``S`` is everything on one server)."""
        return self.max_bytes / self.mean_bytes

    @property
    def max_numel(self) -> int:
        """Elements of the most loaded server (parameters, the unit of ``algorithms-reference.md`` A6)."""
        return max(self.numel_per_server)

    # ---- ownership ---------------------------------------------------------------------------------

    def _check_server(self, server: int, caller: str) -> None:
        if not _is_int(server):
            raise TypeError(f"ShardingPlan.{caller}(server={server!r}): server must be an int")
        if not 0 <= server < self.num_servers:
            raise ValueError(f"ShardingPlan.{caller}(server={server}): server must be in [0, {self.num_servers})")

    def param_slices(self, server: int) -> tuple[ParamSlice, ...]:
        """The ``(name, start, stop)`` pieces ``server`` owns, in flat order."""
        self._check_server(server, "param_slices")
        return tuple(p for p in self.slices if p.server == server and p.numel > 0)

    def server_slices(self, server: int) -> tuple[tuple[int, int], ...]:
        """Flat-vector element ranges ``[start, stop)`` owned by ``server``, in creation order.

        One range per transfer unit (layer, range or partition; see :attr:`ParamSlice.part`); pieces of
        one unit that are adjacent in the flat vector are merged. ``flat[a:b]`` for each range, in order,
        concatenated, is the server's shard (what :meth:`gather` returns).
        """
        return self._merged_ranges(server, "server_slices", lambda piece: piece.flat_range)

    def byte_ranges(self, server: int) -> tuple[tuple[int, int], ...]:
        """Byte ranges ``[start, stop)`` of the flat byte buffer owned by ``server``; as :meth:`server_slices`."""
        return self._merged_ranges(server, "byte_ranges", self._byte_range)

    def _byte_range(self, piece: ParamSlice) -> tuple[int, int]:
        """``piece``'s ``[start, stop)`` in the flat byte buffer."""
        _, byte0 = self._byte_offsets[piece.name]
        size = self._element_size[piece.name]
        return byte0 + piece.start * size, byte0 + piece.stop * size

    def _merged_ranges(
        self, server: int, caller: str, bounds: Callable[[ParamSlice], tuple[int, int]]
    ) -> tuple[tuple[int, int], ...]:
        """``bounds(piece)`` of each piece ``server`` owns, in order; a piece of the previous piece's transfer unit
        that starts where that range stops extends it."""
        self._check_server(server, caller)
        ranges: list[list[int]] = []
        last_part = None
        for piece in self.param_slices(server):
            lo, hi = bounds(piece)
            if ranges and last_part == piece.part and ranges[-1][1] == lo:
                ranges[-1][1] = hi
            else:
                ranges.append([lo, hi])
            last_part = piece.part
        return tuple((lo, hi) for lo, hi in ranges)

    def server_indices(self, server: int) -> Tensor:
        """int64 flat-vector indices owned by ``server``, ascending (8 bytes per owned element)."""
        ranges = self.server_slices(server)
        if not ranges:
            return torch.zeros(0, dtype=torch.int64)
        return torch.cat([torch.arange(lo, hi, dtype=torch.int64) for lo, hi in ranges])

    def owners_of(self, name: str) -> tuple[int, ...]:
        """Servers holding part of parameter ``name``, ascending (one server unless ``memory`` split it)."""
        if name not in self._byte_offsets:
            raise ValueError(
                f"ShardingPlan.owners_of(name={name!r}): name must be one of the plan's {len(self.specs)} parameters"
            )
        return tuple(sorted({p.server for p in self.slices if p.name == name}))

    def owner_of(self, name: str) -> int:
        """The one server that holds all of parameter ``name``; raises if the plan split it."""
        owners = self.owners_of(name)
        if len(owners) != 1:
            raise ValueError(
                f"ShardingPlan.owner_of(name={name!r}): {name} is split across servers {list(owners)}; "
                "owner_of needs a parameter held by one server (use owners_of or param_slices)"
            )
        return owners[0]

    def layers_of(self, server: int) -> tuple[str, ...]:
        """Layers with at least one element on ``server``, in creation order."""
        self._check_server(server, "layers_of")
        layer = {s.name: s.layer for s in self.specs}
        out: list[str] = []
        for piece in self.param_slices(server):
            if layer[piece.name] not in out:
                out.append(layer[piece.name])
        return tuple(out)

    # ---- moving data ---------------------------------------------------------------------------

    def _check_flat(self, flat: Tensor, caller: str) -> None:
        if not isinstance(flat, Tensor):
            raise TypeError(f"ShardingPlan.{caller}(flat={type(flat).__name__}): flat must be a torch.Tensor")
        if flat.dim() != 1 or flat.numel() != self.numel:
            raise ValueError(
                f"ShardingPlan.{caller}(flat={tuple(flat.shape)}): "
                f"flat must be a vector of the plan's {self.numel} elements"
            )

    def gather(self, flat: Tensor, server: int) -> Tensor:
        """``server``'s shard of the flat vector: its ranges of ``flat``, concatenated in order (a copy)."""
        self._check_flat(flat, "gather")
        ranges = self.server_slices(server)
        return torch.cat([flat[lo:hi] for lo, hi in ranges]) if ranges else flat.new_zeros(0)

    @torch.no_grad()
    def scatter_(self, flat: Tensor, server: int, shard: Tensor) -> None:
        """Write ``shard`` (as :meth:`gather` returns it) back into ``server``'s ranges of ``flat``, in place."""
        self._check_flat(flat, "scatter_")
        ranges = self.server_slices(server)
        owned = self.numel_per_server[server]
        if not isinstance(shard, Tensor):
            raise TypeError(f"ShardingPlan.scatter_(shard={type(shard).__name__}): shard must be a torch.Tensor")
        if shard.dim() != 1 or shard.numel() != owned:
            raise ValueError(
                f"ShardingPlan.scatter_(server={server}, shard={tuple(shard.shape)}): "
                f"shard must be a vector of the server's {owned} elements"
            )
        pos = 0
        for lo, hi in ranges:
            flat[lo:hi].copy_(shard[pos : pos + hi - lo])
            pos += hi - lo

    # ---- printing ----------------------------------------------------------------------------------

    def summary(self) -> dict:
        """A JSON-ready dict: strategy, servers, per-server bytes and elements, max, mean, imbalance."""
        return {
            "sharding": self.sharding,
            "num_servers": self.num_servers,
            "partition_bytes": self.partition_bytes,
            "numel": self.numel,
            "bytes": self.nbytes,
            "numel_per_server": list(self.numel_per_server),
            "bytes_per_server": list(self.bytes_per_server),
            "max_bytes": self.max_bytes,
            "mean_bytes": self.mean_bytes,
            "imbalance": self.imbalance,
        }

    def __repr__(self) -> str:
        return (
            f"ShardingPlan(sharding={self.sharding!r}, num_servers={self.num_servers}, "
            f"partition_bytes={self.partition_bytes}, params={len(self.specs)}, slices={len(self.slices)}, "
            f"bytes_per_server={list(self.bytes_per_server)}, imbalance={self.imbalance:.3f})"
        )

    def __str__(self) -> str:
        layers = len({s.layer for s in self.specs})
        parts = f", partition_bytes={self.partition_bytes:,}" if self.partition_bytes else ""
        lines = [
            f"ShardingPlan(sharding={self.sharding!r}, num_servers={self.num_servers}{parts}): "
            f"{len(self.specs)} tensors in {layers} layers, {self.numel:,} elements, {self.nbytes:,} B",
            f"{'server':>6}  {'elements':>13}  {'bytes':>13}  {'share':>6}  {'ranges':>6}  contents",
        ]
        for server in range(self.num_servers):
            ranges = self.server_slices(server)
            if self.sharding == "layer":
                contents = _abbreviate(self.layers_of(server))
            elif len(ranges) == 1:
                contents = f"elements [{ranges[0][0]:,}, {ranges[0][1]:,})"
            else:
                (a, b), (c, d) = ranges[0], ranges[1]
                more = ", ..." if len(ranges) > 2 else ""
                contents = f"{len(ranges)} partitions: [{a:,}, {b:,}), [{c:,}, {d:,}){more}"
            share = self.bytes_per_server[server] / self.nbytes if self.nbytes else 0.0
            lines.append(
                f"{server:>6}  {self.numel_per_server[server]:>13,}  {self.bytes_per_server[server]:>13,}  "
                f"{share:>6.1%}  {len(ranges):>6}  {contents}"
            )
        lines.append(
            f"max {self.max_bytes:,} B ({self.max_numel:,} elements), mean {self.mean_bytes:,.0f} B, "
            f"imbalance max/mean {self.imbalance:.3f}"
        )
        return "\n".join(lines)


def _abbreviate(names: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(n or "<root>" for n in names[:limit])
    return shown + (f", ... (+{len(names) - limit} more)" if len(names) > limit else "")


def _list_servers(servers: Sequence[int], limit: int = 10) -> str:
    shown = ", ".join(str(s) for s in servers[:limit])
    return f"[{shown}{', ...' if len(servers) > limit else ''}]"


def _check_arguments(owner: str, num_servers: object, sharding: object, partition_bytes: object) -> None:
    if not _is_int(num_servers):
        raise TypeError(f"{owner}(num_servers={num_servers!r}): num_servers must be an int")
    if num_servers < 1:
        raise ValueError(f"{owner}(num_servers={num_servers}): num_servers must be >= 1")
    if not isinstance(sharding, str):
        raise TypeError(f"{owner}(sharding={sharding!r}): sharding must be a str")
    if sharding not in SHARDINGS:
        raise ValueError(f"{owner}(sharding={sharding!r}): sharding must be one of {', '.join(map(repr, SHARDINGS))}")
    if partition_bytes is not None:
        if not _is_int(partition_bytes):
            raise TypeError(f"{owner}(partition_bytes={partition_bytes!r}): partition_bytes must be an int or None")
        if partition_bytes < 1:
            raise ValueError(f"{owner}(partition_bytes={partition_bytes}): partition_bytes must be >= 1")
        if sharding != "memory":
            raise ValueError(
                f"{owner}(sharding={sharding!r}, partition_bytes={partition_bytes}): "
                "partition_bytes applies only to sharding='memory'"
            )


def plan_sharding(
    specs: Sequence[ParamSpec] | nn.Module,
    num_servers: int,
    sharding: str = "memory",
    partition_bytes: int | None = None,
) -> ShardingPlan:
    """Assign the flat parameter vector to ``num_servers`` parameter servers.

    Args:
        specs: the parameters in creation order (:func:`param_specs`), or a module to take them from.
        num_servers: ``S >= 1``. Under ``layer`` at most the number of layers: a server with no layer
            would sit idle. Paper 000 uses one server per two workers.
        sharding: ``"memory"`` (equal-byte ranges, the default: loads ``~B/S``) or ``"layer"`` (whole
            layers, greedy least-loaded in creation order; the usual TensorFlow/PyTorch placement).
        partition_bytes: ``memory`` only. ``None``: one contiguous range per server. ``k >= 1``: cut the
            flat vector into ``k``-byte partitions dealt round-robin to the servers, so transfers pipeline
            (BytePS uses ``k = 4_096_000``; small ``k`` means many small messages).

    Returns:
        The :class:`ShardingPlan`.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: ``num_servers < 1``, an unknown ``sharding``, ``partition_bytes < 1`` or given with
            ``layer``, repeated parameter names, or a plan that would leave a server with no element
            (the message says which servers and why).
    """
    if isinstance(specs, nn.Module):
        specs = param_specs(specs)
    _check_arguments("plan_sharding", num_servers, sharding, partition_bytes)
    specs = tuple(specs)
    for spec in specs:
        if not isinstance(spec, ParamSpec):
            raise TypeError(f"plan_sharding(specs=[..., {spec!r}, ...]): specs must hold ParamSpec values")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"plan_sharding(specs=...): parameter names must be unique, {dup} repeat")
    total = sum(s.numel for s in specs)
    if total == 0:
        raise ValueError(
            f"plan_sharding(specs=<{len(specs)} parameters>): the parameters must hold at least one element"
        )

    widest = max((s.element_size for s in specs), default=1)
    if partition_bytes is not None and partition_bytes % widest:
        # A window shorter than an element, or out of step with the elements, could hold no element start.
        raise ValueError(
            f"plan_sharding(partition_bytes={partition_bytes}): partition_bytes must be a multiple of the "
            f"largest element size, {widest} B"
        )
    if sharding == "layer":
        slices = _layer_slices(specs, num_servers)
    else:
        slices = _memory_slices(specs, num_servers, partition_bytes)
    plan = ShardingPlan(sharding, num_servers, specs, slices, partition_bytes)

    empty = [s for s, n in enumerate(plan.numel_per_server) if n == 0]
    if empty:
        args = f"plan_sharding(num_servers={num_servers}, sharding={sharding!r}"
        if sharding == "layer":
            layers = len({s.layer for s in specs})
            raise ValueError(
                f"{args}): the model has {layers} layers ({len(specs)} parameter tensors), so servers "
                f"{_list_servers(empty)} would be empty; under 'layer' sharding num_servers must be <= the "
                f"number of non-empty layers (or use sharding='memory')"
            )
        if partition_bytes is None:
            raise ValueError(
                f"{args}): {total} elements in ranges of ceil({total}/{num_servers}) = "
                f"{math.ceil(total / num_servers)} leave servers {_list_servers(empty)} empty; every server "
                "must own at least one element, so use fewer servers"
            )
        nbytes = sum(s.nbytes for s in specs)
        raise ValueError(
            f"{args}, partition_bytes={partition_bytes}): {nbytes:,} B make {math.ceil(nbytes / partition_bytes)} "
            f"partition(s), leaving servers {_list_servers(empty)} empty; every server must own at least one "
            "partition, so use a smaller partition_bytes or fewer servers"
        )
    return plan


def _layer_slices(specs: tuple[ParamSpec, ...], num_servers: int) -> list[ParamSlice]:
    """Greedy least-loaded placement of whole layers in creation order (ties to the lowest server)."""
    layers: dict[str, int] = {}  # layer -> bytes, in order of first appearance
    for spec in specs:
        layers[spec.layer] = layers.get(spec.layer, 0) + spec.nbytes
    if len(layers) < num_servers:
        raise ValueError(
            f"plan_sharding(num_servers={num_servers}, sharding='layer'): the model has {len(layers)} layers "
            f"({len(specs)} parameter tensors), so servers {_list_servers(list(range(len(layers), num_servers)))} "
            f"would be empty; under 'layer' sharding num_servers must be <= {len(layers)} (or use sharding='memory')"
        )
    loads = [0] * num_servers
    owner: dict[str, tuple[int, int]] = {}  # layer -> (server, layer index)
    for index, (layer, nbytes) in enumerate(layers.items()):
        server = min(range(num_servers), key=loads.__getitem__)  # argmin; min() keeps the first of ties
        loads[server] += nbytes
        owner[layer] = (server, index)
    slices, offset = [], 0
    for spec in specs:
        server, index = owner[spec.layer]
        slices.append(ParamSlice(server, spec.name, 0, spec.numel, offset, index))
        offset += spec.numel
    return slices


def _memory_slices(specs: tuple[ParamSpec, ...], num_servers: int, partition_bytes: int | None) -> list[ParamSlice]:
    """Cut the flat byte buffer into units; an element belongs to the unit holding its first byte."""
    nbytes = sum(s.nbytes for s in specs)
    if partition_bytes is None:
        widest = max(s.element_size for s in specs)
        # ceil(B / S) rounded up to a whole widest element: exactly ceil(d / S) elements for one dtype.
        unit = widest * math.ceil(nbytes / (num_servers * widest))
        server_of = lambda part: part  # noqa: E731
    else:
        unit = partition_bytes
        server_of = lambda part: part % num_servers  # noqa: E731
    last_part = (nbytes - 1) // unit
    slices: list[ParamSlice] = []
    offset, byte0 = 0, 0
    for spec in specs:
        size = spec.element_size
        if spec.numel == 0:
            part = min(byte0 // unit, last_part)
            slices.append(ParamSlice(server_of(part), spec.name, 0, 0, offset, part))
            continue
        start = 0
        while start < spec.numel:
            part = (byte0 + start * size) // unit
            # first element whose first byte reaches the next unit
            stop = min(spec.numel, -(-((part + 1) * unit - byte0) // size))
            slices.append(ParamSlice(server_of(part), spec.name, start, stop, offset + start, part))
            start = stop
        offset += spec.numel
        byte0 += spec.nbytes
    return slices
