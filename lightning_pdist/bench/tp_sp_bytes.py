"""The byte model of sequence parallelism (``TensorParallelStrategy(sequence_parallel=True)``) on an encoder.

:mod:`lightning_pdist.tensor_parallel.cost` has no sequence-parallel model; this one follows the collectives of
:mod:`lightning_pdist.tensor_parallel.comm` as the strategy issues them (Korthikanti et al., 2022), per rank and
optimizer step, in the meter's labels. Notation as in ``cost``: ``t`` the TP degree, ``e`` bytes per element,
``n = e·B·L·H`` one (B, L, H) activation, ``AG(n/t) = (t-1)·n/t`` (an all-gather of this rank's ``L/t``
positions), ``RS(n)`` a reduce-scatter of ``n``: ``(t-1)/t · n`` on NCCL, but gloo has none, so the strategy
all-reduces the whole tensor and keeps its chunk: ``AR(n, t) = 2(t-1)/t · n`` (floored as the meter floors).

Each all-reduce of TP (one ``f`` before a column-wise pair, one ``g`` after a row-wise layer) becomes an
all-gather and a reduce-scatter, one each way. Per *layer application* (BERT: query/key/value share one gather,
as the FFN's first linear does)::

    forward   2 · AG(n/t)  gather the sequence before attention and FFN in
              2 · RS(n)    scatter the row-wise outputs (attention output, FFN output)
    backward  2 · RS(n)    the gathered inputs' gradients
              2 · AG(n/t)  the scattered outputs' gradients

Per call of the stack: the first block's input is split (backward: ``AG(n/t)``) and the stack's output gathered
(forward: ``AG(n/t)``). Once per step the partial gradients (LayerNorms inside the stack, row-wise biases:
``P_partial`` parameters, each counted once however often a shared block runs) are summed in one flat all-reduce::

    tp_all_gather     = (4 · layers + 2) · AG(n/t)
    tp_reduce_scatter = 4 · layers · RS(n)
    tp_all_reduce     = AR(e · P_partial, t)
"""

from __future__ import annotations

from typing import Any

from lightning_pdist.tensor_parallel.cost import StepBytes


def sp_encoder_bytes(batch_size: int, seq_len: int, hidden_size: int, num_layers: int, tp_size: int,
                     partial_params: int, bytes_per_element: int = 4, gloo: bool = True) -> StepBytes:  # fmt: skip
    """The module docstring's model; ``seq_len`` must be divisible by ``tp_size`` (as the strategy requires)."""
    for name, value, low in (("batch_size", batch_size, 1), ("seq_len", seq_len, 1), ("hidden_size", hidden_size, 1),
                             ("num_layers", num_layers, 1), ("tp_size", tp_size, 1), ("partial_params", partial_params, 0)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"sp_encoder_bytes({name}={value!r}): {name} must be an int >= {low}")
    if seq_len % tp_size:
        raise ValueError(f"sp_encoder_bytes(seq_len={seq_len}): seq_len must be divisible by tp_size={tp_size}")
    t, n = tp_size, bytes_per_element * batch_size * seq_len * hidden_size
    gather = (t - 1) * (n // t)
    scatter = (2 * (t - 1) * n) // t if gloo else ((t - 1) * n) // t
    return StepBytes(tp_all_gather=(4 * num_layers + 2) * gather, tp_reduce_scatter=4 * num_layers * scatter,
                            tp_all_reduce=(2 * (t - 1) * bytes_per_element * partial_params) // t)  # fmt: skip


def partial_params(module: Any, plan: Any) -> int | str:
    """Parameters whose gradient sequence parallelism sums once per step (LayerNorms in the covered stacks, biases
    of row-wise layers there), each counted once; or the strategy's refusal of ``module`` as text."""
    from torch import nn

    from lightning_pdist.tensor_parallel.shard import sequence_parallel_encoders

    try:
        stacks = sequence_parallel_encoders(module, plan, "TensorParallelStrategy")
    except ValueError as err:
        return str(err)
    placed, seen, total = plan.as_dict(), set(), 0
    for stack_name, (stack, attr) in stacks.items():
        region = stack_name if attr is None else (f"{stack_name}.{attr}" if stack_name else attr)
        for name, child in (stack if attr is None else getattr(stack, attr)).named_modules(prefix=region):
            params = [child.weight, child.bias] if isinstance(child, nn.LayerNorm) else \
                [child.bias] if isinstance(child, nn.Linear) and placed.get(name) == "rowwise" else []  # fmt: skip
            for p in params:
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel()
    return total
