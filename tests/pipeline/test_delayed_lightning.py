"""Tier 3: the delayed-gradient schedules through ``Trainer(strategy=PipelineStrategy(schedule=...))`` on 2 processes.

One test per schedule runs the whole Lightning path twice: a fit of 8 steps that drains for validation at each
epoch end (3 steps per epoch) and writes a checkpoint there, compared with the rule's plain-torch reference
(``tests/_delayed_reference.py``, drains included); then a fit resumed from the first epoch's checkpoint, which must
end, step by step, where the first ends. Refusals are checked at construction and, for an optimizer without momentum
under ``spectrain``, at setup.
"""

import _delayed_reference as reference
import pytest
import torch
from _helpers import SnapshotParams, TinyRegression, fit, load_snapshot, rank_batches, regression_data
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_pdist import PipelineStrategy

LR, MU, N, BS, M = 0.05, 0.9, 12, 4, 2
STEPS, PER_EPOCH = 8, 3


class DeepRegression(TinyRegression):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.net = reference.make_net()


def microbatches():
    data = regression_data(N)
    out = []
    for t in range(STEPS):
        x, y = rank_batches(data, 0, 1, BS, t // PER_EPOCH)[t % PER_EPOCH]
        out += list(zip(x.tensor_split(M), y.tensor_split(M)))
    return out


def flat(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors])


@pytest.mark.parametrize("schedule", ["spectrain", "ddg", "features_replay"])
def test_trains_as_its_reference_and_resumes_exactly(tmp_path, schedule):
    """8 steps on 2 ranks equal the rule's reference (drained at 6 and 12 micro-batches); a run resumed from the
    epoch-0 checkpoint (a drained pipeline, momentum buffers in the optimizer state) matches it at every step."""
    make = lambda: DeepRegression(lr=LR, momentum=MU, n=N)  # noqa: E731
    strategy = lambda: PipelineStrategy(start_method="fork", schedule=schedule, num_microbatches=M, split_points=["net.4"])  # noqa: E731
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    first.mkdir(), resumed.mkdir()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpts", save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=False)
    module = make()
    fit(strategy(), module, max_steps=STEPS, callbacks=[SnapshotParams(first), checkpoint], enable_checkpointing=True,
        limit_val_batches=1)  # fmt: skip
    expected = reference.reference(schedule, [(0, 4), (4, 7)], microbatches(), drains=(6, 12), lr=LR, mu=MU)
    torch.testing.assert_close(flat(module.parameters()), flat(t for stage in expected for t in stage), atol=1e-6, rtol=0)
    ckpt = tmp_path / "ckpts" / "epoch=0-step=3.ckpt"
    assert torch.load(ckpt, weights_only=False)["pdist"]["pipeline"]["schedule"] == schedule
    fit(strategy(), make(), max_steps=STEPS, callbacks=[SnapshotParams(resumed)], ckpt_path=str(ckpt), limit_val_batches=1)
    for rank in range(2):
        for step in range(4, STEPS + 1):
            torch.testing.assert_close(load_snapshot(resumed, rank, step), load_snapshot(first, rank, step), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(schedule="spectrain", vertical_sync=True), r"vertical_sync=True\): vertical sync applies to schedule='pipedream', not 'spectrain'"),
        (dict(schedule="ddg", weight_stashing=False), r"weight_stashing=False\): .*schedule 'ddg' keeps no weight stash to turn off"),
        (dict(schedule="features_replay", nonfinite="skip_step"), r"nonfinite='skip_step'\): skip_step needs every rank to agree"),
    ],
)  # fmt: skip
def test_incompatible_combinations_are_refused_at_construction(kwargs, match):
    """Each combination the delayed-gradient schedules cannot honour is refused naming argument, value and rule."""
    with pytest.raises((ValueError, TypeError), match=match):
        PipelineStrategy(**kwargs)


def test_spectrain_without_momentum_is_refused_at_setup():
    """SpecTrain predicts from SGD's momentum buffer: plain SGD is refused when the optimizer is built."""
    with pytest.raises(Exception, match=r"PipelineStrategy\(schedule='spectrain'\): SGD has momentum=0(\.0)? in param group 0"):
        fit(PipelineStrategy(start_method="fork", num_stages=1, schedule="spectrain", num_microbatches=2),
            DeepRegression(lr=LR), devices=1, max_steps=1)  # fmt: skip


@pytest.mark.parametrize("schedule", ["spectrain", "ddg", "features_replay"])
def test_four_stages_on_four_processes(schedule):
    """One layer per stage on 4 ranks (staleness 3, 2, 1, 0): 3 steps end where the rule's reference ends."""
    module = DeepRegression(lr=LR, momentum=MU, n=N)
    fit(PipelineStrategy(start_method="fork", schedule=schedule, num_microbatches=M), module, devices=4, max_steps=3,
        limit_val_batches=0)  # fmt: skip
    expected = reference.reference(schedule, [(0, 2), (2, 4), (4, 6), (6, 7)], microbatches()[: 3 * M], lr=LR, mu=MU)
    torch.testing.assert_close(flat(module.parameters()), flat(t for stage in expected for t in stage), atol=1e-6, rtol=0)
