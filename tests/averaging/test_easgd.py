"""Tier 3: EASGDStrategy in real 2-rank Lightning runs against the paper's equations."""

import pytest
import torch
from _helpers import SnapshotParams, TinyRegression, assert_matches_reference, fit, make_net, reference_replicas

from lightning_pdist import EASGDStrategy


def _easgd_reference(alpha):
    def sync(flats, state):
        center = state.get("center", state.get("warm", torch.cat([p.detach().reshape(-1) for p in make_net().parameters()])))
        d = [x - center for x in flats]
        new = [x - alpha * di for x, di in zip(flats, d)]
        state["center"] = center + alpha * torch.stack(d).sum(0)
        return new

    return sync


@pytest.mark.parametrize("alpha, warmup", [(0.3, 0), (0.45, 2)])
def test_every_rank_matches_reference_over_several_periods(tmp_path, alpha, warmup):
    """Each rank's replica after every step equals a plain-torch synchronous EASGD."""
    fit(EASGDStrategy(period=3, alpha=alpha, warmup_steps=warmup, start_method="fork"), TinyRegression(),
        max_steps=11, callbacks=[SnapshotParams(tmp_path)])
    assert_matches_reference(tmp_path, reference_replicas(2, 11, _easgd_reference(alpha), 3, warmup), world=2)


def test_fit_ends_with_the_center(tmp_path):
    """After fit every rank holds the center, not its own replica."""
    model = TinyRegression()
    fit(EASGDStrategy(period=3, alpha=0.3, start_method="fork"), model, max_steps=6, callbacks=[SnapshotParams(tmp_path)])
    ref = {}
    history = reference_replicas(2, 6, _capture(_easgd_reference(0.3), ref), 3)
    got = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(got, ref["center"], atol=1e-6, rtol=0)
    assert not torch.allclose(history[6][0], ref["center"])


def _capture(sync, out):
    def wrapped(flats, state):
        result = sync(flats, state)
        out["center"] = state["center"].clone()
        return result

    return wrapped


def test_validation_sees_the_center(tmp_path):
    """Validation during fit evaluates the center; training resumes from the rank's own replica."""
    from lightning.pytorch import Callback

    class Spy(Callback):
        def on_validation_start(self, trainer, pl_module):
            self.before = torch.cat([p.detach().reshape(-1).clone() for p in pl_module.parameters()])

        def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            during = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()])
            center = trainer.strategy.rule.state.center[: during.numel()]
            torch.testing.assert_close(during, center)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if getattr(self, "before", None) is not None:  # first training batch after a validation
                now = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()])
                torch.testing.assert_close(now, self.before)
                self.before = None
                self.checked = getattr(self, "checked", 0) + 1

        def on_train_end(self, trainer, pl_module):
            assert getattr(self, "checked", 0) >= 2

    fit(EASGDStrategy(period=2, alpha=0.3, start_method="fork"), TinyRegression(), max_steps=8, callbacks=[Spy()],
        limit_val_batches=1, val_check_interval=3)
