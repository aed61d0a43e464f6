"""Compression under Lightning Fabric (2 forked gloo ranks) against the plain-torch references of test_strategy.py:
``PdistFabricStrategy(compression=TopK)`` per step and ``BMUFFabricStrategy(compression=TopK)`` per block, each
resumed exactly from a mid-run ``fabric.save``; the names and the refusals."""

import pytest
import torch
from _fabric_loop import launch, train
from _helpers import reference_replicas
from compression.test_strategy import _bmuf_topk_reference, reference_topk_sgd
from lightning.fabric import Fabric

import lightning_pdist  # noqa: F401  (registers the names)
from lightning_pdist.compression import DGC, PowerSGD, TopK
from lightning_pdist.core import rank_files
from lightning_pdist.fabric import (BMUFFabricStrategy, EASGDFabricStrategy, LocalSGDFabricStrategy,
                                    PdistFabricStrategy, SignSGDFabricStrategy)  # fmt: skip


def _assert_history(history, reference, steps, atol=1e-6):
    for t in steps:
        for r in range(2):
            torch.testing.assert_close(torch.from_numpy(history[t][r]), reference[t][r], atol=atol, rtol=0,
                                       msg=lambda m: f"rank {r} step {t}: {m}")  # fmt: skip


@pytest.mark.parametrize(
    "make, reference",
    [
        (lambda: PdistFabricStrategy(compression=TopK(0.25), start_method="fork"),
         lambda: reference_topk_sgd(2, 7, 0.25, 64)),
        (lambda: BMUFFabricStrategy(period=2, block_momentum=0.5, compression=TopK(0.5), start_method="fork"),
         lambda: reference_replicas(2, 7, _bmuf_topk_reference(0.5), 2)),
    ],
    ids=["ddp_topk", "bmuf_topk"],
)  # fmt: skip
def test_fabric_compression_follows_its_reference_and_resumes_exactly(tmp_path, make, reference):
    """Every rank's parameters after every step equal the plain-torch reference (error feedback per rank); the
    residuals differ per rank in the per-rank files; a run loaded from the step-3 save (mid-block for BMUF) ends
    bit-identical to the uninterrupted one."""
    path = tmp_path / "ckpt.pt"
    history = launch(make(), lambda fabric: train(fabric, 7, save_at=3, path=path))
    _assert_history(history, reference(), range(1, 8))
    saved = [torch.load(rank_files.path_for(path, r, 2), weights_only=False)["compression"] for r in range(2)]
    assert not torch.equal(saved[0]["tensors"]["residual"][0], saved[1]["tensors"]["residual"][0])
    resumed = launch(make(), lambda fabric: train(fabric, 7, path=path, resume=True))
    assert sorted(resumed) == [4, 5, 6, 7]
    for r in range(2):
        assert (resumed[7][r] == history[7][r]).all()


def test_names_build_the_compressed_fabric_strategy():
    """Fabric(strategy="topk"/"dgc_fork"/...) is PdistFabricStrategy with the Trainer name's compressor."""
    for name, kind in (("topk", TopK), ("dgc_fork", DGC), ("powersgd_spawn", PowerSGD)):
        strategy = Fabric(accelerator="cpu", devices=2, strategy=name).strategy
        assert type(strategy) is PdistFabricStrategy and isinstance(strategy.compression, kind)
    for name in ("qsgd", "terngrad", "topk_find_unused_parameters_true"):
        assert isinstance(Fabric(accelerator="cpu", devices=2, strategy=name).strategy, PdistFabricStrategy)


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: SignSGDFabricStrategy(compression=TopK()), TypeError,
         r"SignSGDFabricStrategy\(compression=TopK\(.*\)\): unknown argument; SignSGDFabricStrategy owns its communication"),
        (lambda: EASGDFabricStrategy(compression=TopK()), TypeError, r"EASGDFabricStrategy\(compression=TopK.*unknown argument"),
        (lambda: PdistFabricStrategy(compression="topk"), TypeError,
         r"PdistFabricStrategy\(compression='topk'\): compression must be None or a compressor"),
        (lambda: LocalSGDFabricStrategy(compression=PowerSGD()), ValueError,
         r"LocalSGDFabricStrategy\(compression=PowerSGD\(.*\)\): LocalSGDFabricStrategy compresses deltas, which PowerSGD cannot carry"),
    ],
)  # fmt: skip
def test_compression_where_a_fabric_strategy_cannot_use_it_is_refused(make, error, message):
    with pytest.raises(error, match=message):
        make()
