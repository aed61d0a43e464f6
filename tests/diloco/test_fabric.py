"""Tier 3: DiLoCo and Streaming DiLoCo under Lightning Fabric (2 forked CPU ranks) against plain torch, resumed."""

import torch
from _diloco_reference import diloco_reference, nesterov
from _fabric_loop import launch, train

from lightning_pdist.fabric import DiLoCoFabricStrategy, StreamingDiLoCoFabricStrategy

STEPS = 10


def _check(make, reference_kwargs, tmp_path):
    """Every replica after every optimizer.step() and the final global model equal plain torch; a run resumed from
    fabric.save after step 4 continues exactly."""
    path = tmp_path / "ckpt"
    history = launch(make(), lambda fabric: train(fabric, STEPS, save_at=4, path=path, finish=True))
    resumed = launch(make(), lambda fabric: train(fabric, STEPS, path=path, resume=True, finish=True))
    reference, final = diloco_reference(2, STEPS, outer=nesterov(), **reference_kwargs)
    for t in range(1, STEPS + 1):
        for r in range(2):
            torch.testing.assert_close(torch.from_numpy(history[t][r]), reference[t][r], atol=1e-6, rtol=0)
            if t > 4:
                torch.testing.assert_close(torch.from_numpy(resumed[t][r]), reference[t][r], atol=1e-6, rtol=0)
    for r in range(2):
        torch.testing.assert_close(torch.from_numpy(history["final"][r]), final, atol=1e-6, rtol=0)
        torch.testing.assert_close(torch.from_numpy(resumed["final"][r]), final, atol=1e-6, rtol=0)


def test_diloco_fabric_matches_reference_and_resumes_mid_round(tmp_path):
    _check(lambda: DiLoCoFabricStrategy(sync_every=3, start_method="fork"), {"H": 3}, tmp_path)


def test_streaming_fabric_matches_reference_and_resumes_mid_overlap(tmp_path):
    """P=2, H=4, τ=1, α=0.5, int8: fragment 0 starts after step 4 and merges after 5 (the save falls in between)."""
    _check(lambda: StreamingDiLoCoFabricStrategy(sync_every=4, num_fragments=2, overlap_steps=1, fragment_alpha=0.5,
                                                 quantize="int8", start_method="fork"),
           {"H": 4, "P": 2, "tau": 1, "alpha": 0.5, "bits": 8}, tmp_path)  # fmt: skip
