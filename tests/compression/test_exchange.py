"""The compressors' mean on 2 real gloo ranks, against plain-torch references written here (one launch)."""

import math

import numpy as np
import torch
import torch.distributed as dist
import zstandard
from _ranks import run_ranks

from lightning_pdist.compression import BF16, DGC, FP16, QSGD, RandomK, Sign, TernGrad, TopK
from lightning_pdist.core.accounting import CommMeter

SHAPES = [(5, 7), (3,)]
STEPS = 4


def grads(rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    return [torch.randn(s, generator=g) for s in SHAPES]


def coded_len(indices):
    """The coded index stream's length, from numpy and zstandard directly (the method card's recipe)."""
    gaps = np.diff(indices, prepend=-1) - 1
    data = np.ascontiguousarray(gaps.astype("<u4").view(np.uint8).reshape(-1, 4).T).tobytes()
    return len(zstandard.ZstdCompressor(level=3, write_checksum=False, write_content_size=True,
                                        write_dict_id=False).compress(data))  # fmt: skip


def reference_topk(world, ratio, momentum=0.0):
    """Top-k with error feedback (momentum 0) / DGC's momentum correction and masking, every rank simulated."""
    u = [[torch.zeros(s) for s in SHAPES] for _ in range(world)]
    v = [[torch.zeros(s) for s in SHAPES] for _ in range(world)]
    outs, wire = [], []
    for t in range(STEPS):
        sparse, step_bytes = [], []
        for r in range(world):
            per, positions = [], []
            for i, g in enumerate(grads(r, t)):
                u[r][i] = momentum * u[r][i] + g
                v[r][i] = v[r][i] + u[r][i]
                k = math.ceil(ratio * g.numel())
                idx = v[r][i].reshape(-1).abs().topk(k).indices.sort().values
                s = torch.zeros(g.numel())
                s[idx] = v[r][i].reshape(-1)[idx]
                per.append(s.view(g.shape))
                positions.append(idx + sum(math.prod(x) for x in SHAPES[:i]))
                u[r][i].reshape(-1)[idx] = 0.0
                v[r][i].reshape(-1)[idx] = 0.0
            sparse.append(per)
            k_all = sum(p.numel() for p in positions)
            step_bytes.append((world - 1) * (16 + 4 + coded_len(torch.cat(positions).numpy()) + 4 * k_all))
        outs.append([sum(sparse[r][i] / world for r in range(world)) for i in range(len(SHAPES))])
        wire.append(step_bytes)
    return outs, v, wire


def run(c, rank, steps=STEPS, bad_at=None):
    state, meter, outs = c.new_state(), CommMeter(), []
    for t in range(steps):
        g = grads(rank, t)
        if bad_at == (rank, t):
            g[1][0] = float("nan")
        outs.append(c.mean(g, [0, 1], state, None, meter, "x"))
    return outs, state, meter


def checks(rank, world):
    # ratio 1 is the all-reduce: the same bits as dist.all_reduce of g / N (what DDP does)
    for c in (TopK(1.0), RandomK(1.0, seed=3)):
        outs, _, _ = run(c, rank)
        for t, out in enumerate(outs):
            for o, g in zip(out, grads(rank, t)):
                expected = g / world
                dist.all_reduce(expected)
                assert torch.equal(o, expected), (c, t)
    # top-k with error feedback, and DGC, against the reference; measured bytes against the payload model
    for c, momentum in ((TopK(0.3), 0.0), (DGC(0.3, momentum=0.0), 0.0), (DGC(0.3, momentum=0.9), 0.9)):
        outs, state, meter = run(c, rank)
        ref, residual, wire = reference_topk(world, 0.3, momentum)
        for t in range(STEPS):
            for o, e in zip(outs[t], ref[t]):
                assert torch.equal(o, e), (c, t)
        for i in range(len(SHAPES)):
            assert torch.equal(state.tensors["residual"][i], residual[rank][i]), (c, i)
        assert meter.total_bytes == sum(w[rank] for w in wire), (c, meter.total_bytes, wire)
    # the fixed-size formats: bytes = the payload model
    d, T = sum(math.prod(s) for s in SHAPES), len(SHAPES)
    k = sum(math.ceil(0.25 * math.prod(s)) for s in SHAPES)
    models = {TernGrad(): (world - 1) * (16 + 4 * T + math.ceil(d / 4)), Sign(): (world - 1) * (16 + 4 * T + math.ceil(d / 8)),
              RandomK(0.25): 2 * (world - 1) * 4 * (k + 1) // world, FP16(): 2 * (world - 1) * 2 * (d + 1) // world,
              BF16(): 2 * (world - 1) * 2 * (d + 1) // world}  # fmt: skip
    for c, per_step in {**models, QSGD(4): None}.items():
        outs, _, meter = run(c, rank)
        if per_step is not None:
            assert meter.total_bytes == STEPS * per_step, (c, meter.total_bytes, per_step)
        for out in outs:  # every rank decodes the same aggregate (its own payload included)
            for o in out:
                other = o.clone()
                dist.broadcast(other, src=0)
                assert torch.equal(o, other), c
    # a NaN on rank 1 at step 2: None on every rank, the residual left as it was
    outs, state, _ = run(TopK(0.3), rank, steps=3, bad_at=(1, 2))
    assert outs[2] is None and outs[1] is not None
    _, before, _ = run(TopK(0.3), rank, steps=2)
    for i in range(T):
        assert torch.equal(state.tensors["residual"][i], before.tensors["residual"][i])


def test_compressed_means_match_the_references_on_two_ranks(tmp_path):
    run_ranks(checks, 2, tmp_path)
