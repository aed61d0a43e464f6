"""Tier 3: DiLoCo and Streaming DiLoCo in real 2-rank Lightning runs against a plain-torch DiLoCo."""

import torch
from _helpers import SnapshotParams, TinyRegression, fit, load_snapshot
from _diloco_reference import diloco_reference, nesterov
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_pdist import DiLoCoStrategy, StreamingDiLoCoStrategy
from lightning_pdist.core import rank_files

# 32 samples, 2 ranks, batch 4: 4 steps per epoch, so the checkpoint at the first validation is step 4.
N, STEPS = 32, 10


def _model():
    return TinyRegression(lr=0.1, momentum=0.9, n=N)  # inner SGD with momentum: its state must stay local


def _run_with_resume(tmp_path, make):
    """An uninterrupted run (checkpoint at step 4 on the way) and a run resumed from that checkpoint."""
    plain, resumed = tmp_path / "plain", tmp_path / "resumed"
    plain.mkdir(parents=True), resumed.mkdir(parents=True)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=False)
    models = _model(), _model()
    fit(make(), models[0], max_steps=STEPS, callbacks=[SnapshotParams(plain), checkpoint], enable_checkpointing=True,
        limit_val_batches=1)
    first = tmp_path / "ckpts" / "epoch=0-step=4.ckpt"
    fit(make(), models[1], max_steps=STEPS, callbacks=[SnapshotParams(resumed)], ckpt_path=str(first), limit_val_batches=1)
    return plain, resumed, first, models


def _check(plain, resumed, models, history, final, from_step=5):
    for t, flats in history.items():
        for r in range(2):
            msg = lambda m: f"rank {r} step {t}: {m}"  # noqa: E731
            torch.testing.assert_close(load_snapshot(plain, r, t), flats[r], atol=1e-6, rtol=0, msg=msg)
            if t >= from_step:
                torch.testing.assert_close(load_snapshot(resumed, r, t), flats[r], atol=1e-6, rtol=0, msg=msg)
    for model in models:  # rank 0's module, back in this process: it holds the global model
        torch.testing.assert_close(torch.cat([p.detach().reshape(-1) for p in model.parameters()]), final, atol=1e-6,
                                   rtol=0)  # fmt: skip


def test_diloco_matches_reference_resumes_mid_round_and_streaming_p1_equals_it(tmp_path):
    """DiLoCo(H=3, Nesterov 0.7/0.9) with inner SGD-momentum: every replica after every step and the final global
    model equal plain torch; resumed from step 4 (mid-round) it continues exactly; the checkpoint holds θ_global in
    state_dict and each replica in its rank file; Streaming DiLoCo with P=1, τ=0 gives bit-identical results."""
    history, final = diloco_reference(2, STEPS, H=3, outer=nesterov(), momentum=0.9, n=N)
    plain, resumed, first, models = _run_with_resume(tmp_path / "d", lambda: DiLoCoStrategy(sync_every=3, start_method="fork"))
    _check(plain, resumed, models, history, final)
    stored = torch.load(first, weights_only=False)
    _, global_after_round1 = diloco_reference(2, 3, H=3, outer=nesterov(), momentum=0.9, n=N)
    flat = torch.cat([v.reshape(-1) for v in stored["state_dict"].values()])
    torch.testing.assert_close(flat, global_after_round1, atol=1e-6, rtol=0)
    fragment = stored["pdist"]["rounds"]["fragments"][0]
    torch.testing.assert_close(fragment["global_params"], global_after_round1, atol=1e-6, rtol=0)
    assert fragment["outer_optimizer"]["state"][0]["momentum_buffer"].abs().sum() > 0 and stored["pdist"]["step"] == 4
    for r in range(2):
        own = torch.load(rank_files.path_for(first, r, 2), weights_only=False)
        torch.testing.assert_close(own["replica"], history[4][r], atol=1e-6, rtol=0)
        assert own["optimizer_states"][0]["state"]  # the inner momentum, this rank's own
    streaming = tmp_path / "s"
    streaming.mkdir()
    fit(StreamingDiLoCoStrategy(sync_every=3, num_fragments=1, start_method="fork"), _model(), max_steps=STEPS,
        callbacks=[SnapshotParams(streaming)], limit_val_batches=1, check_val_every_n_epoch=1)
    for t in range(1, STEPS + 1):
        for r in range(2):
            assert torch.equal(load_snapshot(streaming, r, t), load_snapshot(plain, r, t)), (r, t)


