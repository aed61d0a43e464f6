"""Tier 3: D-PSGD under Lightning Fabric (4 forked CPU ranks, your own loop) against Lian et al.'s Algorithm 1 in plain
torch (``dpsgd_reference`` of the Trainer tests): every rank after every ``optimizer.step()``, the bytes, the average
in the checkpoint and after ``load_consensus()``, and the exact resume from a mid-run ``fabric.save``."""

import pytest
import torch
from _fabric_loop import launch, train
from _helpers import make_net
from lightning.fabric import Fabric
from tests.decentralized.test_dpsgd import dpsgd_reference, ring

from lightning_pdist.fabric import DecentralizedFabricStrategy

STEPS, WORLD, LR, MOMENTUM = 6, 4, 0.1, 0.5


def test_ring_on_4_ranks_matches_the_rule_saves_the_average_and_resumes_exactly(tmp_path):
    path = tmp_path / "dpsgd.ckpt"

    def run(fabric):
        history = train(fabric, STEPS, lr=LR, save_at=3, path=path, finish=True, momentum=MOMENTUM)
        return history, dict(fabric.strategy.comm_meter.by_kind)

    history, by_kind = launch(DecentralizedFabricStrategy(topology="ring", start_method="fork"), run, devices=WORLD)
    reference = dpsgd_reference(ring(WORLD), STEPS, lr=LR, momentum=MOMENTUM)
    for t in range(1, STEPS + 1):
        for r in range(WORLD):
            torch.testing.assert_close(torch.from_numpy(history[t][r]), reference[t][r], atol=1e-5, rtol=0,
                                       msg=lambda m: f"rank {r} step {t}: {m}")  # fmt: skip
    mean = torch.stack(reference[STEPS]).mean(0)
    for r in range(WORLD):
        torch.testing.assert_close(torch.from_numpy(history["final"][r]), mean, atol=1e-5, rtol=0)
    nbytes = 4 * sum(p.numel() for p in make_net().parameters())
    assert by_kind == {"gossip_model": STEPS * 2 * nbytes}  # the model to both neighbours per step, nothing else
    stored = torch.load(path, weights_only=False)
    assert stored["pdist"]["strategy"] == "DecentralizedFabricStrategy" and stored["pdist"]["step"] == 3
    saved = torch.cat([v.reshape(-1) for v in stored["model"].values()])
    torch.testing.assert_close(saved, torch.stack(reference[3]).mean(0), atol=1e-5, rtol=0)

    resumed = launch("dpsgd_fork", lambda fabric: train(fabric, STEPS, lr=LR, path=path, resume=True, momentum=MOMENTUM),
                     devices=WORLD)  # fmt: skip
    for t in range(4, STEPS + 1):  # each rank's own model and momentum buffer came back from its file
        for r in range(WORLD):
            torch.testing.assert_close(torch.from_numpy(resumed[t][r]), reference[t][r], atol=1e-5, rtol=0)


def test_bad_graphs_are_refused_before_any_process_starts():
    with pytest.raises(ValueError, match=r"DecentralizedFabricStrategy\(topology='star'\): unknown topology"):
        DecentralizedFabricStrategy(topology="star")
    with pytest.raises(ValueError, match=r"DecentralizedFabricStrategy\(topology=\[\[1.0, 0.5\], \[0.0, 0.5\]\]\): .*doubly stochastic"):
        DecentralizedFabricStrategy(topology=[[1.0, 0.5], [0.0, 0.5]])
    with pytest.raises(ValueError, match=r"DecentralizedFabricStrategy\(topology='torus'\): needs at least 4 ranks; the run has 3"):
        Fabric(accelerator="cpu", devices=3, strategy=DecentralizedFabricStrategy(topology="torus", start_method="fork"))
