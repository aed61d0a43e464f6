"""Tier 1: EASGD's elastic step against a per-rank transcription of Zhang et al. (2015)."""

import pytest
import torch

from lightning_pdist.averaging.easgd import EASGDConfig, easgd_update_


def test_elastic_step_matches_per_rank_reference():
    """Each rank's update with the all-reduced sum equals d_i = x_i - x̃, x_i -= α d_i, x̃ += α Σ d_i."""
    torch.manual_seed(0)
    xs = [torch.randn(7) for _ in range(3)]
    center = torch.randn(7)
    alpha = 0.2
    d = [x - center for x in xs]
    ref_xs = [x - alpha * di for x, di in zip(xs, d)]
    ref_center = center + alpha * torch.stack(d).sum(0)
    total = torch.stack(xs).sum(0)
    for x, ref_x in zip(xs, ref_xs):
        local, c = x.clone(), center.clone()
        easgd_update_(local, c, total, 3, alpha)
        torch.testing.assert_close(local, ref_x)
        torch.testing.assert_close(c, ref_center)


def test_alpha_one_over_n_moves_center_to_mean():
    """With Nα = 1 the new center is exactly the mean of the replicas."""
    xs = torch.randn(4, 5)
    center = torch.zeros(5)
    easgd_update_(xs[0].clone(), center, xs.sum(0), 4, 0.25)
    torch.testing.assert_close(center, xs.mean(0))


def test_default_alpha_is_point_nine_over_n():
    """alpha=None resolves to 0.9 / world_size (β = Nα = 0.9)."""
    assert EASGDConfig().alpha_for(3) == pytest.approx(0.3)


@pytest.mark.parametrize("alpha", [0.0, -0.5, 1.5])
def test_alpha_outside_unit_interval_is_refused(alpha):
    """alpha outside (0, 1] raises naming the value and the rule."""
    with pytest.raises(ValueError, match=rf"E\(alpha={alpha}\): alpha must be in \(0, 1\]"):
        EASGDConfig(alpha=alpha, owner="E")


def test_alpha_times_world_size_above_one_is_refused_with_reason():
    """alpha * world_size > 1 raises and says why (the center overshoots)."""
    cfg = EASGDConfig(alpha=0.6, owner="E")
    assert cfg.alpha_for(1) == 0.6
    with pytest.raises(ValueError, match=r"alpha \* world_size = 1.2 must be <= 1.*overshoots"):
        cfg.alpha_for(2)
