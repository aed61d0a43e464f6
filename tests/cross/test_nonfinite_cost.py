"""The cheap paths of the per-step non-finite checks give the plain paths' answers (issue 12: pdist_ddp's overhead)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pdist.core.nonfinite import all_finite, grads_finite
from lightning_pdist.core.hooks import AllReduceState
from lightning_pdist.core.guard import NonFiniteGuard, float_buffers


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_grads_finite_answers_as_isfinite_and_leaves_the_values(bad, dtype):
    """The fused check says what torch.isfinite says, for every float dtype mixed with fp32, and every value stays
    bit for bit (the op multiplies by 1.0)."""
    grads = [torch.randn(5, 3).to(dtype), torch.randn(7), torch.zeros(0), torch.tensor([-0.0, 1e-30]).to(dtype)]
    if bad is not None:
        grads[0][2, 1] = bad
    before = [g.clone() for g in grads]
    assert grads_finite(grads) == all(bool(torch.isfinite(g).all()) for g in grads) == all_finite(grads)
    for g, b in zip(grads, before):
        assert torch.equal(g.view(-1).view(torch.uint8) if g.numel() else g, b.view(-1).view(torch.uint8) if b.numel() else b)


def test_grads_finite_falls_back_for_what_the_fused_op_does_not_take():
    """Integer tensors go to all_finite (the op raises NotImplementedError for them); no tensors: finite."""
    assert grads_finite([torch.ones(3, dtype=torch.int64), torch.ones(2)])
    assert not grads_finite([torch.ones(3, dtype=torch.int64), torch.tensor([float("nan")])])
    assert grads_finite([])


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(3)
        self.body = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
        self.again = self.bn  # a module reached twice: its buffers count once
        self.register_buffer("scale", torch.ones(1))
        self.register_buffer("count", torch.zeros(1, dtype=torch.int64))


def test_float_buffers_are_module_buffers_in_order():
    """The hand-written walk gives module.buffers()'s float buffers, in its order, each once."""
    net = _Net()
    assert [id(b) for b in float_buffers(net)] == [id(b) for b in net.buffers() if torch.is_floating_point(b)]


def test_guard_reuses_the_buffers_found_at_the_last_refresh():
    """snapshot(refresh=False) takes the buffers found at the last refresh; a skip restores exactly those."""
    net, guard = _Net(), NonFiniteGuard("skip_step", "Test")
    guard.snapshot(net, refresh=True)
    guard.step_done()
    net.bn.running_mean.add_(1.0)  # an in-place update, as BatchNorm's forward makes
    guard.snapshot(net, refresh=False)
    before = net.bn.running_mean.clone()
    net.bn.running_mean.add_(5.0)
    from lightning_pdist.core.guard import SkipStep

    with pytest.raises(SkipStep), pytest.warns(UserWarning, match="skipped"):
        guard.act("gradients", [0], net, before="the optimizer step", skipped="that step")
    torch.testing.assert_close(net.bn.running_mean, before)


def test_hook_notes_are_read_only_when_asked_and_stay_bounded():
    """note_bucket keeps each bucket's extremes; take_nonfinite says whether any was not finite and clears them;
    many notes fold into the flag instead of growing."""
    state = AllReduceState(track_nonfinite=True)
    for _ in range(500):
        state.note_bucket(torch.randn(10))
    assert len(state._extremes) <= 130
    assert state.take_nonfinite() is False
    state.note_bucket(torch.tensor([1.0, float("nan")]))
    for _ in range(200):
        state.note_bucket(torch.randn(10))
    assert state.take_nonfinite() is True and state.take_nonfinite() is False
    state.note_bucket(torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,)))  # DDP's bucket of a sparse embedding
    assert state.take_nonfinite() is False
    state.note_bucket(torch.sparse_coo_tensor([[0, 2]], [1.0, float("inf")], (4,)))
    assert state.take_nonfinite() is True
