"""Apply a :class:`~lightning_pdist.tensor_parallel.plan.TPPlan` to a module over the tensor-parallel mesh.

Linear layers and ``nn.MultiheadAttention`` get the plain-tensor layers of :mod:`.layers`; the column-wise
``nn.Linear`` children of one module share one :class:`~lightning_pdist.tensor_parallel.layers.SharedInput`
(BERT's query, key and value: one backward all-reduce for the three); ``nn.Embedding``
placements and the hybrid plan's batch gather use ``torch.distributed.tensor.parallel`` styles. Everything
changed is recorded in a :class:`~lightning_pdist.tensor_parallel.layers.Sharding`, which
:func:`~lightning_pdist.tensor_parallel.layers.unshard` undoes.

Sequence parallelism (``sequence_parallel=True``) covers every ``nn.TransformerEncoder`` with sharded layers, and
transformers' stacks (:data:`HF_STACKS`): BERT-style and ALBERT encoders, LLaMA-style causal decoders (RMSNorm,
gated FFN, grouped key/value heads). The stack's input is split along the sequence at the first layer, its norms,
dropouts and residual additions run on ``L / t`` positions per rank, its sharded layers all-gather / reduce-scatter
along the sequence instead of the all-reduces, and its output is gathered. Every ``nn.Linear`` and attention inside
must be sharded (a replicated one would see only this rank's positions); cross-attention is refused.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInputOutput, RowwiseParallel
from torch.distributed.tensor.parallel import parallelize_module

from lightning_pdist.tensor_parallel.comm import TPComm
from lightning_pdist.tensor_parallel.layers import SharedInput, Sharding, local_head_counts
from lightning_pdist.tensor_parallel.layers import sequence_parallel_albert_attention
from lightning_pdist.tensor_parallel.layers import sequence_parallel_encoder, sequence_parallel_norm
from lightning_pdist.tensor_parallel.layers import sequence_parallel_stack, shard_attention, shard_linear
from lightning_pdist.tensor_parallel.plan import COLWISE, ELEMENTWISE, HEADS, QKV, ROWWISE, TPPlan
from lightning_pdist.tensor_parallel.regions import HF_STACKS, is_norm, parent_kind, per_head_norms
from lightning_pdist.tensor_parallel.regions import sequence_parallel_encoders

__all__ = ["apply_plan", "is_norm", "parent_kind", "per_head_norms", "sequence_parallel_encoders"]

_DTENSOR_STYLES = {COLWISE: ColwiseParallel, ROWWISE: RowwiseParallel}


class _HookKey:
    """A removable entry of a module's hook dict (``parallelize_module`` keeps no handles)."""

    def __init__(self, hooks: dict, key: int) -> None:
        self.hooks, self.key = hooks, key

    def remove(self) -> None:
        self.hooks.pop(self.key, None)


def _hook_dicts(module: nn.Module) -> list[dict]:
    return [module._forward_pre_hooks, module._forward_hooks]


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
            for after in HF_STACKS[attr][1]:  # after the last block, before the gather: this rank's positions
                if isinstance(getattr(enc, after, None), nn.Module) and is_norm(getattr(enc, after)):
                    sequence_parallel_norm(getattr(enc, after), sharding)
        for name, child in region:
            seq_dims[name] = dim
            if is_norm(child):
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
            if placement in (COLWISE, QKV):
                parent_name = name.rsplit(".", 1)[0] if "." in name else ""
                gate = shared.get(parent_name)
                if gate is None:
                    gate = shared[parent_name] = SharedInput(comm, seq_dims.get(name))
                    gate.install(modules[parent_name], sharding)
                    kind = parent_kind(parent_name, modules, plan.as_dict())
                    if kind == "attention":
                        for norm in per_head_norms(modules[parent_name]):
                            sequence_parallel_norm(norm, sharding)  # this rank's heads: a partial sum, as in SP
                    if placement == QKV:
                        local_head_counts(modules[parent_name], comm.size, sharding)
                    if any(name.startswith(r) for r in hf_regions) and kind == "albert":
                        sequence_parallel_albert_attention(modules[parent_name], gate, sharding)
                    elif any(name.startswith(r) for r in hf_regions) and kind == "attention":
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
