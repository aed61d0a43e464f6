"""Single-process checks of the compressors' math, wire formats and refusals (no process group: world size 1)."""

import math
import re

import numpy as np
import pytest
import torch
import zstandard

import lightning_pdist  # noqa: F401
from lightning_pdist import BMUFStrategy, PdistStrategy, SignSGDStrategy
from lightning_pdist.compression import DGC, QSGD, PowerSGD, RandomK, Sign, TernGrad, TopK
from lightning_pdist.compression.codec import decode_indices, encode_indices
from lightning_pdist.compression.quantize import pack_bits, qsgd_levels, terngrad_levels, unpack_bits


def test_index_coding_round_trips_and_costs_under_60_percent_of_int32_at_ratio_001():
    d = 1_000_000
    idx = torch.randperm(d, generator=torch.Generator().manual_seed(0))[: d // 100].sort().values
    coded = encode_indices(idx)
    assert torch.equal(decode_indices(coded, idx.numel()), idx)
    assert len(coded) <= 0.6 * 4 * idx.numel(), len(coded) / (4 * idx.numel())
    # the coding as the method card states it, written here from numpy and zstandard directly
    gaps = np.diff(idx.numpy(), prepend=-1) - 1
    shuffled = np.ascontiguousarray(gaps.astype("<u4").view(np.uint8).reshape(-1, 4).T).tobytes()
    assert zstandard.ZstdDecompressor().decompress(coded) == shuffled
    assert encode_indices(torch.zeros(0, dtype=torch.int64)) == b"" and decode_indices(b"", 0).numel() == 0


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_bit_packing_round_trips(width):
    v = torch.randint(0, 2**width, (37,), generator=torch.Generator().manual_seed(width))
    packed = pack_bits(v, width)
    assert packed.numel() == math.ceil(37 * width / 8) and torch.equal(unpack_bits(packed, width, 37), v)


def _draws(fn, x, trials):
    g = torch.Generator().manual_seed(1)
    return torch.stack([fn(x, g) for _ in range(trials)])


def test_qsgd_and_terngrad_are_unbiased_and_keep_their_variance_bounds():
    """Mean over 4000 draws within 5 standard errors of x per entry; E‖Q(x) − x‖² within its bound (QSGD) and
    equal to s‖x‖₁ − ‖x‖² within 5 % (TernGrad)."""
    x = torch.randn(64, generator=torch.Generator().manual_seed(0))
    trials, d = 4000, x.numel()
    for s in (1, 4):
        q = _draws(lambda v, g: (lambda n, lv: n * lv.float() / s)(*qsgd_levels(v, s, g)), x, trials)
        stderr = q.std(0) / math.sqrt(trials)
        assert ((q.mean(0) - x).abs() <= 5 * stderr + 1e-6).all()
        var = ((q - x) ** 2).sum(1).mean()
        assert var <= min(d / s**2, math.sqrt(d) / s) * float(x.norm() ** 2)
    t = _draws(lambda v, g: (lambda sc, lv: sc * lv.float())(*terngrad_levels(v, g)), x, trials)
    assert ((t.mean(0) - x).abs() <= 5 * t.std(0) / math.sqrt(trials) + 1e-6).all()
    expected = float(x.abs().max() * x.abs().sum() - x.norm() ** 2)
    assert abs(float(((t - x) ** 2).sum(1).mean()) - expected) <= 0.05 * expected


def test_randomk_without_feedback_is_unbiased():
    x = torch.randn(20, generator=torch.Generator().manual_seed(3))
    c, trials = RandomK(0.25, seed=5, error_feedback=False), 3000
    state, draws = c.new_state(), []
    for _ in range(trials):
        (out,) = c.mean([x], [0], state, None, None, "t")
        draws.append(out)
    draws = torch.stack(draws)
    assert ((draws.mean(0) - x).abs() <= 5 * draws.std(0) / math.sqrt(trials)).all()


@pytest.mark.parametrize("compressor", [TopK(0.2), TopK(0.2, values="fp16"), RandomK(0.3), QSGD(2, error_feedback=True),
                                        TernGrad(error_feedback=True), Sign(), DGC(0.2, momentum=0.0)])
def test_error_feedback_telescopes_exactly(compressor):
    """Σ_t sent_t + e_T = Σ_t g_t to the bit (integer-valued gradients: every sum is exact in fp32)."""
    gen = torch.Generator().manual_seed(0)
    state, sent, total = compressor.new_state(), torch.zeros(6, 5), torch.zeros(6, 5)
    for _ in range(7):
        g = torch.randint(-8, 9, (6, 5), generator=gen).float()
        (out,) = compressor.mean([g], [0], state, None, None, "t")
        sent += out
        total += g
    if isinstance(compressor, (QSGD, TernGrad, Sign)):  # scales are not integers: exact up to fp32 rounding
        torch.testing.assert_close(sent + state.tensors["residual"][0], total, rtol=0, atol=1e-4)
    else:
        assert torch.equal(sent + state.tensors["residual"][0], total)


@pytest.mark.parametrize("make, arg, value, rule", [
    (lambda: TopK(0.0), "ratio", 0.0, "ratio must be a number in (0, 1]"),
    (lambda: TopK(1.5), "ratio", 1.5, "ratio must be a number in (0, 1]"),
    (lambda: RandomK(-0.1), "ratio", -0.1, "ratio must be a number in (0, 1]"),
    (lambda: DGC(2.0), "ratio", 2.0, "ratio must be a number in (0, 1]"),
    (lambda: DGC(0.01, momentum=1.0), "momentum", 1.0, "momentum must be a number in [0, 1)"),
    (lambda: QSGD(0), "levels", 0, "levels must be an int in [1, 32767]"),
    (lambda: PowerSGD(0), "rank", 0, "rank must be an int >= 1"),
    (lambda: PowerSGD(1, start_iter=1), "start_iter", 1, "start_iter must be an int >= 2"),
])
def test_bad_arguments_are_refused_naming_argument_value_and_rule(make, arg, value, rule):
    with pytest.raises(ValueError, match=re.escape(f"({arg}={value!r}): {rule}")):
        make()


def test_strategies_refuse_a_compressor_they_cannot_use():
    with pytest.raises(ValueError, match=re.escape("BMUFStrategy(compression=PowerSGD(rank=1,") + ".*BMUFStrategy "
                       "compresses deltas, which PowerSGD cannot carry"):
        BMUFStrategy(compression=PowerSGD())
    with pytest.raises(TypeError, match=r"PdistStrategy\(compression='topk'\): compression must be None or a compressor"):
        PdistStrategy(compression="topk")
    with pytest.raises(TypeError, match=r"SignSGDStrategy\(compression=TopK.*unknown argument"):
        SignSGDStrategy(compression=TopK())
    with pytest.raises(ValueError, match=r"compression owns the comm hook; ddp_comm_hook must be left unset"):
        PdistStrategy(compression=TopK(), ddp_comm_hook=lambda s, b: None)


def test_a_level_stream_declaring_another_size_is_refused_before_allocating():
    """A rank's zstd level stream must declare exactly the size the receiver expects: a frame claiming 2**40 bytes
    (zstandard would try to allocate it) and a frame one byte short are refused; the right one decodes."""
    from lightning_pdist.compression.codec import unzstd, zstd
    from lightning_pdist.core.push_codec import PushFormatError

    data = bytes(range(64))
    assert unzstd(zstd(data), 64) == data
    with pytest.raises(PushFormatError, match="declares 64 bytes; 63 expected"):
        unzstd(zstd(data), 63)
    huge = bytes.fromhex("28b52ffd") + bytes([0xE0]) + (1 << 40).to_bytes(8, "little")
    with pytest.raises(PushFormatError, match=f"declares {1 << 40} bytes; 64 expected"):
        unzstd(huge, 64)
