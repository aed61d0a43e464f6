"""Which modules sequence parallelism covers and which replicated parameters see only part of the work: the rules
:mod:`.shard` applies and :mod:`.cost` counts, as values (no process group).

Sequence parallelism covers every ``nn.TransformerEncoder`` with sharded layers and transformers' stacks
(:data:`HF_STACKS`: BERT-style and ALBERT encoders, LLaMA-style decoders); :func:`sequence_parallel_encoders` finds
them or names what it cannot cover. A norm there (:func:`is_norm`) runs on this rank's positions, and a norm over each
head's features inside attention (:func:`per_head_norms`) on this rank's heads: their gradients are partial sums.
"""

from __future__ import annotations

from torch import nn

from lightning_pdist.tensor_parallel.plan import _QKV, COLWISE, HEADS, QKV, ROWWISE, TPPlan

__all__ = ["HF_STACKS", "is_norm", "parent_kind", "per_head_norms", "sequence_parallel_encoders"]

#: transformers' stacks sequence parallelism covers, by their blocks' ModuleList: (children with parameters that run
#: before the first block, on the whole sequence, replicated: ALBERT's embedding projection, LLaMA's embedding;
#: children that run after the last block, on this rank's positions: LLaMA's final norm)
HF_STACKS = {"layer": ((), ()), "albert_layer_groups": (("embedding_hidden_mapping_in",), ()),
             "layers": (("embed_tokens",), ("norm",))}  # fmt: skip
#: names of cross-attention modules: their keys and values come from outside the stack
_CROSS = ("crossattention", "encoder_attn", "cross_attn")


def is_norm(module: nn.Module) -> bool:
    """A per-position norm whose replicated weights sequence parallelism sums over the group: ``nn.LayerNorm``,
    ``nn.RMSNorm``, or a leaf ``*LayerNorm``/``*RMSNorm`` (transformers' ``LlamaRMSNorm``) holding only
    ``weight``/``bias``."""
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return True
    own = {n for n, _ in module.named_parameters(recurse=False)}
    return type(module).__name__.endswith(("RMSNorm", "LayerNorm")) and not list(module.children()) and \
        own <= {"weight", "bias"}  # fmt: skip


def _sharded_inside(prefix: str, placed: dict[str, str]) -> bool:
    return any(n.startswith(prefix) and p != "replicate" for n, p in placed.items())


def parent_kind(parent_name: str, modules: dict[str, nn.Module], placed: dict[str, str]) -> str:
    """How a transformers stack gathers the sequence for the column-wise layers of ``parent_name``: ``"albert"``
    (ALBERT's attention: at its projections, :func:`sequence_parallel_albert_attention`), ``"attention"`` (query/key/
    value or a fused qkv: at the module's input, since it shapes heads by its input's length), ``"ffn"`` (at the
    layers' own input)."""
    parent = modules[parent_name]
    if type(parent).__name__ == "AlbertAttention":
        return "albert"
    prefix = f"{parent_name}." if parent_name else ""
    qkv = any(all(placed.get(prefix + n) == COLWISE for n in names) for names in _QKV)
    fused = any(placed.get(prefix + c) == QKV for c, _ in parent.named_children())
    return "attention" if qkv or fused else "ffn"


def per_head_norms(parent: nn.Module) -> list[nn.Module]:
    """Norms inside an attention module over one head's features (Qwen3's ``q_norm``/``k_norm``: weight of size
    ``head_dim``): each rank applies them to its own heads only, so their gradient is a partial sum over the heads,
    summed over the group once per step like sequence parallelism's."""
    head_dim = getattr(parent, "head_dim", None)
    return [m for m in parent.children() if is_norm(m) and isinstance(head_dim, int) and
            getattr(m, "weight", None) is not None and tuple(m.weight.shape) == (head_dim,)]  # fmt: skip


def _check_stack_parents(region: str, modules: dict[str, nn.Module], placed: dict[str, str], owner: str) -> None:
    """An attention module sees the whole sequence (gathered at its input); one that also holds its row-wise output
    projection returns that projection's reduce-scatter, this rank's positions (LLaMA's ``self_attn``). One that holds
    a norm too has the residual inside (ALBERT's layout): only ALBERT's own is rewritten for that; others refused."""
    parents = dict.fromkeys(n.rsplit(".", 1)[0] for n, p in placed.items() if p in (COLWISE, QKV) and
                            n.startswith(region))  # fmt: skip
    for parent in parents:
        kind, prefix = parent_kind(parent, modules, placed), f"{parent}."
        rows = [n for n, p in placed.items() if p == ROWWISE and n.startswith(prefix)]
        if kind == "albert":
            missing = [c for c in ("query", "key", "value", "dense", "LayerNorm", "output_dropout", "attention_dropout")
                       if not hasattr(modules[parent], c)]  # fmt: skip
            if missing or rows != [prefix + "dense"] or any(placed.get(prefix + n) != COLWISE for n in _QKV[0]):
                raise ValueError(f"{owner}: sequence_parallel=True: {parent!r} (AlbertAttention) must hold query/key/"
                                 "value column-wise, dense row-wise, LayerNorm, output_dropout and attention_dropout "
                                 f"(transformers' layout) to be rewritten for sequence parallelism; it has rows {rows} "
                                 f"and lacks {missing}")  # fmt: skip
            continue
        heads = per_head_norms(modules[parent])
        norms = [c for c, m in modules[parent].named_children() if is_norm(m) and all(m is not h for h in heads)]
        if kind == "attention" and rows and norms:
            raise ValueError(f"{owner}: sequence_parallel=True: {parent!r} ({type(modules[parent]).__name__}) holds "
                             f"its column-wise projections, the row-wise {rows[0]!r} and the norm {norms[0]!r}: a "
                             "residual and norm inside an attention module, which sees the whole sequence (only "
                             "ALBERT's AlbertAttention is rewritten for that layout; leave sequence_parallel "
                             "False)")  # fmt: skip


