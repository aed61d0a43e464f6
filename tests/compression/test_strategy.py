"""Compression through the Trainer (fork launcher, 2 gloo ranks) against plain-torch references written here:
PdistStrategy(compression=TopK) per step, BMUF(compression=TopK) per block, and exact resumes from mid-run checkpoints."""

import math

import torch
from _helpers import (SnapshotParams, TinyRegression, assert_matches_reference, fit, load_snapshot, make_net,
                      rank_batches, reference_replicas, regression_data)  # fmt: skip
from averaging.test_bmuf import _bmuf_reference
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn

import lightning_pdist  # noqa: F401  (registers the names)
from lightning_pdist import BMUFStrategy, PdistStrategy
from lightning_pdist.compression import DGC, TopK
from lightning_pdist.core import rank_files

SIZES = [32, 8, 16, 2]  # make_net's parameters, in module.parameters() order
LR = 0.1


def topk_ef(xs, ratio):
    """Per tensor of the flat ``xs`` (SIZES): the top-k of |x| (k = ceil(ratio·d)); returns the sparse flat vector."""
    out = []
    for x in torch.split(xs, SIZES):
        k = math.ceil(ratio * x.numel())
        s = torch.zeros_like(x)
        idx = x.abs().topk(k).indices
        s[idx] = x[idx]
        out.append(s)
    return torch.cat(out)


def reference_topk_sgd(world, steps, ratio, n):
    """Plain torch: every rank's gradient on its own batches, x = g + e, sent = topk(x), e ← x − sent,
    the mean of the sent vectors applied with SGD on every rank. Returns {step: [flat params] * world}."""
    data, net = regression_data(n), make_net()
    per_epoch = len(rank_batches(data, 0, world, 4))
    residual = [torch.zeros(sum(SIZES)) for _ in range(world)]
    history = {}
    for t in range(1, steps + 1):
        epoch, i = divmod(t - 1, per_epoch)
        sent = []
        for r in range(world):
            x, y = rank_batches(data, r, world, 4, epoch)[i]
            net.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            v = torch.cat([p.grad.reshape(-1) for p in net.parameters()]) + residual[r]
            sent.append(topk_ef(v, ratio))
            residual[r] = v - sent[-1]
        mean = sum(s / world for s in sent)
        with torch.no_grad():
            flat = torch.nn.utils.parameters_to_vector(net.parameters()) - LR * mean
            torch.nn.utils.vector_to_parameters(flat, net.parameters())
        history[t] = [flat.clone() for _ in range(world)]
    return history


def test_topk_ratio_1_is_ddp_and_topk_follows_its_reference_and_resumes_exactly(tmp_path):
    """TopK(1) steps exactly as synchronous SGD; TopK(0.25) with error feedback matches the plain-torch reference
    at every step, and a run resumed from the step-3 checkpoint (residuals from the per-rank files) ends where the
    uninterrupted run does."""
    ddp, run, resumed = tmp_path / "ddp", tmp_path / "run", tmp_path / "resumed"
    for d in (ddp, run, resumed):
        d.mkdir()
    fit(PdistStrategy(compression=TopK(1.0), start_method="fork"), TinyRegression(lr=LR), max_steps=5,
        callbacks=[SnapshotParams(ddp)])  # fmt: skip
    assert_matches_reference(ddp, reference_replicas(2, 5, None, period=1, warmup=5, lr=LR), world=2)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=False)
    fit(PdistStrategy(compression=TopK(0.25), start_method="fork"), TinyRegression(lr=LR, n=24), max_steps=7,
        callbacks=[SnapshotParams(run), checkpoint], enable_checkpointing=True, limit_val_batches=1)  # fmt: skip
    assert_matches_reference(run, reference_topk_sgd(2, 7, 0.25, 24), world=2, atol=1e-6)
    first = tmp_path / "ckpts" / "epoch=0-step=3.ckpt"
    saved = [torch.load(rank_files.path_for(first, r, 2), weights_only=False)["compression"] for r in range(2)]
    assert not torch.equal(saved[0]["tensors"]["residual"][0], saved[1]["tensors"]["residual"][0])
    fit(PdistStrategy(compression=TopK(0.25), start_method="fork"), TinyRegression(lr=LR, n=24), max_steps=7,
        callbacks=[SnapshotParams(resumed)], ckpt_path=str(first), limit_val_batches=1)  # fmt: skip
    for rank in range(2):
        assert torch.equal(load_snapshot(resumed, rank, 7), load_snapshot(run, rank, 7))


