"""QuantizedTensor: byte layout, header validation, views."""

from __future__ import annotations

import pytest
import torch

from mpx.quantize import QuantizedTensor, QuantizeError
from mpx.quantize.codec.format import layout, meta_dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("numel", [0, 1, 7, 8, 9, 1000, 1024])
@pytest.mark.parametrize("bits", [1, 3, 4, 8])
def test_layout_sizes(dtype: torch.dtype, numel: int, bits: int) -> None:
    lay = layout(numel, dtype, bits, 100)
    msize = 2 if dtype == torch.float16 else 4
    buckets = -(-numel // 100)
    assert lay.buckets == buckets
    assert lay.values_bytes == -(-numel // 8) * bits
    assert lay.nbytes == 2 * buckets * msize + lay.values_bytes
    skipped = layout(numel, dtype, bits, 100, skip_incomplete=True)
    assert skipped.quantized == numel // 100 * 100
    assert skipped.tail == numel % 100
    esize = torch.finfo(dtype).bits // 8
    assert skipped.nbytes == (
        2 * (numel // 100) * msize + (numel % 100) * esize + -(-skipped.quantized // 8) * bits
    )


def test_meta_dtype() -> None:
    assert meta_dtype(torch.float32) == torch.float32
    assert meta_dtype(torch.float16) == torch.float16
    # bfloat16's 8-bit mantissa is too coarse for the unit: float32 metadata.
    assert meta_dtype(torch.bfloat16) == torch.float32


def test_buffer_must_match_header() -> None:
    with pytest.raises(ValueError, match=r"has 10 bytes.*need 136"):
        QuantizedTensor(torch.zeros(10, dtype=torch.uint8), (256,), torch.float32, 4, 512)
    with pytest.raises(TypeError, match="uint8"):
        QuantizedTensor(torch.zeros(136), (256,), torch.float32, 4, 512)
    with pytest.raises(QuantizeError, match="1-D"):
        QuantizedTensor(torch.zeros(2, 68, dtype=torch.uint8), (256,), torch.float32, 4, 512)
    with pytest.raises(ValueError, match="bits=9"):
        QuantizedTensor(torch.zeros(136, dtype=torch.uint8), (256,), torch.float32, 9, 512)
    with pytest.raises(TypeError, match="int32"):
        QuantizedTensor(torch.zeros(136, dtype=torch.uint8), (256,), torch.int32, 4, 512)
    ok = QuantizedTensor(torch.zeros(136, dtype=torch.uint8), (256,), torch.float32, 4, 512)
    assert ok.nbytes == 136
    assert ok.num_buckets == 1


def test_from_parts_checks_every_part() -> None:
    values = torch.zeros(8, dtype=torch.uint8)  # 16 values at 4 bits
    mins = torch.arange(4, dtype=torch.float32)
    units = torch.ones(4)
    q = QuantizedTensor.from_parts(values, mins, units, (4, 4), torch.float32, 4, 4)
    assert torch.equal(q.mins, mins)
    assert torch.equal(q.units, units)
    assert torch.equal(q.values, values)
    assert q.shape == (4, 4)
    with pytest.raises(ValueError, match="mins has 3 elements"):
        QuantizedTensor.from_parts(values, mins[:3], units, (4, 4), torch.float32, 4, 4)
    with pytest.raises(ValueError, match=r"units has 4 elements of torch\.float16"):
        QuantizedTensor.from_parts(values, mins, units.half(), (4, 4), torch.float32, 4, 4)
    with pytest.raises(ValueError, match="values has 7"):
        QuantizedTensor.from_parts(values[:7], mins, units, (4, 4), torch.float32, 4, 4)
    tail = torch.tensor([5.0, 6.0])
    q2 = QuantizedTensor.from_parts(
        values, mins[:3], units[:3], (14,), torch.float32, 4, 4, tail=tail
    )
    assert q2.skip_incomplete_buckets
    assert torch.equal(q2.tail, tail)


def test_views_share_the_buffer_and_clone_copies() -> None:
    q = QuantizedTensor.empty((10,), torch.float16, 2, 4)
    q.buffer.zero_()
    q.units.fill_(2.0)
    assert q.units.dtype == torch.float16
    assert (q.units == 2.0).all()
    c = q.clone()
    q.units.fill_(3.0)
    assert (c.units == 2.0).all()
    assert "bits=2" in repr(q)
