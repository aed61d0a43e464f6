"""Apply a :class:`~lightning_pdist.tensor_parallel.plan.TPPlan` to a module over the tensor-parallel mesh.

Linear layers and ``nn.MultiheadAttention`` get the plain-tensor layers of :mod:`.layers`; the column-wise
``nn.Linear`` children of one module share one :class:`~lightning_pdist.tensor_parallel.layers.SharedInput`
(BERT's query, key and value: one backward all-reduce for the three); ``nn.Embedding``
placements and the hybrid plan's batch gather use ``torch.distributed.tensor.parallel`` styles. Everything
changed is recorded in a :class:`~lightning_pdist.tensor_parallel.layers.Sharding`, which
:func:`~lightning_pdist.tensor_parallel.layers.unshard` undoes.

Sequence parallelism (``sequence_parallel=True``) covers every ``nn.TransformerEncoder`` with sharded layers, and
transformers' BERT-style encoder stacks (:data:`HF_STACKS`; ALBERT's is refused, by name): its input is split along the sequence at the
first layer, its LayerNorms, dropouts and residual additions run
on ``L / t`` positions per rank, its sharded layers all-gather / reduce-scatter along the sequence instead of
the all-reduces, and its output is gathered. Every ``nn.Linear`` and attention inside must be sharded (a
replicated one would see only this rank's positions).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInputOutput, RowwiseParallel
from torch.distributed.tensor.parallel import parallelize_module

from lightning_pdist.tensor_parallel.comm import TPComm
from lightning_pdist.tensor_parallel.layers import SharedInput, Sharding, sequence_parallel_encoder
from lightning_pdist.tensor_parallel.layers import sequence_parallel_norm, sequence_parallel_stack, shard_attention
from lightning_pdist.tensor_parallel.layers import shard_linear
from lightning_pdist.tensor_parallel.plan import COLWISE, ELEMENTWISE, HEADS, QKV, ROWWISE, TPPlan

__all__ = ["apply_plan", "sequence_parallel_encoders"]

_DTENSOR_STYLES = {COLWISE: ColwiseParallel, ROWWISE: RowwiseParallel}


class _HookKey:
    """A removable entry of a module's hook dict (``parallelize_module`` keeps no handles)."""

    def __init__(self, hooks: dict, key: int) -> None:
        self.hooks, self.key = hooks, key

    def remove(self) -> None:
        self.hooks.pop(self.key, None)


def _hook_dicts(module: nn.Module) -> list[dict]:
    return [module._forward_pre_hooks, module._forward_hooks]


#: transformers' encoder stacks sequence parallelism covers: the ModuleList of blocks, and the stack's other children
#: with parameters, which run before the first block (ALBERT's embedding projection), replicated on the full sequence
HF_STACKS = {"layer": (), "albert_layer_groups": ("embedding_hidden_mapping_in",)}
# (ALBERT's stack is recognised so that its attention, which holds its row-wise output projection, is refused by name)


def _sharded_inside(prefix: str, placed: dict[str, str]) -> bool:
    return any(n.startswith(prefix) and p != "replicate" for n, p in placed.items())


def _check_stack_parents(name: str, attr: str, modules: dict[str, nn.Module], placed: dict[str, str], owner: str) -> None:
    """transformers' modules shape their heads by their input's length, so the sequence is gathered at the input of
    each column-wise layer's parent; a parent that also holds a row-wise layer (ALBERT's attention, with its output
    projection and residual inside) would mix gathered and sequence-parallel activations: refused, named."""
    region = f"{name}.{attr}." if name else f"{attr}."
    for col in (n for n, p in placed.items() if p == COLWISE and n.startswith(region)):
        parent = col.rsplit(".", 1)[0]
        row = next((n for n, p in placed.items() if p == ROWWISE and n.startswith(f"{parent}.")), None)
        if row is not None:
            raise ValueError(f"{owner}: sequence_parallel=True: {parent!r} ({type(modules[parent]).__name__}) "
                             f"holds the column-wise {col!r} and the row-wise {row!r}; transformers' modules shape "
                             "heads by their input's length, so the sequence is gathered at the input of a "
                             "column-wise layer's parent, which must hold no row-wise layer (BERT's layout; ALBERT's "
                             "attention is not covered)")  # fmt: skip


