"""DTensorCommMeter sees every collective DTensor issues (torch's CommDebugMode as the witness) and counts its bytes."""

from __future__ import annotations

import os

import pytest
import torch
from _ranks import run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInputOutput, RowwiseParallel
from torch.distributed.tensor.parallel import parallelize_module

from lightning_pdist.core.accounting import CommMeter, all_gather_bytes, all_reduce_bytes
from lightning_pdist.tensor_parallel.meter import DTensorCommMeter

_FUNCOL = torch.ops.c10d_functional
KINDS = {"all_reduce": (_FUNCOL.all_reduce,), "all_gather": (_FUNCOL.all_gather_into_tensor,),
         "reduce_scatter": (_FUNCOL.reduce_scatter_tensor,)}  # fmt: skip


def _rank(rank: int, world: int, out: str) -> None:
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    # a column/row pair under a batch all-gather (the hybrid's shape): all-reduces and all-gathers, forward and back
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    parallelize_module(net, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    outer = nn.Sequential(net)
    parallelize_module(outer, mesh, {"0": PrepareModuleInputOutput(
        input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),), use_local_input=True,
        output_layouts=(Replicate(),), desired_output_layouts=(Shard(0),), use_local_output=True)})  # fmt: skip
    x = torch.randn(3, 8)
    meter = CommMeter()
    with CommDebugMode() as witness, DTensorCommMeter(meter) as counted:
        outer(x).square().sum().backward()
        # a reduce-scatter (Partial -> Shard), which gloo runs as an all-reduce of the whole tensor
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.placement_types import Partial
        DTensor.from_local(torch.ones(4, 6), mesh, [Partial()]).redistribute(mesh, [Shard(0)]).to_local()
        distribute_tensor(torch.zeros(2), mesh, [Replicate()])  # a broadcast at setup time: not a TP collective
    seen = witness.get_comm_counts()
    torch.save({"calls": dict(counted.calls), "by_kind": meter.by_kind,
                "witness": {k: sum(seen.get(op, 0) for op in ops) for k, ops in KINDS.items()}}, f"{out}.{rank}")


def test_every_dtensor_collective_is_counted_with_its_bytes(tmp_path):
    """2 ranks: the meter's call counts per kind equal CommDebugMode's, and the bytes follow the ring model."""
    out = str(tmp_path / "result")
    run_ranks(_rank, 2, tmp_path, out)
    for rank in range(2):
        result = torch.load(f"{out}.{rank}")
        assert {k: v for k, v in result["calls"].items() if v} == {k: v for k, v in result["witness"].items() if v}
        assert result["calls"]["all_gather"] == 2 and result["calls"]["reduce_scatter"] == 1
        # forward: the batch all-gather (3x8 floats per rank) and the row-wise output all-reduce (6x4, the full batch);
        # backward: the column-wise input-gradient all-reduce (6x8) and the logits' gradient all-gather (3x4)
        assert result["by_kind"]["tp_all_gather"] == all_gather_bytes(3 * 8 * 4, 2) + all_gather_bytes(3 * 4 * 4, 2)
        assert result["by_kind"]["tp_reduce_scatter"] == all_reduce_bytes(4 * 6 * 4, 2)  # gloo: a whole all-reduce


def test_meter_restores_torch_and_refuses_nesting():
    """Leaving the context puts torch's functions back; entering an active meter twice is refused."""
    import torch.distributed._functional_collectives as funcol

    original = funcol.all_reduce
    meter = DTensorCommMeter(CommMeter())
    with meter:
        assert funcol.all_reduce is not original
        with pytest.raises(RuntimeError, match="already active"):
            meter.__enter__()
    assert funcol.all_reduce is original
