"""Tensor-parallel plans as values: which module is sharded how, derived from the model without a process group.

Megatron-LM (Shoeybi et al., 2019) splits a Transformer block's two matrix products in pairs so that each pair
needs one all-reduce forward and one backward: the first linear layer **column-wise** (each of ``t`` ranks owns
``out_features / t`` output features and computes its slice of the activation, no communication), the second
**row-wise** (each rank owns the matching ``in_features / t`` inputs, produces a partial sum of the output, and
the partial sums are all-reduced). For an input ``X`` and ``Y = f(X A) B`` with ``A = [A_1 .. A_t]`` split by
columns and ``B = [B_1; .. ; B_t]`` by rows::

    Y = sum_i f(X A_i) B_i          (f elementwise: GELU, ReLU, dropout, or attention over whole heads)

Attention is column-parallel in its query/key/value projections (whole heads per rank, so the number of heads
must divide by ``t``) and row-parallel in its output projection. A packed projection (``nn.MultiheadAttention``'s
``in_proj_weight``, or a fused ``qkv`` Linear) holds the rows ``[W_q; W_k; W_v]``; rank ``i`` takes block ``i``
of each of the three (``_StridedShard(0, split_factor=3)``), so the query, key and value rows of a head stay
together. Everything else (embeddings, LayerNorm, pooler, classifier) is **replicated**: every rank computes it on
the same replicated activations and gets the same gradient, so replicated weights never need synchronising within
the tensor-parallel group.

The **hybrid** plan is Krizhevsky's "one weird trick" (2014): convolution layers, about 5% of the weights and 95%
of the compute, are data-parallel (each rank its own images, gradients all-reduced); the fully connected layers,
the other 95% of the weights, are model-parallel over the whole batch: the convolutional features of all ranks
are all-gathered before the first FC layer (:attr:`TPPlan.gather_batch_at`) and each rank's logits are taken
back out of the full-batch output.

:func:`plan_for` derives a plan for the shapes that occur in practice; :func:`check_plan` checks any plan (given
or derived) against a model and a degree, naming the module and the rule it breaks. The strategy
(:mod:`lightning_pdist.tensor_parallel.strategy`) turns a plan into ``torch.distributed.tensor.parallel``
styles; this file never touches a process group.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

COLWISE, ROWWISE, REPLICATE = "colwise", "rowwise", "replicate"
#: ``nn.MultiheadAttention`` split by heads; a fused query/key/value ``nn.Linear`` (rows ``[q; k; v]``) split by heads
HEADS, QKV = "heads", "qkv"
PLACEMENTS = (COLWISE, ROWWISE, REPLICATE, HEADS, QKV)

#: Parameter-free modules that act elementwise: allowed between a column-wise layer and its row-wise partner.
ELEMENTWISE = (nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.SiLU, nn.LeakyReLU, nn.ELU, nn.Dropout, nn.Identity)
#: Query/key/value projection names, and the attention output projection inside the same module.
_QKV = (("query", "key", "value"), ("q_proj", "k_proj", "v_proj"))
_ATTENTION_OUT = ("dense", "o_proj", "out_proj")
#: (fused query/key/value Linear, output projection) beside each other in one attention module
_FUSED = (("qkv", "proj"), ("qkv", "out_proj"), ("Wqkv", "out_proj"), ("query_key_value", "dense"),
          ("qkv_proj", "o_proj"))
#: (column-wise, row-wise) pairs of a Transformer block's FFN, relative to the block, and of BERT's attention
#: output (``attention.output.dense`` after ``attention.self``).
_FFN_PAIRS = (("intermediate.dense", "output.dense"), ("ffn", "ffn_output"), ("mlp.fc1", "mlp.fc2"),
              ("mlp.up_proj", "mlp.down_proj"), ("linear1", "linear2"))  # fmt: skip
#: the gate of a gated FFN (LLaMA's ``down_proj(act(gate_proj(x)) * up_proj(x))``): column-wise beside its partner,
#: the two column-wise outputs multiplied elementwise on each rank's features
_FFN_GATES = (("mlp.gate_proj", "mlp.down_proj"),)


@dataclass(frozen=True)
class TPPlan:
    """Module name -> placement, and for the hybrid plan the module whose input is the all-gathered batch.

    Names are those of ``model.named_modules()`` (for a LightningModule: ``model.encoder...``). Modules not
    named are replicated. ``str(plan)`` prints one line per module; plans compare by value.

    Attributes:
        layers: sorted ``(name, placement)`` pairs, placement in :data:`PLACEMENTS`.
        gather_batch_at: hybrid only: this module receives the features of every rank's batch (all-gathered on
            dimension 0) and its output is split back to this rank's rows; modules outside it are data-parallel.
    """

    layers: tuple[tuple[str, str], ...]
    gather_batch_at: str | None = None

    def __post_init__(self) -> None:
        for name, placement in self.layers:
            if placement not in PLACEMENTS:
                raise ValueError(f"TPPlan(layers[{name!r}]={placement!r}): placement must be one of {PLACEMENTS}")
        names = [name for name, _ in self.layers]
        if names != sorted(set(names)):
            raise ValueError(f"TPPlan(layers={self.layers!r}): names must be unique and sorted (use from_dict)")

    @classmethod
    def from_dict(cls, layers: Mapping[str, str], gather_batch_at: str | None = None) -> TPPlan:
        """A plan from ``{"model.net.1": "colwise", ...}``."""
        if not isinstance(layers, Mapping):
            raise TypeError(f"TPPlan.from_dict(layers={layers!r}): layers must map module names to placements")
        for name, placement in layers.items():
            if not isinstance(name, str) or not isinstance(placement, str):
                raise TypeError(f"TPPlan.from_dict(layers={{{name!r}: {placement!r}}}): names and placements must "
                                f"be strings, placements one of {PLACEMENTS}")  # fmt: skip
        return cls(tuple(sorted(layers.items())), gather_batch_at)

    def as_dict(self) -> dict[str, str]:
        return dict(self.layers)

    def named(self, placement: str) -> list[str]:
        """The modules with ``placement``, in name order."""
        return [name for name, p in self.layers if p == placement]

    def __str__(self) -> str:
        width = max((len(name) for name, _ in self.layers), default=0)
        lines = [f"{name:<{width}}  {placement}" for name, placement in self.layers]
        if self.gather_batch_at is not None:
            lines.insert(0, f"batch all-gathered at the input of {self.gather_batch_at!r}")
        return "\n".join(lines)


def plan_for(module: nn.Module, hybrid: bool = False) -> TPPlan:
    """Derive a plan: Transformer encoder blocks Megatron-style, and Linear stacks in column/row pairs.

    * A module with Linear children ``query/key/value`` (or ``q_proj/k_proj/v_proj``) is attention: those are
      column-wise; its output projection (``dense``/``o_proj``/``out_proj`` beside them, or BERT's sibling
      ``output.dense``) row-wise. FFNs: ``intermediate.dense``/``output.dense`` (BERT), ``ffn``/``ffn_output``
      (ALBERT), ``mlp.fc1``/``mlp.fc2``, ``mlp.up_proj``/``mlp.down_proj`` (with LLaMA's ``mlp.gate_proj``
      column-wise too: ``Σ_i (act(X G_i) ⊙ X U_i) D_i``), ``linear1``/``linear2``.
    * In an ``nn.Sequential``, two Linear layers with only elementwise modules (:data:`ELEMENTWISE`) between them
      become a column/row pair; a Linear left without a partner (often the classifier) is replicated.
    * ``hybrid=True``: the first Sequential with a column/row pair is model-parallel over the gathered batch
      (:attr:`TPPlan.gather_batch_at`); the convolution layers before it are data-parallel.

    ALBERT's one shared block appears once in ``named_modules()``, so it is sharded once and stays shared.

    * ``nn.MultiheadAttention`` (and so ``nn.TransformerEncoderLayer``/``DecoderLayer``, torch's and Lightning's
      demo Transformer) is split by heads (:data:`HEADS`); a fused ``qkv`` Linear (``qkv``/``proj``,
      ``Wqkv``/``out_proj``, ``query_key_value``/``dense``, ``qkv_proj``/``o_proj``) is :data:`QKV`, its output
      projection row-wise.

    Raises:
        ValueError: naming the module, when nothing can be sharded, and for a hybrid plan without convolution
            layers before the Linear stack.
    """
    owner = f"plan_for({type(module).__name__})"
    modules = dict(module.named_modules())
    layers: dict[str, str] = {} if hybrid else _encoder_layers(modules)
    gather_at = None
    for name, child in modules.items():
        if not isinstance(child, nn.Sequential) or any(n.startswith(f"{name}.") for n in layers) or name in layers:
            continue
        pairs = _linear_pairs(child)
        if not pairs:
            continue
        prefix = f"{name}." if name else ""
        for col, row in pairs:
            layers[prefix + col], layers[prefix + row] = COLWISE, ROWWISE
        if hybrid:
            gather_at = name
            break
    if not layers:
        raise ValueError(
            f"{owner}: found nothing to shard: no attention with query/key/value nn.Linear layers and no "
            "nn.Sequential with two nn.Linear layers separated only by elementwise modules; pass a plan dict "
            "{module name: 'colwise' | 'rowwise'}"
        )
    if hybrid:
        convs = [n for n, m in modules.items() if isinstance(m, nn.modules.conv._ConvNd)]
        if not convs:
            raise ValueError(f"{owner}: plan='hybrid' shards the fully connected layers of a network whose "
                             "convolution layers are data-parallel, but this model has no convolution layers; "
                             "use plan='auto'")  # fmt: skip
        if not gather_at:
            raise ValueError(f"{owner}: plan='hybrid' found no nn.Sequential of fully connected layers to shard")
    return TPPlan.from_dict(layers, gather_batch_at=gather_at)


def _encoder_layers(modules: dict[str, nn.Module]) -> dict[str, str]:
    layers: dict[str, str] = {}
    linear = lambda name: isinstance(modules.get(name), nn.Linear)  # noqa: E731
    for name, child in modules.items():
        prefix = f"{name}." if name else ""
        if isinstance(child, nn.MultiheadAttention):
            layers[name] = HEADS
        for fused, out in _FUSED:
            if linear(prefix + fused) and linear(prefix + out):
                layers[prefix + fused], layers[prefix + out] = QKV, ROWWISE
        for qkv in _QKV:
            if all(linear(prefix + n) for n in qkv):
                layers.update({prefix + n: COLWISE for n in qkv})
                out = [prefix + n for n in _ATTENTION_OUT if linear(prefix + n)]
                parent = name.rsplit(".", 1)[0] + "." if "." in name else ""
                out = out or [n for n in (parent + "output.dense",) if linear(n)]
                layers.update({n: ROWWISE for n in out[:1]})
        for col, row in _FFN_PAIRS:
            if linear(prefix + col) and linear(prefix + row) and prefix + row not in layers:
                layers[prefix + col], layers[prefix + row] = COLWISE, ROWWISE
        for gate, row in _FFN_GATES:
            if linear(prefix + gate) and layers.get(prefix + row) == ROWWISE:
                layers[prefix + gate] = COLWISE
    return layers


def _linear_pairs(seq: nn.Sequential) -> list[tuple[str, str]]:
    pairs, pending = [], None
    for name, child in seq.named_children():
        if isinstance(child, nn.Linear):
            if pending is not None:
                pairs.append((pending, name))
                pending = None
            else:
                pending = name
        elif not isinstance(child, ELEMENTWISE):
            pending = None  # a norm or a reshape between them: the pair would need the full activation
    return pairs


def check_plan(plan: TPPlan, module: nn.Module, tp_size: int, owner: str = "plan") -> None:
    """``ValueError`` naming the module and the rule when ``plan`` cannot shard ``module`` over ``tp_size`` ranks.

    Rules: every named module exists; column-/row-wise modules are ``nn.Linear`` (or ``nn.Embedding``);
    a column-wise Linear's ``out_features`` and a row-wise Linear's ``in_features`` divide by ``tp_size``;
    attention modules with sharded projections have ``num_attention_heads`` divisible by ``tp_size``, and a
    column-wise projection of an attention module with a ``head_dim`` (LLaMA's grouped key/value heads included)
    whole heads per rank (``out_features`` divisible by ``head_dim × tp_size``); a fused ``qkv`` Linear three equal
    blocks (no grouped key/value heads: Phi-3-medium's ``qkv_proj`` is refused) and its module's heads, declared on
    the module or its ``config``, divisible by ``tp_size``; ``gather_batch_at`` exists. ``owner`` prefixes the
    message (e.g. ``"TensorParallelStrategy(plan=...)"``).
    """
    modules = dict(module.named_modules())
    names = list(plan.as_dict()) + ([plan.gather_batch_at] if plan.gather_batch_at is not None else [])
    for name in names:
        if name not in modules:
            close = difflib.get_close_matches(name, [n for n in modules if n], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; its modules are {_sample(modules)}"
            raise ValueError(f"{owner}: module {name!r} is not in {type(module).__name__}{hint}")
    for name, placement in plan.layers:
        child = modules[name]
        if placement == REPLICATE:
            continue
        if placement == HEADS:
            _check_attention(name, child, tp_size, owner)
            continue
        if placement == QKV:
            if not isinstance(child, nn.Linear):
                raise ValueError(f"{owner}: module {name!r} is {type(child).__name__}; {QKV!r} (a fused query/key/value "
                                 "projection) applies to nn.Linear only")  # fmt: skip
            _check_fused_heads(name, child, modules[name.rsplit(".", 1)[0] if "." in name else ""], tp_size, owner)
            if child.out_features % (3 * tp_size):
                raise ValueError(f"{owner}: module {name!r} ({_describe(child)}): out_features={child.out_features} "
                                 f"must be divisible by 3 x tensor_parallel_size={3 * tp_size} (query, key and value "
                                 "rows, each split over the ranks)")  # fmt: skip
            continue
        if not isinstance(child, (nn.Linear, nn.Embedding)):
            raise ValueError(f"{owner}: module {name!r} is {type(child).__name__}; {placement} sharding applies to "
                             "nn.Linear and nn.Embedding only")  # fmt: skip
        dim, size = _sharded_dim(child, placement)
        if size % tp_size:
            raise ValueError(f"{owner}: module {name!r} ({_describe(child)}): {dim}={size} must be divisible by "
                             f"tensor_parallel_size={tp_size} to shard it {placement}")  # fmt: skip
    sharded = plan.named(COLWISE) + plan.named(QKV)
    for name, child in modules.items():
        attr = "num_attention_heads" if hasattr(child, "num_attention_heads") else "num_heads"
        heads = None if isinstance(child, nn.MultiheadAttention) else getattr(child, attr, None)
        prefix = f"{name}." if name else ""
        if isinstance(heads, int) and any(n.startswith(prefix) for n in sharded) and heads % tp_size:
            raise ValueError(f"{owner}: module {name!r}: {attr}={heads} must be divisible by "
                             f"tensor_parallel_size={tp_size} (each rank computes whole heads)")  # fmt: skip
    for name in plan.named(COLWISE):
        child, parent = modules[name], modules[name.rsplit(".", 1)[0] if "." in name else ""]
        dims = [getattr(parent, a) for a in ("head_dim", "attention_head_size") if hasattr(parent, a)]
        head_dim = dims[0] if dims and isinstance(dims[0], int) and not isinstance(parent, nn.MultiheadAttention) else 0
        if isinstance(child, nn.Linear) and head_dim > 0 and child.out_features % (head_dim * tp_size):
            raise ValueError(f"{owner}: module {name!r} ({_describe(child)}): out_features={child.out_features} holds "
                             f"{child.out_features // head_dim} heads of head_dim={head_dim}, which must be divisible by "
                             f"tensor_parallel_size={tp_size} (each rank computes whole heads; grouped key/value "
                             "heads too)")  # fmt: skip


def _head_counts(attention: nn.Module) -> tuple[int | None, int | None]:
    """``(query heads, key/value heads)`` an attention module declares, on itself (``num_heads``,
    ``num_attention_heads``, ``num_key_value_heads``) or on its ``config`` (Phi-3's); ``None`` where it says nothing."""
    config = getattr(attention, "config", None)
    found = []
    for names in (("num_heads", "num_attention_heads"), ("num_key_value_heads",)):
        values = [getattr(o, n, None) for o in (attention, config) for n in names if o is not None]
        found.append(next((v for v in values if isinstance(v, int) and not isinstance(v, bool)), None))
    return found[0], found[1]


def _check_fused_heads(name: str, child: nn.Linear, parent: nn.Module, tp_size: int, owner: str) -> None:
    """A fused ``[q; k; v]`` Linear splits as three equal blocks, each by whole heads: refused with grouped key/value
    heads (Phi-3-medium's ``qkv_proj``: ``H·d`` query rows, ``H_kv·d`` key and value rows), whose blocks differ."""
    heads, kv_heads = _head_counts(parent)
    head_dim = getattr(parent, "head_dim", None)
    if isinstance(heads, int) and kv_heads is not None and kv_heads != heads:
        blocks = f" of {heads * head_dim}, {kv_heads * head_dim} and {kv_heads * head_dim} rows" if \
            isinstance(head_dim, int) else ""  # fmt: skip
        parent_name, local = name.rsplit(".", 1) if "." in name else ("", name)
        out = next((o for f, o in _FUSED if f == local and isinstance(getattr(parent, o, None), nn.Linear)), None)
        instead = {name: REPLICATE, **({f"{parent_name}.{out}" if parent_name else out: REPLICATE} if out else {})}
        raise ValueError(f"{owner}: module {name!r} ({_describe(child)}): a fused query/key/value projection with "
                         f"grouped key/value heads (num_key_value_heads={kv_heads} < num_attention_heads={heads}) "
                         f"holds query, key and value blocks{blocks}; {QKV!r} splits three equal blocks by heads, so "
                         f"it cannot be sharded (replicate the attention: plan dict {instead!r}, or project query, "
                         "key and value with separate q_proj/k_proj/v_proj Linear layers, which split grouped "
                         "heads)")  # fmt: skip
    on_config = not any(hasattr(parent, n) for n in ("num_heads", "num_attention_heads"))  # else checked below
    if on_config and isinstance(heads, int) and heads % tp_size:
        parent_name = name.rsplit(".", 1)[0] if "." in name else ""
        raise ValueError(f"{owner}: module {parent_name!r}: config.num_attention_heads={heads} must be divisible by "
                         f"tensor_parallel_size={tp_size} (each rank computes whole heads)")  # fmt: skip


def _check_attention(name: str, child: nn.Module, tp_size: int, owner: str) -> None:
    if not isinstance(child, nn.MultiheadAttention):
        raise ValueError(f"{owner}: module {name!r} is {type(child).__name__}; {HEADS!r} applies to "
                         "nn.MultiheadAttention only")  # fmt: skip
    if child.num_heads % tp_size:
        raise ValueError(f"{owner}: module {name!r} (nn.MultiheadAttention): num_heads={child.num_heads} must be "
                         f"divisible by tensor_parallel_size={tp_size} (each rank computes whole heads)")  # fmt: skip
    if not child._qkv_same_embed_dim or child.bias_k is not None or child.add_zero_attn:
        raise ValueError(f"{owner}: module {name!r} (nn.MultiheadAttention): kdim/vdim different from embed_dim, "
                         "add_bias_kv=True and add_zero_attn=True are not split by heads; replicate it (plan dict "
                         f"{{{name!r}: 'replicate'}})")  # fmt: skip


def _sharded_dim(child: nn.Module, placement: str) -> tuple[str, int]:
    if isinstance(child, nn.Linear):
        return ("out_features", child.out_features) if placement == COLWISE else ("in_features", child.in_features)
    return ("embedding_dim", child.embedding_dim) if placement == COLWISE else ("num_embeddings", child.num_embeddings)


def _describe(child: nn.Module) -> str:
    if isinstance(child, nn.Linear):
        return f"Linear {child.in_features}->{child.out_features}"
    return f"Embedding {child.num_embeddings}x{child.embedding_dim}"


def _sample(modules: dict[str, nn.Module], count: int = 6) -> str:
    names = [n for n in modules if n][:count]
    return ", ".join(repr(n) for n in names) + (", ..." if len(modules) > count + 1 else "")