def test_streaming_fragments_overlap_alpha_int4_match_reference_and_resume_mid_overlap(tmp_path):
    """Streaming DiLoCo, P=2 (net.0 | net.2), H=6, τ=2, α=0.5, int4: fragment 1 starts after step 3 and merges after
    step 5, so the checkpoint at step 4 falls with its exchange in flight; every replica after every step and the
    final model equal plain torch (its own int4 quantizer), resumed too; the bytes logged are the int4 codes'."""
    make = lambda: StreamingDiLoCoStrategy(sync_every=6, num_fragments=2, overlap_steps=2, fragment_alpha=0.5,  # noqa: E731
                                           quantize="int4", start_method="fork")
    history, final = diloco_reference(2, STEPS, H=6, outer=nesterov(), P=2, tau=2, alpha=0.5, bits=4, momentum=0.9, n=N)
    plain, resumed, first, models = _run_with_resume(tmp_path, make)
    _check(plain, resumed, models, history, final)
    stored = torch.load(first, weights_only=False)
    assert [f["pending"] is not None for f in stored["pdist"]["rounds"]["fragments"]] == [False, True]
    by_kind = stored["pdist"]["comm_meter"]["by_kind"]
    # After step 4: fragment 1 (net.2: 18 values -> 1 block of 64 int4 codes = 32 bytes + one fp32 scale), once;
    # the all-gather on 2 ranks sends the rank's own 36 bytes once.
    assert by_kind == {"nonfinite_flag": by_kind["nonfinite_flag"], "pseudo_grad_all_gather": 36}, by_kind


def test_four_ranks_diloco_and_streaming_match_reference(tmp_path):
    """4 ranks through the Trainer: DiLoCo(H=2) and Streaming DiLoCo(H=4, P=2 balanced by parameters, τ=1, α=0.5,
    int4) with inner SGD-momentum; every replica after every step and the final global model equal plain torch."""
    n, steps = 32, 6  # 4 ranks × batch 4: 2 steps per epoch
    runs = {
        "d": (DiLoCoStrategy(sync_every=2, start_method="fork"), {"H": 2}),
        "s": (StreamingDiLoCoStrategy(sync_every=4, num_fragments=2, balance="params", overlap_steps=1,
                                      fragment_alpha=0.5, quantize="int4", start_method="fork"),
              {"H": 4, "P": 2, "tau": 1, "alpha": 0.5, "bits": 4}),
    }  # fmt: skip
    for name, (strategy, ref) in runs.items():
        snaps = tmp_path / name
        snaps.mkdir()
        model = TinyRegression(lr=0.1, momentum=0.9, n=n)
        fit(strategy, model, devices=4, max_steps=steps, callbacks=[SnapshotParams(snaps)])
        history, final = diloco_reference(4, steps, outer=nesterov(), momentum=0.9, n=n, **ref)
        for t, flats in history.items():
            for r in range(4):
                torch.testing.assert_close(load_snapshot(snaps, r, t), flats[r], atol=1e-6, rtol=0,
                                           msg=lambda m: f"{name} rank {r} step {t}: {m}")  # noqa: B023
        torch.testing.assert_close(torch.cat([p.detach().reshape(-1) for p in model.parameters()]), final, atol=1e-6,
                                   rtol=0)  # fmt: skip