def sequence_parallel_encoders(module: nn.Module, plan: TPPlan, owner: str) -> dict[str, tuple[nn.Module, str | None]]:
    """The stacks sequence parallelism covers, ``{name: (stack, blocks attribute or None)}``: every
    ``nn.TransformerEncoder`` (``None``) and transformers' BERT/ALBERT-style encoder (a ``layer`` or
    ``albert_layer_groups`` ModuleList, :data:`HF_STACKS`) with sharded layers; ``ValueError`` naming what it cannot."""
    modules = dict(module.named_modules())
    placed = plan.as_dict()
    stacks: dict[str, tuple[nn.Module, str | None]] = {}
    for name, m in modules.items():
        prefix = f"{name}." if name else ""
        if any(name.startswith(f"{s}.") or not s for s in stacks):
            continue  # inside a stack already found
        if isinstance(m, nn.TransformerEncoder) and _sharded_inside(prefix, placed):
            stacks[name] = (m, None)
            continue
        for attr, before in HF_STACKS.items():
            blocks = getattr(m, attr, None)
            if isinstance(blocks, nn.ModuleList) and _sharded_inside(f"{prefix}{attr}.", placed):
                others = [c for c, child in m.named_children() if c != attr and c not in before
                          and any(True for _ in child.parameters())]  # fmt: skip
                if others:
                    raise ValueError(f"{owner}: sequence_parallel=True: {name!r} ({type(m).__name__}) holds "
                                     f"{others[0]!r} with parameters beside its blocks; only transformers' BERT "
                                     "encoder stacks and nn.TransformerEncoder are covered")  # fmt: skip
                _check_stack_parents(name, attr, modules, placed, owner)
                stacks[name] = (m, attr)
                break
    if not stacks:
        raise ValueError(f"{owner}: sequence_parallel=True shards the LayerNorm/dropout regions of "
                         f"nn.TransformerEncoder stacks and transformers' BERT encoders, and "
                         f"{type(module).__name__} has none with sharded layers (decoders are not covered); leave it "
                         "False")  # fmt: skip
    for stack_name, (stack, attr) in stacks.items():
        region = stack_name if attr is None else (f"{stack_name}.{attr}" if stack_name else attr)
        for name, child in (stack if attr is None else getattr(stack, attr)).named_modules(prefix=region):
            inside_attention = name.endswith(".out_proj") and placed.get(name.rsplit(".", 1)[0]) == HEADS
            if name.rsplit(".", 1)[-1] == "crossattention":
                raise ValueError(f"{owner}: sequence_parallel=True: {name!r} (cross-attention) is not covered; its "
                                 "keys and values come from outside the stack (leave sequence_parallel False)")  # fmt: skip
            if isinstance(child, (nn.Linear, nn.MultiheadAttention)) and not inside_attention and \
                    placed.get(name, "replicate") == "replicate":  # fmt: skip
                raise ValueError(f"{owner}: sequence_parallel=True: module {name!r} ({type(child).__name__}) inside "
                                 f"the sequence-parallel {stack_name!r} is not sharded; a replicated layer there would "
                                 "see only this rank's positions (shard it in the plan, or leave sequence_parallel "
                                 "False)")  # fmt: skip
            own = [p for p, _ in child.named_parameters(recurse=False)]
            if own and not isinstance(child, (nn.Linear, nn.MultiheadAttention, nn.LayerNorm)):
                raise ValueError(f"{owner}: sequence_parallel=True: module {name!r} ({type(child).__name__}) inside "
                                 f"the sequence-parallel {stack_name!r} has parameters and is neither a sharded "
                                 "layer nor an nn.LayerNorm; its gradient would come from this rank's positions only "
                                 "(leave sequence_parallel False)")  # fmt: skip
    return stacks