def _bmuf_topk_reference(ratio, bm=0.5):
    bmuf = _bmuf_reference(bm, 1.0, True)
    residual = {}

    def sync(flats, state):
        anchor = state.get("anchor", torch.cat([p.detach().reshape(-1) for p in make_net().parameters()]))
        sent = []
        for r, w in enumerate(flats):
            x = w - anchor + residual.get(r, torch.zeros_like(w))
            sent.append(topk_ef(x, ratio))
            residual[r] = x - sent[-1]
        combined = anchor + sum(s / len(flats) for s in sent)
        return bmuf([combined] * len(flats), state)  # BMUF's G = A − mean(W) with the compressed mean

    return sync


def test_bmuf_with_topk_matches_bmuf_and_its_reference_and_resumes_mid_block(tmp_path):
    """BMUF+TopK(1) equals BMUF; BMUF+TopK(0.5) (the model delta since the block start, error feedback per rank)
    matches the plain-torch reference; resumed from a mid-block checkpoint it ends where the uninterrupted run does."""
    full, run, resumed = tmp_path / "full", tmp_path / "run", tmp_path / "resumed"
    for d in (full, run, resumed):
        d.mkdir()
    fit(BMUFStrategy(period=2, block_momentum=0.5, compression=TopK(1.0), start_method="fork"), TinyRegression(),
        max_steps=6, callbacks=[SnapshotParams(full)])  # fmt: skip
    assert_matches_reference(full, reference_replicas(2, 6, _bmuf_reference(0.5, 1.0, True), 2), world=2, atol=1e-6)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=False)
    strategy = lambda: BMUFStrategy(period=2, block_momentum=0.5, compression=TopK(0.5), start_method="fork")  # noqa: E731
    fit(strategy(), TinyRegression(n=24), max_steps=7, callbacks=[SnapshotParams(run), checkpoint],
        enable_checkpointing=True, limit_val_batches=1)  # fmt: skip
    assert_matches_reference(run, reference_replicas(2, 7, _bmuf_topk_reference(0.5), 2, n=24), world=2, atol=1e-6)
    fit(strategy(), TinyRegression(n=24), max_steps=7, callbacks=[SnapshotParams(resumed)],
        ckpt_path=str(tmp_path / "ckpts" / "epoch=0-step=3.ckpt"), limit_val_batches=1)  # step 3: mid-block
    for rank in range(2):
        assert torch.equal(load_snapshot(resumed, rank, 7), load_snapshot(run, rank, 7))


def test_registered_names_carry_their_compressors():
    for name, kind in (("topk", TopK), ("dgc", DGC)):
        entry = StrategyRegistry[name]
        assert entry["strategy"] is PdistStrategy and isinstance(entry["init_params"]["compression"], kind)
    for name in ("qsgd", "terngrad", "powersgd", "topk_spawn", "dgc_find_unused_parameters_true"):
        assert name in StrategyRegistry


def test_powersgd_and_qsgd_train_by_name_with_their_bytes_counted(tmp_path):
    """``strategy="powersgd"`` (torch's hook underneath) and ``strategy="qsgd"`` train; both ranks end equal; PowerSGD's
    logged bytes are the flag plus plain all-reduce for step 1 (start_iter=2) and P/Q/raw all-reduces after."""
    from lightning_pdist.compression.powersgd import powersgd_bytes
    from lightning_pdist.core.accounting import all_reduce_bytes

    for name in ("powersgd", "qsgd"):
        out = tmp_path / name
        out.mkdir()
        trainer = fit(f"{name}_fork", TinyRegression(), max_steps=4, callbacks=[SnapshotParams(out)])
        final = [load_snapshot(out, r, "final") for r in range(2)]
        assert torch.isfinite(final[0]).all() and torch.equal(final[0], final[1])
        if name == "powersgd":
            shapes = [p.shape for p in make_net().parameters()]
            flag = all_reduce_bytes(4, 2)
            expected = 2 * (flag + all_reduce_bytes(4 * sum(SIZES), 2)) + 2 * (flag + powersgd_bytes(shapes, 1, 2.0, 2))
            assert float(trainer.callback_metrics["pdist/comm_bytes_total"]) == expected
