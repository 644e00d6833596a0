"""Tests for ``qrecover.packing``: bit-packing of integer codes.

Checks: ``unpack(pack(c)) == c`` for every width 1..8 at many lengths (including lengths that are not
multiples of 8, and 0); ``packed_nbytes`` is exactly ``ceil(n * bits / 8)`` and equals the packed length;
the packed bytes follow the documented little-endian bit stream (code k in stream bits
``[k*bits, (k+1)*bits)``, stream bit b = bit ``b % 8`` of byte ``b // 8``, zero padding), compared
against a bit-by-bit reference built by hand; any input shape is flattened in C order; wrong sizes and
widths raise ``ValueError``.
"""

from __future__ import annotations

import math

import pytest
import torch

from qrecover.packing import pack, packed_nbytes, unpack

LENGTHS = [0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 64, 100, 257, 1000, 4099]


def reference_pack(codes: list[int], bits: int) -> bytes:
    """The documented layout, one bit at a time."""
    out = bytearray(math.ceil(len(codes) * bits / 8))
    for k, c in enumerate(codes):
        for j in range(bits):
            if (c >> j) & 1:
                b = k * bits + j
                out[b // 8] |= 1 << (b % 8)
    return bytes(out)


def random_codes(n: int, bits: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**bits, (n,), generator=g, dtype=torch.int64).to(torch.uint8)


@pytest.mark.parametrize("bits", range(1, 9))
def test_round_trip_many_lengths(bits):
    for i, n in enumerate(LENGTHS):
        codes = random_codes(n, bits, seed=1000 * bits + i)
        packed = pack(codes, bits)
        assert packed.dtype == torch.uint8 and packed.dim() == 1
        assert packed.numel() == packed_nbytes(n, bits) == math.ceil(n * bits / 8)
        back = unpack(packed, bits, n)
        assert back.dtype == torch.uint8 and back.shape == (n,)
        assert torch.equal(back, codes), (bits, n)


@pytest.mark.parametrize("bits", range(1, 9))
def test_extreme_codes_round_trip(bits):
    """All-zero and all-max codes (every bit set) survive: no bit of a neighbour leaks in."""
    for n in (1, 5, 8, 13):
        for value in (0, 2**bits - 1):
            codes = torch.full((n,), value, dtype=torch.uint8)
            assert torch.equal(unpack(pack(codes, bits), bits, n), codes)
        alternating = torch.tensor([(2**bits - 1) if k % 2 else 0 for k in range(n)], dtype=torch.uint8)
        assert torch.equal(unpack(pack(alternating, bits), bits, n), alternating)


def test_packed_nbytes_exact():
    for bits in range(1, 9):
        for n in range(0, 70):
            assert packed_nbytes(n, bits) == -(-n * bits // 8)
    assert packed_nbytes(3, 3) == 2  # 9 bits -> 2 bytes
    assert packed_nbytes(8, 3) == 3
    assert packed_nbytes(1, 1) == 1
    assert packed_nbytes(576 * 576, 4) == 576 * 576 // 2


@pytest.mark.parametrize("bits", range(1, 9))
def test_layout_matches_reference(bits):
    for i, n in enumerate([1, 3, 8, 11, 24, 37]):
        codes = random_codes(n, bits, seed=77 + 10 * bits + i)
        got = bytes(pack(codes, bits).tolist())
        assert got == reference_pack(codes.tolist(), bits), (bits, n)


def test_layout_hand_examples():
    # 2-bit codes 1,2,3,0 -> stream 10 01 11 00 (LSB first) -> byte 0b00_11_10_01
    assert pack(torch.tensor([1, 2, 3, 0], dtype=torch.uint8), 2).tolist() == [0b00111001]
    # 3-bit codes 5, 6, 7: bits 0-2 = 101, 3-5 = 011 (6), 6-8 = 111 -> byte0 = 1_1_110_101, byte1 = 0000000_1
    assert pack(torch.tensor([5, 6, 7], dtype=torch.uint8), 3).tolist() == [0b11110101, 0b00000001]
    # 4-bit: low nibble first
    assert pack(torch.tensor([0x1, 0xF, 0xA], dtype=torch.uint8), 4).tolist() == [0xF1, 0x0A]
    # 1-bit: code k is bit k
    assert pack(torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1], dtype=torch.uint8), 1).tolist() == [0x81, 0x01]
    # 8-bit: the bytes themselves
    assert pack(torch.tensor([0, 255, 17], dtype=torch.uint8), 8).tolist() == [0, 255, 17]


def test_padding_bits_are_zero():
    for bits in (1, 3, 5, 7):
        codes = torch.full((3,), 2**bits - 1, dtype=torch.uint8)
        packed = pack(codes, bits)
        used = 3 * bits
        last = int(packed[-1])
        assert last >> (used - 8 * (packed.numel() - 1)) == 0, bits


def test_any_shape_flattened_in_c_order():
    codes = random_codes(6 * 10, 3, seed=5).view(6, 10)
    assert torch.equal(pack(codes, 3), pack(codes.reshape(-1), 3))
    assert torch.equal(pack(codes.t().contiguous().t(), 3), pack(codes.reshape(-1), 3))  # non-contiguous view
    assert torch.equal(unpack(pack(codes, 3), 3, 60).view(6, 10), codes)


def test_int64_codes_accepted():
    codes = torch.tensor([3, 0, 2, 1, 3], dtype=torch.int64)
    assert torch.equal(unpack(pack(codes, 2), 2, 5), codes.to(torch.uint8))


@pytest.mark.parametrize("bits", [0, 9, -1, 16])
def test_bad_bits(bits):
    with pytest.raises(ValueError, match="bits"):
        pack(torch.zeros(8, dtype=torch.uint8), bits)
    with pytest.raises(ValueError, match="bits"):
        unpack(torch.zeros(8, dtype=torch.uint8), bits, 8)


@pytest.mark.parametrize("bits", range(1, 9))
def test_wrong_packed_size(bits):
    n = 13
    packed = pack(random_codes(n, bits, seed=3), bits)
    with pytest.raises(ValueError, match="cannot hold"):
        unpack(packed[:-1], bits, n)
    with pytest.raises(ValueError, match="cannot hold"):
        unpack(torch.cat([packed, packed[:1]]), bits, n)
    with pytest.raises(ValueError):
        unpack(packed, bits, n + 100)