def apply_plan(module: nn.Module, plan: TPPlan, mesh: DeviceMesh, comm: TPComm, sequence_parallel: bool,
               owner: str) -> Sharding:  # fmt: skip
    """Shard ``module`` in place as ``plan`` says (see the module docstring); returns what was changed."""
    sharding = Sharding()
    modules = dict(module.named_modules())
    stacks = sequence_parallel_encoders(module, plan, owner) if sequence_parallel else {}
    seq_dims: dict[str, int] = {}
    for enc_name, (enc, attr) in stacks.items():

        def check(length: int, enc_name: str = enc_name) -> None:
            if length % comm.size:
                raise ValueError(f"{owner}: sequence_parallel=True: the sequence length {length} of the input of "
                                 f"{enc_name!r} must be divisible by tensor_parallel_size={comm.size} (each rank "
                                 "holds length / tensor_parallel_size positions)")  # fmt: skip

        if attr is None:
            dim, region = sequence_parallel_encoder(enc, comm, sharding, check), enc.named_modules(prefix=enc_name)
        else:
            blocks = getattr(enc, attr)
            dim = sequence_parallel_stack(enc, list(blocks), comm, sharding, check, owner)
            region = blocks.named_modules(prefix=f"{enc_name}.{attr}" if enc_name else attr)
        for name, child in region:
            seq_dims[name] = dim
            if isinstance(child, nn.LayerNorm):
                sequence_parallel_norm(child, sharding)
    for name, child in modules.items():
        if isinstance(child, nn.TransformerEncoderLayer) and name + ".self_attn" in plan.as_dict():
            sharding.set_attribute(child, "activation_relu_or_gelu", 0)  # torch's fused fast path: whole weights
        if isinstance(child, nn.TransformerEncoder):
            sharding.set_attribute(child, "use_nested_tensor", False)
    styles: dict[str, Any] = {}
    shared: dict[str, SharedInput] = {}  # parent name -> the one f of its column-wise Linear children
    hf_regions = [f"{n}.{attr}." if n else f"{attr}." for n, (_, attr) in stacks.items() if attr is not None]
    for name, placement in plan.layers:
        child = modules[name]
        if placement == HEADS:
            shard_attention(child, mesh, comm, sharding, seq_dim=seq_dims.get(name))
        elif placement in (COLWISE, ROWWISE, QKV) and isinstance(child, nn.Linear):
            gate = None
            if placement == COLWISE:
                parent_name = name.rsplit(".", 1)[0] if "." in name else ""
                gate = shared.get(parent_name)
                if gate is None:
                    gate = shared[parent_name] = SharedInput(comm, seq_dims.get(name))
                    gate.install(modules[parent_name], sharding)
                    if any(name.startswith(r) for r in hf_regions):
                        gate.enter_at_input(modules[parent_name], sharding)
            shard_linear(child, placement, mesh, comm, sharding, seq_dim=seq_dims.get(name), shared=gate)
        elif placement in _DTENSOR_STYLES:
            styles[name] = _DTENSOR_STYLES[placement]()  # nn.Embedding
        if placement in (COLWISE, ROWWISE, QKV):
            parent = modules[name.rsplit(".", 1)[0]] if "." in name else module
            for sibling in parent.children():
                if isinstance(sibling, ELEMENTWISE) and getattr(sibling, "inplace", False):
                    sharding.set_attribute(sibling, "inplace", False)  # in place on a collective's output: refused
    gather = plan.gather_batch_at
    if gather is not None:
        # The FC stack sees every rank's rows: all-gather its input on dim 0, hand back this rank's rows.
        styles[gather] = PrepareModuleInputOutput(
            input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(Shard(0),), use_local_output=True)  # fmt: skip
    if styles:
        before = {name: [set(d) for d in _hook_dicts(modules[name])] for name in styles}
        parallelize_module(module, mesh, styles)
        for name, keys in before.items():
            for hooks, old in zip(_hook_dicts(modules[name]), keys):
                sharding.hooks += [_HookKey(hooks, key) for key in set(hooks) - old]
    return sharding
