"""Tier 1: 1-bit packing, unpacking and vote counting against numpy and plain-torch references."""

import numpy as np
import pytest
import torch

from lightning_pdist.sign.bits import (
    _pack_bits_torch,
    _unpack_bits_torch,
    majority_bits,
    pack_bits,
    pack_signs,
    packed_numel,
    unpack_bits,
    unpack_signs,
    vote_counts,
)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 1000])
def test_pack_unpack_round_trip_and_numpy_bit_order(n):
    """Packing is MSB-first like numpy.packbits, takes ceil(n/8) bytes, and unpacking restores the bits."""
    bits = torch.rand(n, generator=torch.Generator().manual_seed(n)) < 0.5
    packed = pack_bits(bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_numel(n) == (n + 7) // 8
    assert packed.tolist() == np.packbits(bits.numpy()).tolist()
    assert torch.equal(unpack_bits(packed, n), bits)


def test_torch_path_equals_numpy_path():
    """The shift-and-or path used off-CPU gives the same bytes and bits as the numpy path, batched rows included."""
    bits = torch.rand(3, 45, generator=torch.Generator().manual_seed(0)) < 0.5
    packed = pack_bits(bits)
    assert packed.shape == (3, 6)
    assert torch.equal(_pack_bits_torch(bits), packed)
    assert torch.equal(_unpack_bits_torch(packed, 45), bits)
    assert torch.equal(unpack_bits(packed, 45), bits)


def test_first_coordinate_is_the_most_significant_bit():
    """Coordinate 0 is bit 7 of byte 0; padding bits are zero."""
    bits = torch.tensor([True] + [False] * 8 + [True])
    assert pack_bits(bits).tolist() == [0b10000000, 0b01000000]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_pack_signs_zero_is_plus_and_dtypes_agree(dtype):
    """pack_signs sets the bit for x >= 0 (so 0 and -0 vote +1) in every floating dtype, numpy and torch paths alike."""
    x = torch.tensor([0.0, -0.0, -1.0, 2.0, -3.0, 0.5, -0.25, 1.0, -7.0], dtype=dtype)
    assert unpack_signs(pack_signs(x), 9).tolist() == [1, 1, -1, 1, -1, 1, -1, 1, -1]


def test_unpack_signs_dtype_and_non_contiguous_input():
    """unpack_signs returns +-1 in the asked dtype and reads a strided column slice of packed rows."""
    rows = torch.tensor([[9, 0b11110000, 0], [9, 0b00001111, 0]], dtype=torch.uint8)
    out = unpack_signs(rows[:, 1:2], 8, dtype=torch.float16)
    assert out.dtype == torch.float16
    assert out.tolist() == [[1, 1, 1, 1, -1, -1, -1, -1], [-1, -1, -1, -1, 1, 1, 1, 1]]


@pytest.mark.parametrize("workers", [1, 2, 5, 300])
def test_vote_counts_match_unpacked_sum(workers):
    """vote_counts equals the per-coordinate number of set bits, for small worker counts and beyond 255 (int32 path)."""
    bits = torch.rand(workers, 37, generator=torch.Generator().manual_seed(workers)) < 0.5
    counts = vote_counts(pack_bits(bits), 37)
    assert counts.tolist() == bits.sum(0).tolist()
    assert counts.dtype == (torch.uint8 if workers < 256 else torch.int32)


@pytest.mark.parametrize("workers", [1, 2, 3, 4, 255])
def test_majority_bits_matches_signed_sum_with_ties_plus(workers):
    """majority_bits is sum of +-1 >= 0, ties to +1, without overflowing uint8 counts."""
    bits = torch.rand(workers, 50, generator=torch.Generator().manual_seed(workers)) < 0.5
    expected = (bits.to(torch.int32) * 2 - 1).sum(0) >= 0
    assert torch.equal(majority_bits(pack_bits(bits), 50), expected)


def test_pack_bits_rejects_non_bool():
    """Only bool tensors are packed; a float tensor must go through pack_signs."""
    with pytest.raises(TypeError, match=r"pack_bits\(bits.dtype=torch.float32\): bits must be a bool tensor"):
        pack_bits(torch.ones(8))


def test_unpack_bits_rejects_wrong_dtype_and_too_many_bits():
    """unpack_bits needs uint8 input and at most 8 bits per byte."""
    with pytest.raises(TypeError, match=r"unpack_bits\(packed.dtype=torch.int8\): packed must be a uint8 tensor"):
        unpack_bits(torch.zeros(2, dtype=torch.int8), 8)
    with pytest.raises(ValueError, match=r"unpack_bits\(n=17\): n must be in \[0, 8 \* 2\]"):
        unpack_bits(torch.zeros(2, dtype=torch.uint8), 17)


def test_vote_counts_rejects_1d():
    """vote_counts needs one packed row per worker."""
    with pytest.raises(ValueError, match=r"vote_counts\(packed.shape=\(4,\)\): packed must be a 2-D"):
        vote_counts(torch.zeros(4, dtype=torch.uint8), 32)


@pytest.mark.parametrize("workers", [1, 2, 3, 5])
def test_truth_table_bits_equals_unpacked_lookup(workers):
    """Applying a truth table on packed bytes equals looking each coordinate's sign pattern up in it."""
    from lightning_pdist.sign.bits import truth_table_bits

    g = torch.Generator().manual_seed(workers)
    rows = torch.randint(0, 256, (workers, 13), dtype=torch.uint8, generator=g)
    for table in (torch.rand(2**workers, generator=g) > 0.5, torch.zeros(2**workers, dtype=torch.bool)):
        bits = unpack_bits(rows, 8 * 13).to(torch.int64)  # (M, n)
        pattern = (bits << torch.arange(workers).unsqueeze(1)).sum(0)
        assert torch.equal(unpack_bits(truth_table_bits(rows, table.tolist()).unsqueeze(0), 104)[0], table[pattern])


def test_mask_bits_and_count_ones():
    """mask_bits_ keeps exactly coordinates start..stop-1; count_ones counts set bits per row."""
    from lightning_pdist.sign.bits import count_ones, mask_bits_

    packed = torch.full((2, 5), 0xFF, dtype=torch.uint8)
    mask_bits_(packed, 3, 29)
    expected = torch.zeros(2, 40, dtype=torch.bool)
    expected[:, 3:29] = True
    assert torch.equal(unpack_bits(packed, 40), expected)
    assert count_ones(packed).tolist() == [26, 26]
    with pytest.raises(ValueError, match="start <= stop"):
        mask_bits_(packed, 5, 3)
    with pytest.raises(TypeError, match="uint8"):
        count_ones(packed.to(torch.int8))
