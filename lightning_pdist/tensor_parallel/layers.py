"""Megatron-style sharded layers on plain tensors: the weights are DTensors, the hot path is not.

Each function here shards one module in place over the tensor-parallel mesh and gives it a forward that takes
the local shards (``DTensor.to_local()``, differentiable: the gradient lands on the DTensor parameter) and calls
the explicit collectives of :mod:`.comm`. The DTensor parameters keep the plan's placements for checkpoints
(``get_model_state_dict`` gathers them, ``set_model_state_dict`` shards them) and for :func:`unshard`.

* column-wise ``nn.Linear``: weight and bias ``Shard(0)``; forward ``x W_i^T + b_i`` after ``f``
  (or the sequence all-gather). Column-wise siblings that read the same input (BERT's ``query``, ``key``,
  ``value``) share one ``f`` (:class:`SharedInput`): autograd sums their three input gradients on this rank and
  one all-reduce sums that over the group, as a fused qkv projection does, where one ``f`` each would cost three
  (the all-reduce is linear: ``AR(a) + AR(b) + AR(c) = AR(a + b + c)``). Under sequence parallelism they share
  one all-gather forward and one reduce-scatter backward the same way;
* row-wise ``nn.Linear``: weight ``Shard(1)``, bias ``Replicate()`` (a DTensor, so that torch's ``GradScaler`` sees
  no mix of DTensor and plain gradients in a fully sharded stack); forward ``g(x_i W_i^T) + b``
  (or the sequence reduce-scatter);
* fused query/key/value ``nn.Linear`` (``out_features = 3E``, rows ``[q; k; v]``): ``_StridedShard(0,
  split_factor=3)``, so rank ``i`` holds ``[q_i; k_i; v_i]`` -- the rows of its own heads in each block; the
  attention module around it sees this rank's head counts (:func:`local_head_counts`: Phi-3 slices by them);
* ``nn.MultiheadAttention``: its packed ``in_proj_weight``/``in_proj_bias`` the same way, ``out_proj``
  row-wise; rank ``i`` computes heads ``i*H/t .. (i+1)*H/t - 1`` with ``scaled_dot_product_attention``;
* under sequence parallelism, ``nn.LayerNorm`` and RMSNorms keep replicated weights whose gradient, computed from
  this rank's positions only, is summed over the group once per step (:attr:`Sharding.partial`, one flat
  all-reduce for all of them and the row-wise biases), and the input of an ``nn.TransformerEncoder``
  (or of a transformers stack: BERT's, ALBERT's, LLaMA's) is split along the sequence at its first layer and
  gathered at its output; in transformers' stacks the sequence is gathered at the input of an attention module
  (:meth:`SharedInput.enter_at_input`), which shapes heads by its input's length, or at the projections inside
  ALBERT's, which also holds the residual and LayerNorm (:func:`sequence_parallel_albert_attention`); an FFN's
  column-wise layers gather their own (shared) input.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.nn import functional as F

from lightning_pdist.tensor_parallel.comm import TPComm, copy_to, gather_seq, gather_seq_replicated, reduce_from
from lightning_pdist.tensor_parallel.comm import scatter_seq, split_seq

__all__ = ["SharedInput", "Sharding", "is_strided", "local_head_counts", "local_shard", "shard_attention",
           "shard_linear",
           "sequence_parallel_albert_attention", "sequence_parallel_encoder", "sequence_parallel_norm",
           "sequence_parallel_stack", "unshard"]


class Sharding:
    """What sharding changed on a module tree, so that :func:`unshard` can give back a plain module."""

    def __init__(self) -> None:
        self.forwards: list[nn.Module] = []  # modules given an instance ``forward``
        self.hooks: list[Any] = []  # RemovableHandles
        self.attributes: list[tuple[nn.Module, str, Any]] = []  # (module, name, value to restore)
        #: replicated parameters used on this rank's positions only (sequence parallelism: LayerNorm weights,
        #: row-wise biases): each rank's gradient is a partial sum, to be summed over the group once per step
        self.partial: list[nn.Parameter] = []

    def add_partial(self, *params: Any) -> None:
        self.partial += [p for p in params if p is not None and all(p is not q for q in self.partial)]

    def set_forward(self, module: nn.Module, forward: Callable[..., Any]) -> None:
        module.forward = forward
        self.forwards.append(module)

    def set_attribute(self, module: nn.Module, name: str, value: Any) -> None:
        self.attributes.append((module, name, getattr(module, name)))
        setattr(module, name, value)


class SharedInput:
    """Megatron's ``f`` (or the sequence all-gather) of the column-parallel layers of one module, applied once per input.

    Called with the input of one of those layers, it returns ``f(x)``; called again with the same tensor (same
    object, same version, same grad mode) before the module's call ends, it returns that same ``f(x)``, so the
    layers' input gradients meet in autograd before the one collective of ``f``'s backward. :meth:`install` clears
    the memo when the module's call starts and ends (hooks recorded in ``sharding``); until installed, nothing is
    shared.
    """

    def __init__(self, comm: TPComm, seq_dim: int | None = None) -> None:
        self.comm, self.seq_dim, self.caching = comm, seq_dim, False
        self._key: tuple[Any, ...] | None = None
        self._out: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._out is not None and x is self._out:
            return x  # already entered (at the module's input: :meth:`enter_at_input`)
        key = (x, x._version, torch.is_grad_enabled())
        if self._key is not None and self._key[0] is x and self._key[1:] == key[1:]:
            return self._out  # type: ignore[return-value]
        out = copy_to(x, self.comm) if self.seq_dim is None else gather_seq(x, self.comm, self.seq_dim)
        if self.caching:
            self._key, self._out = key, out
        return out

    def clear(self, *args: Any) -> None:
        self._key = self._out = None

    def install(self, module: nn.Module, sharding: Sharding) -> None:
        """Share within each call of ``module`` (the parent of the layers)."""
        self.caching = True
        sharding.hooks.append(module.register_forward_pre_hook(self.clear))
        sharding.hooks.append(module.register_forward_hook(self.clear))

    def enter_at_input(self, module: nn.Module, sharding: Sharding) -> None:
        """Apply ``f`` (the sequence all-gather) to ``module``'s input (``hidden_states``) instead, so that all of
        ``module`` sees the whole sequence: transformers' attention modules shape their heads by their input's
        length. After :meth:`install`."""

        def enter(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if args:
                return (self(args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": self(kwargs["hidden_states"])}

        sharding.hooks.append(module.register_forward_pre_hook(enter, with_kwargs=True))


def _distribute(module: nn.Module, name: str, mesh: DeviceMesh, placement: Any) -> None:
    p = getattr(module, name)
    if p is None:
        return
    dt = distribute_tensor(p.detach(), mesh, [placement])
    module.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))


def _local(p: torch.Tensor | None) -> torch.Tensor | None:
    return p.to_local() if isinstance(p, DTensor) else p


def shard_linear(linear: nn.Linear, placement: str, mesh: DeviceMesh, comm: TPComm, sharding: Sharding,
                 seq_dim: int | None = None, shared: SharedInput | None = None) -> None:  # fmt: skip
    """``placement``: ``"colwise"``, ``"rowwise"`` or ``"qkv"``; ``seq_dim``: sequence-parallel (its dimension);
    ``shared``: the column-wise input's ``f``, shared with sibling layers (default: this layer's own)."""
    if placement == "rowwise":
        _distribute(linear, "weight", mesh, Shard(1))
        _distribute(linear, "bias", mesh, Replicate())

        def row_forward(x: torch.Tensor) -> torch.Tensor:
            y = F.linear(x, _local(linear.weight))
            y = reduce_from(y, comm) if seq_dim is None else scatter_seq(y, comm, seq_dim)
            return y if linear.bias is None else y + _local(linear.bias)

        if seq_dim is not None:
            sharding.add_partial(linear.bias)  # added on this rank's positions: its gradient is summed per step
        sharding.set_forward(linear, row_forward)
        return
    rows = Shard(0) if placement == "colwise" else _StridedShard(0, split_factor=3)
    _distribute(linear, "weight", mesh, rows)
    _distribute(linear, "bias", mesh, rows)
    enter = shared if shared is not None else SharedInput(comm, seq_dim)

    def col_forward(x: torch.Tensor) -> torch.Tensor:
        return F.linear(enter(x), _local(linear.weight), _local(linear.bias))

    sharding.set_forward(linear, col_forward)


def local_head_counts(attention: nn.Module, size: int, sharding: Sharding) -> None:
    """An attention module around a fused ``qkv`` Linear sees this rank's head counts: ``num_heads``,
    ``num_attention_heads`` and ``num_key_value_heads`` divided by ``t``, on the module and on a copy of its
    ``config`` (the model's other modules keep the shared one). Phi-3 slices its ``qkv`` output at
    ``config.num_attention_heads · head_dim``: with the whole count it would read this rank's key rows as queries.
    ``head_dim`` and the query/key-value group size are unchanged."""
    import copy

    names = ("num_heads", "num_attention_heads", "num_key_value_heads")
    for name in names:
        value = getattr(attention, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            sharding.set_attribute(attention, name, value // size)
    config = getattr(attention, "config", None)
    if config is not None and isinstance(getattr(config, "num_attention_heads", None), int):
        local = copy.copy(config)
        for name in names[1:]:
            if isinstance(getattr(config, name, None), int):
                setattr(local, name, getattr(config, name) // size)
        sharding.set_attribute(attention, "config", local)


def shard_attention(mha: nn.MultiheadAttention, mesh: DeviceMesh, comm: TPComm, sharding: Sharding,
                    seq_dim: int | None = None) -> None:  # fmt: skip
    """Split ``mha``'s heads over the group (rows of each head's q, k, v on one rank); ``out_proj`` row-wise."""
    _distribute(mha, "in_proj_weight", mesh, _StridedShard(0, split_factor=3))
    _distribute(mha, "in_proj_bias", mesh, _StridedShard(0, split_factor=3))
    shard_linear(mha.out_proj, "rowwise", mesh, comm, sharding, seq_dim=None if seq_dim is None else 1)
    heads = mha.num_heads // comm.size

    def enter(x: torch.Tensor) -> torch.Tensor:
        return copy_to(x, comm) if seq_dim is None else gather_seq(x, comm, 1)

    def forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_padding_mask: Any = None,
                need_weights: bool = True, attn_mask: Any = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        unbatched = query.dim() == 2
        self_attention, shared_kv = query is key and key is value, key is value
        if unbatched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
        if not mha.batch_first or unbatched:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        w, b = _local(mha.in_proj_weight), _local(mha.in_proj_bias)
        e = w.shape[0] // 3
        ws, bs = w.split(e), (b.split(e) if b is not None else (None, None, None))
        if self_attention:
            q, k, v = F.linear(enter(query), w, b).split(e, -1)
        else:
            q = F.linear(enter(query), ws[0], bs[0])
            kx = enter(key)
            k = F.linear(kx, ws[1], bs[1])
            v = F.linear(kx if shared_kv else enter(value), ws[2], bs[2])
        batch, length, src = q.shape[0], q.shape[1], k.shape[1]
        q, k, v = (t.view(batch, t.shape[1], heads, mha.head_dim).transpose(1, 2) for t in (q, k, v))
        mask = _additive_mask(attn_mask, key_padding_mask, batch, mha.num_heads, heads * comm.rank, heads, length,
                              src, q.dtype)  # fmt: skip
        dropout = mha.dropout if mha.training else 0.0
        probs = None
        if need_weights:
            scores = (q * mha.head_dim**-0.5) @ k.transpose(-2, -1)
            if mask is None and is_causal:
                mask = torch.full((length, src), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
            probs = torch.softmax(scores if mask is None else scores + mask, dim=-1)
            o = F.dropout(probs, dropout, training=dropout > 0) @ v
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                               is_causal=is_causal and mask is None)  # fmt: skip
        out = mha.out_proj(o.transpose(1, 2).reshape(batch, length, heads * mha.head_dim))
        if not mha.batch_first or unbatched:
            out = out.transpose(0, 1)
        if unbatched:
            out = out.squeeze(1)
        weights = None
        if probs is not None:
            if average_attn_weights:
                weights = reduce_from(probs.sum(1), comm) / mha.num_heads
            else:
                weights = gather_seq_replicated(probs, comm, 1)
            weights = weights.squeeze(0) if unbatched else weights
        return out, weights

    sharding.set_forward(mha, forward)


def _additive_mask(attn_mask: Any, key_padding_mask: Any, batch: int, num_heads: int, first: int, heads: int,
                   length: int, src: int, dtype: torch.dtype) -> torch.Tensor | None:  # fmt: skip
    """torch's mask conventions (bool: True = masked; float: added) as one float mask for this rank's heads."""

    def additive(m: torch.Tensor) -> torch.Tensor:
        if m.dtype == torch.bool:
            return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(m, float("-inf"))
        return m.to(dtype)

    mask = None
    if attn_mask is not None:
        a = additive(attn_mask)
        mask = a.view(1, 1, length, src) if a.dim() == 2 else a.view(batch, num_heads, length, src)[:, first:first + heads]
    if key_padding_mask is not None:
        kp = additive(key_padding_mask).view(batch, 1, 1, src)
        mask = kp if mask is None else mask + kp
    return mask


def sequence_parallel_norm(norm: nn.Module, sharding: Sharding) -> None:
    """A LayerNorm or RMSNorm on this rank's positions: its weight's gradient is a partial sum
    (:attr:`Sharding.partial`), summed over the group once per step (Megatron does the same, in one flat all-reduce
    after the backward)."""
    sharding.add_partial(getattr(norm, "weight", None), getattr(norm, "bias", None))


def sequence_parallel_albert_attention(attn: nn.Module, enter: SharedInput, sharding: Sharding) -> None:
    """transformers' ``AlbertAttention`` under sequence parallelism: it holds the column-wise ``query/key/value``,
    the row-wise ``dense`` *and* the residual and ``LayerNorm`` after it, so the sequence is gathered at the
    projections and scattered by ``dense``, inside the module. With ``x_s`` this rank's positions::

        x = AG(x_s)                                 one all-gather for q, k and v (``enter``: backward reduce-scatter)
        o = attention(x W_q,i, x W_k,i, x W_v,i)    this rank's heads, over the whole sequence
        y_s = LayerNorm(x_s + dropout(RS(o D_i)))   ``dense`` reduce-scatters: residual and norm on L/t positions

    the same function as transformers' forward (its attention interface, mask and scaling), with the collectives of
    sequence parallelism; its weights stay those of the one shared block however often ALBERT applies it."""
    import sys

    source = sys.modules[type(attn).__module__]  # what transformers' own forward calls, from the same module
    interfaces, eager = source.ALL_ATTENTION_FUNCTIONS, source.eager_attention_forward

    def forward(hidden_states: torch.Tensor, attention_mask: Any = None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        x = enter(hidden_states)
        batch, length = x.shape[:2]
        shape = (batch, length, -1, attn.attention_head_size)
        q, k, v = (getattr(attn, n)(x).view(shape).transpose(1, 2) for n in ("query", "key", "value"))
        interface = interfaces.get_interface(attn.config._attn_implementation, eager)
        dropout = attn.attention_dropout.p if attn.training else 0.0
        o, weights = interface(attn, q, k, v, attention_mask, dropout=dropout, scaling=attn.scaling, **kwargs)
        o = attn.output_dropout(attn.dense(o.reshape(batch, length, -1).contiguous()))
        return attn.LayerNorm(hidden_states + o), weights

    sharding.set_forward(attn, forward)


def sequence_parallel_encoder(encoder: nn.TransformerEncoder, comm: TPComm, sharding: Sharding,
                              check: Callable[[int], None]) -> int:  # fmt: skip
    """Split the input of ``encoder``'s first layer along the sequence, gather its output; returns the dimension.

    ``check(length)`` raises when the sequence length cannot be split (called on every rank, before any collective).
    """
    first = encoder.layers[0]
    dim = 1 if first.self_attn.batch_first else 0

    def split(module: nn.Module, args: tuple) -> tuple:
        x = args[0]
        if x.dim() == 2:  # unbatched (S, E)
            raise ValueError("TensorParallelStrategy(sequence_parallel=True): unbatched (2-D) input to "
                             "nn.TransformerEncoder is not supported; add a batch dimension")  # fmt: skip
        check(x.shape[dim])
        return (split_seq(x, comm, dim), *args[1:])

    def gather(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return gather_seq_replicated(output, comm, dim)

    sharding.hooks.append(first.register_forward_pre_hook(split))
    sharding.hooks.append(encoder.register_forward_hook(gather))
    return dim


def sequence_parallel_stack(stack: nn.Module, blocks: list[nn.Module], comm: TPComm, sharding: Sharding,
                            check: Callable[[int], None], owner: str) -> int:  # fmt: skip
    """transformers' encoder stacks (``BertEncoder``; batch-first): split the input of the first of ``blocks`` to
    run in each call of ``stack`` along the sequence, gather ``stack``'s output (its ``last_hidden_state``); returns
    the dimension (1). A block that runs several times per call (a shared one) splits on its first run only.
    ``check(length)`` raises when the length cannot be split (every rank, before any collective).
    """
    pending = [False]

    def arm(module: nn.Module, args: tuple) -> None:
        pending[0] = True

    def split(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not pending[0]:
            return None
        pending[0] = False
        x = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"{owner}: sequence_parallel=True splits the (batch, sequence, hidden) input of "
                             f"{type(module).__name__}; it got {type(x).__name__} {tuple(getattr(x, 'shape', ()))}")  # fmt: skip
        check(x.shape[1])
        x = split_seq(x, comm, 1)
        return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

    def gather(module: nn.Module, args: tuple, output: Any) -> Any:
        pending[0] = False
        if isinstance(output, torch.Tensor):
            return gather_seq_replicated(output, comm, 1)
        if isinstance(output, tuple):
            return (gather_seq_replicated(output[0], comm, 1), *output[1:])
        if getattr(output, "hidden_states", None) is not None:
            raise ValueError(f"{owner}: sequence_parallel=True: {type(module).__name__} returned per-layer "
                             "hidden_states, which hold this rank's positions only; leave output_hidden_states "
                             "False")  # fmt: skip
        output.last_hidden_state = gather_seq_replicated(output.last_hidden_state, comm, 1)
        return output

    sharding.hooks.append(stack.register_forward_pre_hook(arm))
    for block in dict.fromkeys(blocks):  # a block listed twice is hooked once
        sharding.hooks.append(block.register_forward_pre_hook(split, with_kwargs=True))
    sharding.hooks.append(stack.register_forward_hook(gather))
    return 1


def local_shard(full: torch.Tensor, placement: Any, rank: int, size: int) -> torch.Tensor:
    """This rank's part of ``full`` under ``placement`` (``Shard``, the per-head ``_StridedShard``, ``Replicate``)."""
    if isinstance(placement, _StridedShard):
        blocks = full.chunk(placement.split_factor, placement.dim)
        return torch.cat([b.chunk(size, placement.dim)[rank] for b in blocks], placement.dim)
    if isinstance(placement, Shard):
        return full.chunk(size, placement.dim)[rank]
    return full


