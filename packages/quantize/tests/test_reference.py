"""The pure-torch reference: code packing, the noise hash, and its own invariants."""

from __future__ import annotations

import pytest
import torch

from mpx.quantize import reference as R


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("count", [0, 1, 8, 13, 1000])
def test_pack_unpack_round_trip(bits: int, count: int) -> None:
    g = torch.Generator().manual_seed(bits * 1000 + count)
    codes = torch.randint(0, 1 << bits, (count,), generator=g)
    packed = R.pack_codes(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.numel() == -(-count // 8) * bits
    assert torch.equal(R.unpack_codes(packed, bits, count), codes)


def test_packing_is_little_endian_eight_codes_in_bits_bytes() -> None:
    # 3 bits: codes 0..7 -> the 24-bit integer sum(j << 3j), little-endian bytes.
    codes = torch.arange(8)
    packed = R.pack_codes(codes, 3).tolist()
    word = sum(j << (3 * j) for j in range(8))
    assert packed == [word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF]
    # 1 bit: code j is bit j of one byte.
    assert R.pack_codes(torch.tensor([1, 0, 0, 0, 0, 0, 0, 1]), 1).tolist() == [0x81]
    # 8 bits: the bytes are the codes.
    assert R.pack_codes(torch.tensor([7, 200, 255]), 8).tolist() == [7, 200, 255, 0, 0, 0, 0, 0]


def _fmix32(x: int) -> int:
    # murmur3's finaliser in plain Python integers: the independent check of _fmix32.
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_hash_matches_plain_integer_arithmetic() -> None:
    seed = 0x1234_5678_9ABC_DEF0
    start = (1 << 32) - 3  # crosses index_hi = 0 -> 1
    got = R.hash_uniform(seed, start, 6).tolist()
    for n, value in enumerate(got):
        index = start + n
        k1 = _fmix32((seed & 0xFFFFFFFF) ^ _fmix32((index >> 32) ^ (seed >> 32) ^ 0x9E3779B9))
        k2 = _fmix32(k1 ^ 0x85EBCA6B)
        h = _fmix32(_fmix32((index & 0xFFFFFFFF) ^ k1) ^ k2)
        assert value == (h >> 8) / 2**24


def test_hash_is_uniform_and_seed_dependent() -> None:
    r = R.hash_uniform(7, 0, 200_000)
    assert r.min() >= 0
    assert r.max() < 1
    assert abs(r.mean().item() - 0.5) < 0.005
    assert abs(r.var().item() - 1 / 12) < 0.002
    hist = torch.histc(r, bins=10, min=0, max=1)
    assert (hist - 20_000).abs().max() < 800
    other = R.hash_uniform(8, 0, 200_000)
    assert abs(torch.corrcoef(torch.stack([r, other]))[0, 1].item()) < 0.01
    # neighbours within one seed are uncorrelated too
    assert abs(torch.corrcoef(torch.stack([r[:-1], r[1:]]))[0, 1].item()) < 0.01


def test_draw_seed_follows_the_generator() -> None:
    a = R.draw_seed(torch.Generator().manual_seed(3))
    b = R.draw_seed(torch.Generator().manual_seed(3))
    c = R.draw_seed(torch.Generator().manual_seed(4))
    assert a == b != c
    assert 0 <= a < 2**62


def test_reference_formula_on_a_hand_example() -> None:
    # bucket [0, 1, 2, 3] at 2 bits: min 0, unit 1, codes = the values.
    x = torch.tensor([0.0, 1.0, 2.0, 3.0, 10.0, 10.0])
    q = R.quantize(x, bits=2, bucket_size=4, stochastic=False)
    assert q.mins.tolist() == [0.0, 10.0]
    assert q.units.tolist() == [1.0, 0.0]
    assert R.unpack_codes(q.values, 2, 6).tolist() == [0, 1, 2, 3, 0, 0]
    assert torch.equal(R.dequantize(q), x)
    acc = torch.ones(6)
    assert torch.equal(R.dequantize_add(q, acc), x + 1)


def test_float16_unit_is_rounded_up() -> None:
    # The stored unit is the smallest float16 >= range / levels (computed in float32).
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(4000, generator=g) * 3).half()
    q = R.quantize(x, bits=8, bucket_size=4, stochastic=False)
    xf = x.float().view(-1, 4)
    exact = (xf.amax(1) - xf.amin(1)) / 255
    unit = q.units.float()
    below = (q.units.view(torch.int16) - 1).view(torch.float16).float()
    assert (unit >= exact).all()
    assert (below < exact).all()
    rounded_down = q.units.float() > exact.half().float()
    assert rounded_down.any()  # the case that needs it happens
    # and the codes never need to be clamped by more than rounding: error <= unit/2
    err = (R.dequantize(q).float() - x.float()).view(-1, 4).abs()
    assert (err <= unit[:, None] / 2 + xf.abs() * 2.0**-11).all()
