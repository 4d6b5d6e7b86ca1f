"""quantize / dequantize / dequantize_add on every backend, against the torch reference."""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mpx.quantize as mq
from mpx.quantize import reference as R

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Relative rounding of the decoded value into each output dtype (half an ulp).
OUT_EPS = {torch.float32: 2.0**-23, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
BACKENDS = ["torch", "cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _device(backend: str) -> str:
    return "cuda" if backend == "cuda" else "cpu"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, except that any NaN equals any NaN."""
    if not torch.equal(a.isnan(), b.isnan()):
        return False
    return torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0))


def _units_per_element(q: mq.QuantizedTensor) -> torch.Tensor:
    owner = torch.arange(q.layout.quantized, device=q.device) // q.bucket_size
    return q.units.float()[owner]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", range(1, 9))
def test_nearest_error_is_at_most_half_a_unit(backend: str, dtype: torch.dtype, bits: int) -> None:
    g = torch.Generator().manual_seed(bits)
    for bucket_size, n in [(1, 5), (7, 100), (512, 3001), (64, 64)]:
        x = (torch.randn(n, generator=g) * 10).to(dtype).to(_device(backend))
        q = mq.quantize(x, bits, bucket_size, stochastic=False, backend=backend)
        y = mq.dequantize(q, backend=backend)
        assert y.shape == x.shape
        assert y.dtype == dtype
        err = (y.float() - x.float()).abs()
        unit = _units_per_element(q)
        bound = unit / 2 * (1 + 2**-20) + (x.float().abs() + unit) * OUT_EPS[dtype] * 2
        assert (err <= bound).all(), (bucket_size, n, (err - unit / 2).max().item())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bits", [1, 4, 8])
def test_finite_input_near_the_dtype_limits_decodes_finite(
    backend: str, dtype: torch.dtype, bits: int
) -> None:
    # The unit is rounded up, so the top code may decode a little past the
    # bucket's max: past the dtype's largest value, that would be inf.
    top = torch.finfo(dtype).max
    dev = _device(backend)
    x = torch.linspace(-1, 1, 1024, dtype=torch.float64).mul(top).to(dtype).to(dev)
    x[0], x[-1] = -top, top
    for stochastic in (False, True):
        q = mq.quantize(x, bits, 512, stochastic, backend=backend)
        y = mq.dequantize(q, backend=backend)
        assert bool(torch.isfinite(y).all()), (dtype, bits, stochastic, y.max())
        assert float(y.max()) <= top
        acc = torch.zeros_like(x)
        mq.dequantize_add(q, acc, backend=backend)
        assert torch.equal(acc, y)
    # Every backend decodes to the same bytes as the reference.
    ref = mq.dequantize(mq.quantize(x.cpu(), bits, 512, False, backend="torch"), backend="torch")
    assert torch.equal(mq.dequantize(mq.quantize(x, bits, 512, False, backend=backend)).cpu(), ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_stochastic_rounding_is_unbiased(backend: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, generator=g).to(_device(backend))
    draws = 300
    total = torch.zeros_like(x, dtype=torch.float64)
    for _ in range(draws):
        q = mq.quantize(x, bits=2, bucket_size=64, generator=g, backend=backend)
        total += mq.dequantize(q, backend=backend).double()
    unit = _units_per_element(q).double()
    mean_error = total / draws - x.double()
    # each draw errs by at most a unit with variance <= unit^2/4: 5 sigma per element
    assert (mean_error.abs() <= 5 * unit / (2 * draws**0.5)).all()
    overall = (mean_error / unit).mean().item()
    assert abs(overall) < 5 / (2 * (draws * x.numel()) ** 0.5)
    # nearest rounding is biased element by element: a far larger mean error
    nearest = mq.dequantize(mq.quantize(x, 2, 64, stochastic=False, backend=backend))
    assert (nearest.double() - x.double()).abs().mean() > 10 * mean_error.abs().mean()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_constant_buckets_and_single_values_are_exact(backend: str, dtype: torch.dtype) -> None:
    dev = _device(backend)
    x = torch.cat([torch.full((100,), 3.25), torch.zeros(100), torch.full((56,), -7.5)])
    x = x.to(dtype).to(dev)
    for stochastic in (False, True):
        q = mq.quantize(x, 3, 100, stochastic, backend=backend)
        assert torch.equal(mq.dequantize(q, backend=backend), x)
        assert (q.units == 0).all()
    g = torch.Generator().manual_seed(1)
    y = torch.randn(77, generator=g).to(dtype).to(dev)
    q = mq.quantize(y, 1, 1, True, backend=backend)  # one value per bucket
    assert torch.equal(mq.dequantize(q, backend=backend), y)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_flag_only_their_bucket(
    backend: str, dtype: torch.dtype, bad: float
) -> None:
    dev = _device(backend)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1000, generator=g).to(dtype).to(dev)
    clean = mq.dequantize(mq.quantize(x, 4, 128, seed=5, backend=backend))
    x[300] = bad
    q = mq.quantize(x, 4, 128, seed=5, backend=backend)
    y = mq.dequantize(q, backend=backend)
    flagged = torch.zeros(1000, dtype=torch.bool, device=dev)
    flagged[256:384] = True
    assert y[flagged].isnan().all()
    assert torch.equal(y[~flagged], clean[~flagged])
    assert q.mins[2].isnan()
    assert q.units[2].isnan()
    assert not q.mins[[0, 1, 3]].isnan().any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", range(2, 9))
def test_a_range_past_float32_quantizes_within_the_bound(
    backend: str, dtype: torch.dtype, bits: int
) -> None:
    # Issue 30: -3e38 and 3e38 in a bucket made all of it NaN (max - min overflowed).
    dev = _device(backend)
    g = torch.Generator().manual_seed(bits)
    wide = torch.linspace(-3e38, 3e38, 512, dtype=torch.float64)[torch.randperm(512, generator=g)]
    normal = torch.randn(512, generator=g, dtype=torch.float64)
    x = torch.cat([normal, wide]).to(dtype).to(dev)
    alone = mq.dequantize(mq.quantize(x[:512], bits, 512, False, backend=backend))
    for stochastic in (False, True):
        q = mq.quantize(x, bits, 512, stochastic, seed=4, backend=backend)
        y = mq.dequantize(q, backend=backend)
        assert not bool(y.isnan().any()), (stochastic, q.units)
        unit = q.units[1].double().item()
        assert 0 < unit < math.inf
        big, got = x[512:].double(), y[512:].double()
        step = unit if stochastic else unit / 2
        bound = step * (1 + 2**-20) + (big.abs() + unit) * OUT_EPS[dtype] * 2
        assert bool(((got - big).abs() <= bound).all()), stochastic
        acc = torch.zeros_like(x)
        assert torch.equal(mq.dequantize_add(q, acc, backend=backend), y)
        if not stochastic:
            assert torch.equal(y[:512], alone)  # the other bucket is untouched


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_unit_past_the_metadata_dtype_is_flagged(backend: str) -> None:
    dev = _device(backend)
    # At 1 bit the unit is the whole range: past float32 (here 6e38), or past
    # float16 for float16 metadata, it cannot be stored: that bucket alone is NaN.
    x32 = torch.tensor([-3e38, 3e38, 1.0, 2.0], device=dev)
    y32 = mq.dequantize(mq.quantize(x32, 1, 2, stochastic=False, backend=backend))
    assert y32[:2].isnan().all()
    assert torch.equal(y32[2:], x32[2:])
    x16 = torch.tensor([-60000.0, 60000.0, 1.0, 2.0], dtype=torch.float16, device=dev)
    y16 = mq.dequantize(mq.quantize(x16, 1, 2, stochastic=False, backend=backend))
    assert y16[:2].isnan().all()
    assert torch.equal(y16[2:], x16[2:])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_and_shaped_tensors_round_trip(backend: str, dtype: torch.dtype) -> None:
    dev = _device(backend)
    for shape in [(0,), (3, 0), ()]:
        x = torch.ones(shape, dtype=dtype, device=dev) * 0.5
        y = mq.dequantize(mq.quantize(x, backend=backend), backend=backend)
        assert y.shape == x.shape
        assert y.dtype == dtype
        assert torch.equal(y, x)
    x = torch.arange(24, dtype=dtype, device=dev).view(2, 3, 4)
    y = mq.dequantize(mq.quantize(x, 8, 6, stochastic=False, backend=backend))
    assert y.shape == (2, 3, 4)
    assert (y.float() - x.float()).abs().max() <= 6 / 255 / 2 + 6 * OUT_EPS[dtype] * 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_skip_incomplete_buckets_keeps_the_tail_raw(backend: str) -> None:
    dev = _device(backend)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3)).to(dev)
    q = mq.quantize(x, 2, 256, skip_incomplete_buckets=True, backend=backend)
    assert q.layout.quantized == 768
    assert q.num_buckets == 3
    assert torch.equal(q.tail, x[768:])
    y = mq.dequantize(q, backend=backend)
    assert torch.equal(y[768:], x[768:])
    acc = torch.ones(1000, device=dev)
    mq.dequantize_add(q, acc, backend=backend)
    assert torch.equal(acc, y + 1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_add_is_one_rounding_of_the_float32_sum(
    backend: str, dtype: torch.dtype
) -> None:
    dev = _device(backend)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(999, generator=g).to(dtype).to(dev)
    acc = torch.randn(999, generator=g).to(dtype).to(dev)
    q = mq.quantize(x, 5, 100, stochastic=False, backend=backend)
    decoded = R.decode_codes(q)  # float32, the exact formula
    expected = (acc.float() + decoded).to(dtype)
    got = mq.dequantize_add(q, acc.clone(), backend=backend)
    assert torch.equal(got, expected)
    # into another output dtype
    out = torch.empty(999, dtype=torch.float32, device=dev)
    assert torch.equal(mq.dequantize(q, out=out, backend=backend), decoded)


def test_stochastic_rounding_is_deterministic_per_seed() -> None:
    x = torch.randn(5000, generator=torch.Generator().manual_seed(5))
    a = mq.quantize(x, 3, 100, generator=torch.Generator().manual_seed(9))
    b = mq.quantize(x, 3, 100, generator=torch.Generator().manual_seed(9))
    c = mq.quantize(x, 3, 100, generator=torch.Generator().manual_seed(10))
    assert torch.equal(a.buffer, b.buffer)
    assert not torch.equal(a.values, c.values)
    torch.manual_seed(1)
    d = mq.quantize(x, 3, 100)
    torch.manual_seed(1)
    assert torch.equal(d.buffer, mq.quantize(x, 3, 100).buffer)


CASES = list(itertools.product(DTYPES, range(1, 9), [1, 3, 8, 100, 512], [0, 1, 13, 1000, 4099]))


def _add_wide_buckets(x: torch.Tensor) -> None:
    """Puts in ``x`` (n > 20) a bucket whose range overflows float32 and one whose
    range is float32's largest value (wide by ``levels * unit`` at 5 and 7 bits)."""
    if x.dtype == torch.float16:
        return  # such values are inf in float16
    n = x.numel()
    x[n // 4 : n // 4 + 2] = torch.tensor([-3e38, 3e38])
    x[3 * n // 4 : 3 * n // 4 + 2] = torch.tensor([-1.7014117e38, 1.7014117e38])


@pytest.mark.parametrize("stochastic", [False, True])
def test_cpu_kernel_is_bit_identical_to_the_reference(stochastic: bool) -> None:
    g = torch.Generator().manual_seed(6)
    for dtype, bits, bucket_size, n in CASES:
        x = (torch.randn(n, generator=g) * 3).to(dtype)
        if n > 20:
            x[17] = float("nan") if bits % 2 else float("inf")
            x[n // 2 : n // 2 + 9] = 0.5  # a constant run
            _add_wide_buckets(x)
        a = mq.quantize(x, bits, bucket_size, stochastic, seed=12345, backend="cpu")
        b = R.quantize(x, bits, bucket_size, stochastic, seed=12345)
        case = (dtype, bits, bucket_size, n)
        assert torch.equal(a.values, b.values), case
        assert _same(a.mins, b.mins), case
        assert _same(a.units, b.units), case
        assert _same(mq.dequantize(a, backend="cpu"), R.dequantize(b)), case
        acc = torch.randn(n, generator=g).to(dtype)
        assert _same(mq.dequantize_add(a, acc.clone(), backend="cpu"), R.dequantize_add(b, acc))


def test_cpu_kernel_result_does_not_depend_on_threads() -> None:
    x = torch.randn(300_000, generator=torch.Generator().manual_seed(7))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = mq.quantize(x, 4, 100, seed=3, backend="cpu")
        y1 = mq.dequantize(one, backend="cpu")
        torch.set_num_threads(4)
        four = mq.quantize(x, 4, 100, seed=3, backend="cpu")
        y4 = mq.dequantize(four, backend="cpu")
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one.buffer, four.buffer)
    assert torch.equal(y1, y4)


def test_non_contiguous_input_is_accepted() -> None:
    x = torch.randn(64, 32).t()
    assert not x.is_contiguous()
    q = mq.quantize(x, 8, 64, stochastic=False)
    ref = R.quantize(x.contiguous(), 8, 64, stochastic=False)
    assert torch.equal(q.buffer, ref.buffer)
    assert q.shape == (32, 64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("skip", [False, True])
def test_quantize_into_out_gives_the_same_bytes(backend: str, skip: bool) -> None:
    device = _device(backend)
    x = torch.randn(1000, device=device)
    fresh = mq.quantize(x, 3, 64, seed=7, skip_incomplete_buckets=skip, backend=backend)
    # A view of a larger buffer, as the compressed allreduce's send rows are.
    host = torch.full((fresh.nbytes + 16,), 0xAB, dtype=torch.uint8, device=device)
    target = mq.QuantizedTensor(host[: fresh.nbytes], (1000,), torch.float32, 3, 64, skip)
    got = mq.quantize(x, 3, 64, seed=7, skip_incomplete_buckets=skip, backend=backend, out=target)
    assert got is target
    assert torch.equal(host[: fresh.nbytes], fresh.buffer)
    assert bool((host[fresh.nbytes :] == 0xAB).all())  # nothing written past it


def test_quantize_out_that_does_not_fit_names_the_difference() -> None:
    x = torch.randn(100)
    wrong = mq.QuantizedTensor.empty((100,), torch.float32, 4, 32)
    with pytest.raises(mq.QuantizeValueError, match=r"bits=4 \(needs 3\).*QuantizedTensor\.empty"):
        mq.quantize(x, 3, 32, out=wrong)
    with pytest.raises(mq.QuantizeValueError, match=r"shape=\(100,\) \(needs \(10, 10\)\)"):
        mq.quantize(x.view(10, 10), 4, 32, out=wrong)
    with pytest.raises(mq.QuantizeTypeError, match="out must be a QuantizedTensor, got Tensor"):
        mq.quantize(x, 4, 32, out=torch.empty(10))  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", BACKENDS)
def test_bucket_size_past_int64_names_the_value_and_the_range(backend: str) -> None:
    # Issue 30: bucket_size=2**63 reached the extension: a raw pybind11 TypeError.
    x = torch.randn(100, device=_device(backend))
    for bad in (2**63, 2**60 + 1, 10**30):
        with pytest.raises(
            mq.QuantizeValueError, match=rf"bucket_size={bad} must be .* 1 to 2\*\*60"
        ):
            mq.quantize(x, bucket_size=bad, backend=backend)
        with pytest.raises(ValueError, match=f"bucket_size={bad}"):
            mq.QuantizedTensor.empty((100,), torch.float32, 4, bad)
    # The largest accepted size is one bucket for any tensor, as bucket_size=numel.
    big = mq.quantize(x, 4, 2**60, seed=1, backend=backend)
    assert torch.equal(big.buffer, mq.quantize(x, 4, 100, seed=1, backend=backend).buffer)
    assert torch.equal(
        mq.dequantize(big, backend=backend),
        mq.dequantize(mq.quantize(x, 4, 100, seed=1, backend=backend), backend=backend),
    )


def test_bad_arguments_name_the_value() -> None:
    x = torch.randn(10)
    for bits in (0, 9, 2.5, True):
        with pytest.raises(ValueError, match=f"bits={bits!r}"):
            mq.quantize(x, bits=bits)  # type: ignore[arg-type]
    for bucket_size in (0, -3):
        with pytest.raises(ValueError, match=f"bucket_size={bucket_size}"):
            mq.quantize(x, bucket_size=bucket_size)
    for dtype in (torch.int32, torch.int64, torch.complex64, torch.float64, torch.uint8):
        with pytest.raises(TypeError, match=str(dtype)):
            mq.quantize(torch.zeros(4, dtype=dtype))
    with pytest.raises(TypeError, match="list"):
        mq.quantize([1.0, 2.0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backend='gpu'"):
        mq.quantize(x, backend="gpu")
    with pytest.raises(ValueError, match="seed=-1"):
        mq.quantize(x, seed=-1)
    q = mq.quantize(x)
    with pytest.raises(ValueError, match="out has 9 elements"):
        mq.dequantize(q, out=torch.empty(9))
    with pytest.raises(ValueError, match="contiguous"):
        mq.dequantize(q, out=torch.empty(20)[::2])
    with pytest.raises(TypeError, match=r"torch\.int64"):
        mq.dequantize_add(q, torch.zeros(10, dtype=torch.int64))
    with pytest.raises(TypeError, match="QuantizedTensor"):
        mq.dequantize(x)  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.parametrize("stochastic", [False, True])
def test_cuda_kernel_is_bit_identical_to_cpu_and_reference(stochastic: bool) -> None:
    assert "cuda" in mq.available_backends(usable_only=True)
    g = torch.Generator().manual_seed(8)
    for dtype, bits, bucket_size, n in [*CASES, (torch.float32, 4, 512, 1 << 22)]:
        x = (torch.randn(n, generator=g) * 3).to(dtype)
        if n > 20:
            x[17] = float("nan") if bits % 2 else float("inf")
            _add_wide_buckets(x)
        a = mq.quantize(x, bits, bucket_size, stochastic, seed=99, backend="cpu")
        c = mq.quantize(x.cuda(), bits, bucket_size, stochastic, seed=99, backend="cuda")
        case = (dtype, bits, bucket_size, n)
        assert torch.equal(a.values, c.values.cpu()), case
        assert _same(a.mins, c.mins.cpu()), case
        assert _same(a.units, c.units.cpu()), case
        if n <= 5000:
            b = R.quantize(x, bits, bucket_size, stochastic, seed=99)
            assert torch.equal(b.values, c.values.cpu()), case
        assert _same(mq.dequantize(a), mq.dequantize(c, backend="cuda").cpu()), case
        acc = torch.randn(n, generator=g).to(dtype)
        assert _same(
            mq.dequantize_add(a, acc.clone()),
            mq.dequantize_add(c, acc.cuda(), backend="cuda").cpu(),
        ), case


@pytest.mark.gpu
def test_cuda_kernel_runs_on_the_current_stream() -> None:
    x = torch.randn(1 << 20, device="cuda")
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # unannotated in torch
    with torch.cuda.stream(stream):
        q = mq.quantize(x, 4, 512, stochastic=False)
        y = mq.dequantize(q)
    stream.synchronize()
    assert (y - x).abs().max().item() <= q.units.float().max().item() / 2 * 1.001


_VARIANT_SCRIPT = """
import sys, torch, mpx.quantize as mq
g = torch.Generator().manual_seed(11)
out = []
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for bits in (1, 3, 4, 8):
        x = (torch.randn(70_001, generator=g) * 5).to(dtype)
        x[5] = float("nan")
        if dtype != torch.float16:
            x[1000], x[1001] = -3e38, 3e38  # a range past float32
        for stochastic in (False, True):
            q = mq.quantize(x, bits, 100, stochastic, seed=42, backend="cpu")
            acc = torch.ones(70_001, dtype=dtype)
            mq.dequantize_add(q, acc, backend="cpu")
            out += [q.buffer, mq.dequantize(q, backend="cpu").view(torch.uint8),
                    acc.view(torch.uint8)]
torch.save([mq.build_info()["cpu"]["kernels"], out], sys.argv[1])
"""


def test_baseline_and_avx2_kernel_variants_give_the_same_bytes(tmp_path: Path) -> None:
    results = {}
    for variant in ("baseline", "default"):
        env = dict(os.environ)
        if variant == "baseline":
            env["MPX_QUANTIZE_CPU_KERNELS"] = "baseline"
        else:
            env.pop("MPX_QUANTIZE_CPU_KERNELS", None)
        path = tmp_path / f"{variant}.pt"
        subprocess.run([sys.executable, "-c", _VARIANT_SCRIPT, str(path)], env=env, check=True)
        results[variant] = torch.load(path)
    assert results["baseline"][0] == "baseline"
    for a, b in zip(results["baseline"][1], results["default"][1], strict=True):
        assert torch.equal(a, b)