def sequence_parallel_encoders(module: nn.Module, plan: TPPlan, owner: str) -> dict[str, tuple[nn.Module, str | None]]:
    """The stacks sequence parallelism covers, ``{name: (stack, blocks attribute or None)}``: every
    ``nn.TransformerEncoder`` (``None``) and transformers' stacks (a ``layer``, ``albert_layer_groups`` or
    ``layers`` ModuleList: BERT, ALBERT, LLaMA-style decoders, :data:`HF_STACKS`) with sharded layers; torch's
    ``nn.TransformerDecoder`` stays plain TP. ``ValueError`` naming what it cannot cover."""
    modules = dict(module.named_modules())
    placed = plan.as_dict()
    stacks: dict[str, tuple[nn.Module, str | None]] = {}
    for name, m in modules.items():
        prefix = f"{name}." if name else ""
        if any(name.startswith(f"{s}.") or not s for s in stacks) or isinstance(m, nn.TransformerDecoder):
            continue  # inside a stack already found; torch's decoder (cross-attention to the memory) stays plain TP
        if isinstance(m, nn.TransformerEncoder) and _sharded_inside(prefix, placed):
            stacks[name] = (m, None)
            continue
        for attr, (before, after) in HF_STACKS.items():
            blocks = getattr(m, attr, None)
            if isinstance(blocks, nn.ModuleList) and _sharded_inside(f"{prefix}{attr}.", placed):
                others = [c for c, child in m.named_children() if c != attr and c not in before
                          and any(True for _ in child.parameters()) and not (c in after and is_norm(child))]  # fmt: skip
                if others:
                    raise ValueError(f"{owner}: sequence_parallel=True: {name!r} ({type(m).__name__}) holds "
                                     f"{others[0]!r} with parameters beside its blocks; only transformers' BERT/ALBERT "
                                     "encoder stacks, LLaMA-style decoder stacks and nn.TransformerEncoder are "
                                     "covered")  # fmt: skip
                _check_stack_parents(f"{prefix}{attr}.", modules, placed, owner)
                stacks[name] = (m, attr)
                break
    if not stacks:
        raise ValueError(f"{owner}: sequence_parallel=True shards the LayerNorm/dropout regions of "
                         f"nn.TransformerEncoder stacks, transformers' BERT/ALBERT encoders and LLaMA-style decoders, "
                         f"and {type(module).__name__} has none with sharded layers (torch's nn.TransformerDecoder "
                         "and cross-attention are not covered); leave it False")  # fmt: skip
    for stack_name, (stack, attr) in stacks.items():
        region = stack_name if attr is None else (f"{stack_name}.{attr}" if stack_name else attr)
        for name, child in (stack if attr is None else getattr(stack, attr)).named_modules(prefix=region):
            inside_attention = name.endswith(".out_proj") and placed.get(name.rsplit(".", 1)[0]) == HEADS
            if name.rsplit(".", 1)[-1] in _CROSS:
                raise ValueError(f"{owner}: sequence_parallel=True: {name!r} (cross-attention) is not covered; its "
                                 "keys and values come from outside the stack (leave sequence_parallel False)")  # fmt: skip
            if isinstance(child, (nn.Linear, nn.MultiheadAttention)) and not inside_attention and \
                    placed.get(name, "replicate") == "replicate":  # fmt: skip
                raise ValueError(f"{owner}: sequence_parallel=True: module {name!r} ({type(child).__name__}) inside "
                                 f"the sequence-parallel {stack_name!r} is not sharded; a replicated layer there would "
                                 "see only this rank's positions (shard it in the plan, or leave sequence_parallel "
                                 "False)")  # fmt: skip
            own = [p for p, _ in child.named_parameters(recurse=False)]
            if own and not isinstance(child, (nn.Linear, nn.MultiheadAttention)) and not is_norm(child):
                raise ValueError(f"{owner}: sequence_parallel=True: module {name!r} ({type(child).__name__}) inside "
                                 f"the sequence-parallel {stack_name!r} has parameters and is neither a sharded "
                                 "layer nor a LayerNorm/RMSNorm; its gradient would come from this rank's positions "
                                 "only (leave sequence_parallel False)")  # fmt: skip
    return stacks
