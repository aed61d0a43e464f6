"""Bytes per optimizer step and a time model for data, tensor, DP×TP and hybrid conv-DP / FC-MP parallelism.

Paper 003 (``seeds-digest.md``) finds DeepSpeed's tensor parallelism faster than data parallelism for BERT-base
and ALBERT-base without analysing communication. This module is that analysis: what each rank *sends* per
optimizer step under each scheme (the model of :mod:`lightning_pdist.core.accounting`: a ring all-reduce of
``n`` bytes on ``N`` ranks sends ``2(N-1)/N · n``, a ring all-gather of ``n_local`` bytes per rank sends
``(N-1) · n_local``), and when one scheme beats the other under ``t = compute / ways + bytes / bandwidth``.

Notation: ``N`` ranks, ``P`` parameters, ``B`` samples the group computes on per step, ``L`` sequence length,
``H`` hidden size, ``e`` bytes per element (4 for fp32), ``AR(n, N) = 2(N-1)/N · n`` (floored per collective,
as the meter counts it), ``AG(n, N) = (N-1) · n``.

Data parallelism (every rank the whole model, gradients all-reduced; DDP buckets add no bytes)::

    dp_all_reduce = AR(e · P, N)

Tensor parallelism of degree ``t`` on a Transformer encoder, Megatron's column/row pairs as
``TensorParallelStrategy`` runs them (query, key, value and the first FFN linear column-wise; the
attention output and the second FFN linear row-wise; embeddings, LayerNorm, pooler and classifier
replicated, so no traffic). Per *layer application* (ALBERT runs its one shared block ``num_layers`` times,
and every run communicates)::

    forward   2 · AR(e·B·L·H, t)   row-wise outputs (attention output, FFN output): partial sums -> replicated
    backward  2 · AR(e·B·L·H, t)   the input gradients of the column-wise modules: one for query, key and value
                                   together (they read the same input; its three gradients are summed on the
                                   rank, then all-reduced once, as for a fused qkv), one for FFN in
    tp_all_reduce = 4 · num_layers · AR(e·B·L·H, t)

An engine that all-reduces the input gradient of query, key and value separately (torch's ``ColwiseParallel``,
DeepSpeed AutoTP's ``LinearLayer``: ``fused_qkv=False``) sends ``6 · num_layers · AR(e·B·L·H, t)``. LLaMA-style
decoders have the same four (the gate and up projections of the FFN share one input). A norm over each head's
features inside attention (Qwen3's ``q_norm``/``k_norm``, ``head_dim`` weights) sees this rank's heads only: its
gradient is a partial sum, and the strategy sums all of them over the group in one flat all-reduce per step
(``P_partial`` parameters, :func:`partial_params`): ``+ AR(e · P_partial, t)``.

Sequence parallelism (``sequence_parallel=True``, Korthikanti et al., 2022; :mod:`.comm`'s collectives) turns each
all-reduce into an all-gather and a reduce-scatter, one each way. With ``n = e·B·L·H`` one activation,
``AG(n/t) = (t-1)·n/t`` the all-gather of this rank's ``L/t`` positions and ``RS(n)`` a reduce-scatter of ``n``
(``(t-1)/t · n`` on NCCL; gloo has none, so the strategy all-reduces the whole tensor and keeps its chunk:
``AR(n, t)``), per layer application: forward ``2 · AG`` (the sequence gathered before attention and FFN in) and
``2 · RS`` (the row-wise outputs scattered), backward the transposes, ``2 · RS`` and ``2 · AG``; per call of a stack
its input split (backward ``AG``) and its output gathered (forward ``AG``). Once per step the partial gradients
(every norm of the covered stacks, LayerNorm or RMSNorm, LLaMA's final norm, the row-wise biases there, per-head
norms; each parameter once however often a shared block runs) in one flat all-reduce (:func:`sp_encoder_bytes`)::

    tp_all_gather     = (4 · layers + 2) · AG(n/t)
    tp_reduce_scatter = 4 · layers · RS(n)
    tp_all_reduce     = AR(e · P_partial, t)

DP×TP on a ``d × t`` mesh: TP's traffic over each TP group (``B`` = the DP replica's batch) plus the all-reduce
of each rank's parameter *shard* over its DP group (column-wise weights and biases and row-wise weights hold
``1/t``; row-wise biases and everything replicated are whole: :func:`tp_local_numel`)::

    dp_all_reduce = AR(e · P_local, d),   tp_all_reduce as above with degree t

Hybrid conv-DP / FC-MP on VGG (Krizhevsky 2014, "one weird trick"): convolutions replicated on all ``N`` ranks
with their gradients all-reduced; each rank's ``b`` feature vectors (``F`` = fc6's fan-in) all-gathered so every
rank runs the FC part on all ``N·b`` samples; ``fc6`` column-wise, ``fc7`` row-wise, ``fc8`` replicated; in
backward the logits' gradients (``C`` classes) are all-gathered so every rank back-propagates the whole batch
through the FC part::

    dp_all_reduce = AR(e · P_conv, N)
    tp_all_gather = AG(e·b·F, N)              forward: the batch's features
                  + AG(e·b·C, N)              backward: the logits' gradients
    tp_all_reduce = AR(e·N·b·H, N)            forward: fc7's (row-wise) output
                  + AR(e·N·b·F, N)            backward: fc6's (column-wise) input gradient

Time model: ``t = compute / ways + bytes / bandwidth`` (:func:`step_time`). Links are full duplex and every rank
sends its bytes on its own link at once, so ``bytes`` is one rank's. With equal compute shares (``ways`` = the
ranks for both schemes) only the bytes decide; with measured compute per scheme (TP repeats the replicated
layers on every rank and runs smaller matmuls) :func:`crossover_bandwidth` gives the bandwidth below which the
scheme that sends less wins, and :func:`find_crossovers` the batch sizes or widths where the winner changes.

Pure functions: ``torch`` only (for :func:`tp_local_numel`; :func:`partial_params` reads the strategy's rules from
:mod:`.regions`); no process group.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = [
    "KINDS",
    "Crossover",
    "StepBytes",
    "crossover_bandwidth",
    "dp_bytes",
    "dp_tp_bytes",
    "encoder_flops",
    "find_crossovers",
    "hybrid_vgg_bytes",
    "partial_params",
    "ring_all_gather_bytes",
    "ring_all_reduce_bytes",
    "sp_encoder_bytes",
    "step_time",
    "tp_encoder_bytes",
    "tp_local_numel",
]

KINDS = ("dp_all_reduce", "tp_all_reduce", "tp_all_gather", "tp_reduce_scatter")  # the CommMeter labels the strategies use
COLUMN_INPUTS_PER_LAYER = 2  # the input of query/key/value (one, shared) and of FFN in: one backward all-reduce each
UNFUSED_COLUMN_INPUTS_PER_LAYER = 4  # query, key, value, FFN in, each its own backward all-reduce
ROW_MODULES_PER_LAYER = 2  # attention output, FFN out: one forward all-reduce each
STYLES = ("colwise", "rowwise", "replicate")


def ring_all_reduce_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``nbytes``: ``2(N-1)/N · n``, floored.

    The same figure as :func:`lightning_pdist.core.accounting.all_reduce_bytes` (this layer may not import
    ``comm``; a test checks that the two agree).
    """
    _check_int("world_size", world_size, 1)
    return (2 * (world_size - 1) * nbytes) // world_size


