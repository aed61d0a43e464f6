"""Tier 1: BMUF's block update against a plain-torch transcription of Chen & Huo (2016)."""

import pytest
import torch

from lightning_pdist.averaging.bmuf import BMUFConfig, BMUFState, bmuf_block_update_, bmuf_global_model


def _reference_block(anchor, delta, locals_, bm, blr, nesterov):
    g = torch.stack([anchor - w for w in locals_]).mean(0)
    delta = bm * delta + blr * g
    w_g = anchor - delta
    start = w_g - bm * delta if nesterov else w_g
    return start, delta, w_g


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("bm, blr", [(0.5, 1.0), (0.75, 1.3), (0.0, 0.7)])
def test_block_update_matches_reference_over_blocks(bm, blr, nesterov):
    """Several blocks of bmuf_block_update_ equal the equations written out in the test."""
    torch.manual_seed(0)
    w0 = torch.randn(10)
    state = BMUFState.starting_from(w0)
    ref_anchor, ref_delta = w0.clone(), torch.zeros(10)
    for _ in range(4):
        locals_ = [state.anchor - 0.1 * torch.randn(10) for _ in range(3)]
        w_g = bmuf_block_update_(state.anchor, state.delta, torch.stack(locals_).mean(0), bm, blr, nesterov)
        ref_anchor, ref_delta, ref_wg = _reference_block(ref_anchor, ref_delta, locals_, bm, blr, nesterov)
        torch.testing.assert_close(state.anchor, ref_anchor)
        torch.testing.assert_close(state.delta, ref_delta)
        torch.testing.assert_close(w_g, ref_wg)


def test_zero_momentum_unit_lr_is_model_averaging():
    """block_momentum=0, block_lr=1 makes the next start the plain mean of the local models."""
    anchor, delta = torch.zeros(5), torch.zeros(5)
    locals_ = torch.randn(4, 5)
    bmuf_block_update_(anchor, delta, locals_.mean(0), 0.0, 1.0, nesterov=True)
    torch.testing.assert_close(anchor, locals_.mean(0))


def test_global_model_closes_an_open_block_without_mutating_state():
    """bmuf_global_model equals W_g of an early block close and leaves the state untouched."""
    torch.manual_seed(1)
    anchor, delta, mean_local = torch.randn(6), torch.randn(6), torch.randn(6)
    expected = anchor - (0.6 * delta + 1.0 * (anchor - mean_local))
    before = anchor.clone(), delta.clone()
    got = bmuf_global_model(anchor, delta, mean_local, 0.6, 1.0, block_open=True, nesterov=True)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(anchor, before[0])
    torch.testing.assert_close(delta, before[1])


def test_global_model_at_block_end_undoes_the_nesterov_shift():
    """Right after a block the ranks hold S = W_g - η·Δ; the output model is W_g = S + η·Δ."""
    anchor, delta = torch.zeros(3), torch.zeros(3)
    w_g = bmuf_block_update_(anchor, delta, torch.tensor([1.0, 2.0, 3.0]), 0.5, 1.0, nesterov=True)
    got = bmuf_global_model(anchor, delta, anchor, 0.5, 1.0, block_open=False, nesterov=True)
    torch.testing.assert_close(got, w_g)


def test_default_block_momentum_is_one_minus_one_over_n():
    """block_momentum=None resolves to 1 - 1/world_size."""
    assert BMUFConfig().momentum_for(4) == pytest.approx(0.75)
    assert BMUFConfig(block_momentum=0.3).momentum_for(4) == 0.3


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(block_momentum=1.0), r"B\(block_momentum=1.0\): block_momentum must be in \[0, 1\)"),
        (dict(block_momentum=-0.1), r"block_momentum=-0.1"),
        (dict(block_lr=0.0), r"B\(block_lr=0.0\): block_lr must be a finite number > 0"),
        (dict(block_lr=-1.0), r"block_lr=-1.0"),
    ],
)
def test_bad_config_names_argument_value_and_rule(kwargs, match):
    """Out-of-range block_momentum/block_lr raise ValueError naming argument, value and rule."""
    with pytest.raises(ValueError, match=match):
        BMUFConfig(owner="B", **kwargs)