def is_strided(p: torch.Tensor) -> bool:
    """Whether ``p`` is a DTensor split by heads (torch's state-dict loaders misplace its rows: see the strategy)."""
    return isinstance(p, DTensor) and any(isinstance(pl, _StridedShard) for pl in p.placements)


def unshard(module: nn.Module, sharding: Sharding | None) -> None:
    """Gather every DTensor parameter into a plain full Parameter (a collective: every rank, same order) and
    undo ``sharding``: the module is the plain, unsharded one again, with the trained values."""
    memo: dict[int, nn.Parameter] = {}
    for child in module.modules():
        for name, p in list(child._parameters.items()):
            if isinstance(p, DTensor):
                if id(p) not in memo:
                    full = p.redistribute(placements=[Replicate()] * p.device_mesh.ndim).to_local()
                    memo[id(p)] = nn.Parameter(full.detach().clone(), requires_grad=p.requires_grad)
                child._parameters[name] = memo[id(p)]
    if sharding is None:
        return
    for child in sharding.forwards:
        child.__dict__.pop("forward", None)
    for handle in sharding.hooks:
        handle.remove()
    for child, name, value in reversed(sharding.attributes):
        setattr(child, name, value)
    sharding.forwards.clear(), sharding.hooks.clear(), sharding.attributes.clear(), sharding.partial.clear()