def ring_all_gather_bytes(local_nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-gather of ``local_nbytes`` per rank: ``(N-1) · n_local``."""
    _check_int("world_size", world_size, 1)
    return (world_size - 1) * local_nbytes


def _check_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"tensor_parallel_cost({name}={value!r}): {name} must be an int >= {low}")


@dataclass(frozen=True)
class StepBytes:
    """Bytes one rank sends in one optimizer step, per :class:`~lightning_pdist.core.accounting.CommMeter` label."""

    dp_all_reduce: int = 0
    tp_all_reduce: int = 0
    tp_all_gather: int = 0
    tp_reduce_scatter: int = 0  # sequence parallelism only

    @property
    def total(self) -> int:
        return sum(getattr(self, kind) for kind in KINDS)

    def by_kind(self) -> dict[str, int]:
        """The non-zero kinds, as ``CommMeter.by_kind`` lists them."""
        return {kind: getattr(self, kind) for kind in KINDS if getattr(self, kind)}

    def __add__(self, other: StepBytes) -> StepBytes:
        return StepBytes(*(getattr(self, k) + getattr(other, k) for k in KINDS))

    def __mul__(self, steps: int) -> StepBytes:
        return StepBytes(*(getattr(self, k) * steps for k in KINDS))


def dp_bytes(num_params: int, world_size: int, bytes_per_element: int = 4) -> StepBytes:
    """Data parallelism: one ring all-reduce of every gradient, ``AR(e · P, N)``."""
    _check_int("num_params", num_params, 0)
    return StepBytes(dp_all_reduce=ring_all_reduce_bytes(bytes_per_element * num_params, world_size))


def tp_encoder_bytes(
    batch_size: int,
    seq_len: int,
    hidden_size: int,
    num_layers: int,
    tp_size: int,
    bytes_per_element: int = 4,
    fused_qkv: bool = True,
    partial_params: int = 0,
) -> StepBytes:
    """Tensor parallelism of degree ``tp_size`` on an encoder or decoder: ``4 · num_layers · AR(e·B·L·H, t)``, plus
    ``AR(e · partial_params, t)`` for the per-head norms.

    Args:
        batch_size: samples the TP group runs per step (all its ranks run the same ones).
        seq_len: tokens per sample (padding included: the activations are ``(B, L, H)`` whatever the mask).
        hidden_size: ``H``, the width of the all-reduced activations.
        num_layers: layer *applications* (ALBERT: how many times its shared block runs).
        tp_size: ``t``; 1 sends nothing.
        bytes_per_element: 4 for fp32 activations.
        fused_qkv: ``True`` (``TensorParallelStrategy``): one backward all-reduce for query, key and value;
            ``False`` (DeepSpeed AutoTP, torch's ``ColwiseParallel``): one each, ``6 · num_layers · AR``.
        partial_params: parameters whose gradient is summed over the group once per step (Qwen3's per-head
            norms: :func:`partial_params` with ``sequence_parallel=False``).
    """
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("hidden_size", hidden_size),
                        ("num_layers", num_layers)):  # fmt: skip
        _check_int(name, value, 1)
    _check_int("partial_params", partial_params, 0)
    one = ring_all_reduce_bytes(bytes_per_element * batch_size * seq_len * hidden_size, tp_size)
    columns = COLUMN_INPUTS_PER_LAYER if fused_qkv else UNFUSED_COLUMN_INPUTS_PER_LAYER
    partial = ring_all_reduce_bytes(bytes_per_element * partial_params, tp_size)
    return StepBytes(tp_all_reduce=(columns + ROW_MODULES_PER_LAYER) * num_layers * one + partial)


def sp_encoder_bytes(batch_size: int, seq_len: int, hidden_size: int, num_layers: int, tp_size: int,
                     partial_params: int, bytes_per_element: int = 4, gloo: bool = True) -> StepBytes:  # fmt: skip
    """Sequence parallelism on one encoder or decoder stack (the module docstring's model); ``seq_len`` must be
    divisible by ``tp_size``, as the strategy requires. ``gloo=False``: a real reduce-scatter (NCCL)."""
    for name, value, low in (("batch_size", batch_size, 1), ("seq_len", seq_len, 1), ("hidden_size", hidden_size, 1),
                             ("num_layers", num_layers, 1), ("tp_size", tp_size, 1), ("partial_params", partial_params, 0)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"sp_encoder_bytes({name}={value!r}): {name} must be an int >= {low}")
    if seq_len % tp_size:
        raise ValueError(f"sp_encoder_bytes(seq_len={seq_len}): seq_len must be divisible by tp_size={tp_size}")
    t, n = tp_size, bytes_per_element * batch_size * seq_len * hidden_size
    gather = (t - 1) * (n // t)
    scatter = ring_all_reduce_bytes(n, t) if gloo else ((t - 1) * n) // t
    return StepBytes(tp_all_gather=(4 * num_layers + 2) * gather, tp_reduce_scatter=4 * num_layers * scatter,
                     tp_all_reduce=ring_all_reduce_bytes(bytes_per_element * partial_params, t))  # fmt: skip


def partial_params(module: nn.Module, plan: Any, sequence_parallel: bool = True) -> int | str:
    """Parameters whose gradient the strategy sums over the tensor-parallel group once per step, each counted once
    (a shared block's once); or, under sequence parallelism, the strategy's refusal of ``module`` as text.

    Always: the per-head norms of attention modules with sharded projections (Qwen3's ``q_norm``/``k_norm``: this
    rank's heads only). ``sequence_parallel=True`` adds, in every stack it covers, the norms (``nn.LayerNorm``,
    ``nn.RMSNorm``, transformers' ``*RMSNorm``/``*LayerNorm``; LLaMA's final ``norm``) and the biases of row-wise
    layers (``nn.MultiheadAttention``'s ``out_proj`` included): they see this rank's positions only.
    """
    from lightning_pdist.tensor_parallel.plan import COLWISE, HEADS, QKV, ROWWISE
    from lightning_pdist.tensor_parallel.regions import HF_STACKS, is_norm, parent_kind, per_head_norms
    from lightning_pdist.tensor_parallel.regions import sequence_parallel_encoders

    modules, placed = dict(module.named_modules()), plan.as_dict()
    found: dict[int, int] = {}

    def add(*params: Any) -> None:
        found.update({id(p): p.numel() for p in params if p is not None})

    parents = dict.fromkeys(n.rsplit(".", 1)[0] if "." in n else "" for n, p in placed.items() if p in (COLWISE, QKV))
    for parent in parents:
        if parent_kind(parent, modules, placed) == "attention":
            for norm in per_head_norms(modules[parent]):
                add(getattr(norm, "weight", None), getattr(norm, "bias", None))
    if not sequence_parallel:
        return sum(found.values())
    try:
        stacks = sequence_parallel_encoders(module, plan, "TensorParallelStrategy")
    except ValueError as err:
        return str(err)
    for stack_name, (stack, attr) in stacks.items():
        region = stack_name if attr is None else (f"{stack_name}.{attr}" if stack_name else attr)
        inside = stack if attr is None else getattr(stack, attr)
        after = [] if attr is None else [getattr(stack, n) for n in HF_STACKS[attr][1] if hasattr(stack, n)]
        for child in after:
            if is_norm(child):
                add(getattr(child, "weight", None), getattr(child, "bias", None))
        for name, child in inside.named_modules(prefix=region):
            owner = name.rsplit(".", 1)[0]
            if is_norm(child):
                add(getattr(child, "weight", None), getattr(child, "bias", None))
            in_attention = name.endswith(".out_proj") and placed.get(owner) == HEADS  # nn.MultiheadAttention's
            if isinstance(child, nn.Linear) and not is_norm(child) and (placed.get(name) == ROWWISE or in_attention):
                add(child.bias)
    return sum(found.values())


def dp_tp_bytes(
    local_params: int,
    batch_size: int,
    seq_len: int,
    hidden_size: int,
    num_layers: int,
    dp_size: int,
    tp_size: int,
    bytes_per_element: int = 4,
) -> StepBytes:
    """DP×TP on a ``dp_size × tp_size`` mesh: ``AR(e · P_local, d)`` over the DP group plus TP's traffic.

    Args:
        local_params: parameters one rank holds (its shards and the replicated rest; :func:`tp_local_numel`).
        batch_size: samples of one DP replica (one TP group) per step.
        seq_len, hidden_size, num_layers, bytes_per_element: as in :func:`tp_encoder_bytes`.
        dp_size: ranks of a DP group (replicas).
        tp_size: ranks of a TP group.
    """
    dp = dp_bytes(local_params, dp_size, bytes_per_element)
    return dp + tp_encoder_bytes(batch_size, seq_len, hidden_size, num_layers, tp_size, bytes_per_element)


def hybrid_vgg_bytes(
    conv_params: int,
    batch_size: int,
    fc_in: int,
    fc_hidden: int,
    num_classes: int,
    world_size: int,
    bytes_per_element: int = 4,
) -> StepBytes:
    """Hybrid conv-DP / FC-MP (``fc6`` column-wise, ``fc7`` row-wise, ``fc8`` replicated) on ``world_size`` ranks.

    Args:
        conv_params: parameters of the convolutions (all-reduced over every rank).
        batch_size: ``b``, samples per rank per step (the FC part runs on all ``N·b``).
        fc_in: ``F``, fc6's fan-in (the flattened feature map).
        fc_hidden: ``H``, fc6's and fc7's output width.
        num_classes: ``C``, fc8's output width.
        world_size: ``N``, the ranks (one group for both halves).
    """
    for name, value in (("batch_size", batch_size), ("fc_in", fc_in), ("fc_hidden", fc_hidden),
                        ("num_classes", num_classes)):  # fmt: skip
        _check_int(name, value, 1)
    e, b, n = bytes_per_element, batch_size, world_size
    return StepBytes(
        dp_all_reduce=ring_all_reduce_bytes(e * conv_params, n),
        tp_all_gather=ring_all_gather_bytes(e * b * fc_in, n) + ring_all_gather_bytes(e * b * num_classes, n),
        tp_all_reduce=ring_all_reduce_bytes(e * n * b * fc_hidden, n) + ring_all_reduce_bytes(e * n * b * fc_in, n),
    )


def tp_local_numel(module: nn.Module, styles: Mapping[str, str], tp_size: int) -> int:
    """Parameters one rank holds when the ``nn.Linear`` modules named in ``styles`` are sharded ``tp_size`` ways.

    ``"colwise"`` shards the weight's rows and the bias (``1/t`` each); ``"rowwise"`` shards the weight's
    columns and keeps the bias whole (torch's ``RowwiseParallel``); ``"replicate"`` and every module not named
    keep all their parameters. A parameter shared by several modules (ALBERT's block) counts once, as
    ``named_parameters`` lists it once.

    Raises:
        ValueError: a style is unknown, a name is not a submodule, or a sharded dimension is not divisible
            by ``tp_size``.
    """
    _check_int("tp_size", tp_size, 1)
    modules = dict(module.named_modules())
    local: dict[int, int] = {id(p): p.numel() for p in module.parameters()}
    for name, style in styles.items():
        if style not in STYLES:
            raise ValueError(f"tp_local_numel(styles[{name!r}]={style!r}): style must be one of {STYLES}")
        if name not in modules:
            raise ValueError(f"tp_local_numel(styles[{name!r}]): the module has no submodule {name!r}")
        if style == "replicate":
            continue
        sub = modules[name]
        dim = 0 if style == "colwise" else 1
        for pname, param in sub.named_parameters(recurse=False):
            if pname == "bias" and style == "rowwise":
                continue
            if param.shape[min(dim, param.ndim - 1)] % tp_size:
                raise ValueError(f"tp_local_numel(styles[{name!r}]={style!r}): {name}.{pname} {tuple(param.shape)} "
                                 f"is not divisible by tp_size={tp_size} along dim {dim}")  # fmt: skip
            local[id(param)] = param.numel() // tp_size
    return sum(local.values())


def encoder_flops(batch_size: int, seq_len: int, hidden_size: int, intermediate_size: int, num_layers: int) -> int:
    """Matmul FLOPs of one training step of an encoder's blocks (forward + backward = 3 × forward).

    Per layer application, forward: ``2·B·L·(4H² + 2HI)`` for the projections and FFN, ``4·B·L²·H`` for the
    attention scores and their weighted sum. Embeddings, LayerNorm, softmax and the head are left out. The
    benchmark scales a measured step time by the ratio of these to extrapolate to other batches and widths.
    """
    per_layer = 2 * batch_size * seq_len * (4 * hidden_size**2 + 2 * hidden_size * intermediate_size)
    per_layer += 4 * batch_size * seq_len**2 * hidden_size
    return 3 * num_layers * per_layer


def step_time(compute_s: float, step_bytes: int, bandwidth_bytes_per_s: float, ways: int = 1) -> float:
    """``t = compute_s / ways + step_bytes / bandwidth``: compute split ``ways`` ways, then one rank's bytes on its link.

    ``compute_s`` is the compute of the whole step's work in one process (``ways`` = the ranks sharing it) or
    one rank's measured compute (``ways=1``). Communication is not overlapped with compute (an upper bound).
    """
    if not bandwidth_bytes_per_s > 0:
        raise ValueError(f"step_time(bandwidth_bytes_per_s={bandwidth_bytes_per_s!r}): bandwidth must be > 0")
    _check_int("ways", ways, 1)
    return compute_s / ways + step_bytes / bandwidth_bytes_per_s


@dataclass(frozen=True)
class Crossover:
    """Where two configurations' step times cross.

    Attributes:
        value: the parameter (bandwidth in bytes/s, batch size, width) at which the times are equal; ``None``
            when one configuration wins everywhere.
        below: the configuration that is faster for parameter values below ``value`` (everywhere if ``None``).
        above: the configuration that is faster above ``value``.
    """

    value: float | None
    below: str
    above: str


def crossover_bandwidth(
    compute_a: float, bytes_a: int, compute_b: float, bytes_b: int, names: tuple[str, str] = ("dp", "tp")
) -> Crossover:
    """The bandwidth at which ``compute_a + bytes_a / bw = compute_b + bytes_b / bw``: ``(bytes_a - bytes_b) / (compute_b - compute_a)``.

    Below it the configuration that sends fewer bytes wins, above it the one that computes less. When one
    configuration both computes and sends no more than the other, it wins at every bandwidth (``value=None``).
    """
    a, b = names
    d_bytes, d_compute = bytes_a - bytes_b, compute_b - compute_a
    if d_bytes == 0 and d_compute == 0:
        return Crossover(None, a, a)
    if d_bytes * d_compute <= 0:  # one side is no worse in both terms
        winner = a if (d_bytes <= 0 and d_compute >= 0) else b
        return Crossover(None, winner, winner)
    fewer_bytes, less_compute = (b, a) if d_bytes > 0 else (a, b)
    return Crossover(d_bytes / d_compute, fewer_bytes, less_compute)


def find_crossovers(
    diff: Callable[[int], float], low: int, high: int, names: tuple[str, str] = ("dp", "tp"), samples: int = 48
) -> list[Crossover]:
    """Every integer in ``(low, high]`` where ``diff(x) = t_a(x) - t_b(x)`` changes sign, in increasing order.

    ``diff`` is evaluated on ``samples`` points spaced geometrically from ``low`` to ``high``; each bracket whose
    ends differ in sign is bisected to the first integer past the crossing. Two crossings closer together than
    one grid step cancel out and are missed. Width sweeps need this: DP's bytes grow as ``H²`` (plus a fixed
    embedding) and TP's as ``H``, so TP can win at small and at large widths and lose in between.

    Returns:
        One :class:`Crossover` per sign change (``below`` the winner before it, ``above`` after it), or, when the
        sign never changes, ``[Crossover(None, winner, winner)]``.
    """
    _check_int("low", low, 1)
    if high <= low:
        raise ValueError(f"find_crossovers(low={low}, high={high}): high must be > low")
    _check_int("samples", samples, 2)
    a, b = names
    winner = lambda d: b if d > 0 else a  # noqa: E731  (t_a > t_b: b is faster)
    sign = lambda x: math.copysign(1, diff(x))  # noqa: E731
    grid = sorted({round(low * (high / low) ** (i / (samples - 1))) for i in range(samples)} | {low, high})
    signs = [sign(x) for x in grid]
    out = []
    for (lo, s_lo), (hi, s_hi) in zip(zip(grid, signs), zip(grid[1:], signs[1:])):
        if s_lo == s_hi:
            continue
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if sign(mid) == s_lo else (lo, mid)
        out.append(Crossover(float(hi), winner(s_lo), winner(s_hi)))
    return out or [Crossover(None, winner(signs[0]), winner(signs[0]))]
