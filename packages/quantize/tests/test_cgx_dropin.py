"""CGX's own test cases, its API and its cifar example's distributed part, on mpx (issue 44).

Written here from CGX's test file's inputs and tolerances (IST-DASLab/torch_cgx,
``test/test_cgx.py``; none of its code): the default group is ``"cgx"``, made
from Open MPI's variables as CGX's test does (mpxrun exports them), tensors on
the CPU. The ``CGX_*`` variables change between calls, as in CGX's test.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch_cgx

from mpx.quantize.errors import QuantizeValueError

_CGX_VARIABLES = (
    "CGX_COMPRESSION_QUANTIZATION_BITS",
    "CGX_COMPRESSION_BUCKET_SIZE",
    "MPX_QUANTIZE_BITS",
    "MPX_QUANTIZE_BUCKET_SIZE",
)


@pytest.fixture(scope="module")
def cgx_world() -> Iterator[tuple[int, int]]:
    """The default group on "cgx", its rank and size from OMPI_COMM_WORLD_* (CGX's setUp)."""
    assert "OMPI_COMM_WORLD_SIZE" in os.environ, "mpxrun exports Open MPI's variables"
    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    size = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    saved = {name: os.environ.pop(name, None) for name in _CGX_VARIABLES}
    os.environ["WORLD_SIZE"] = str(size)
    dist.init_process_group(backend="cgx", init_method="env://", rank=rank)
    try:
        yield rank, size
    finally:
        torch_cgx.clear_layers()
        dist.barrier()
        dist.destroy_process_group()
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


@pytest.fixture
def cgx_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """Every test starts with CGX's variables unset, and leaves them so."""
    for name in _CGX_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch
    torch_cgx.clear_layers()


def _equal_cases(rank: int, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """CGX's reduce_equal_tests: every rank sends rank + 1; the sum is exact at any bits."""
    cases = []
    for dtype in (torch.float16, torch.float32, torch.int32):
        for n in (1, 2, 8, 128, 1024, 1000000):
            cases.append(
                (
                    torch.full((n,), rank + 1, dtype=dtype),
                    torch.full((n,), size * (size + 1) // 2, dtype=dtype),
                )
            )
    return cases


def _ramp(n: int, dtype: torch.dtype) -> np.ndarray:
    ramp = np.arange(-n / 2, n / 2, 1.0)
    return ramp * 1e-3 if dtype == torch.float16 else ramp


@pytest.mark.mpi
def test_uncompressed_is_exact(cgx_world: tuple[int, int], cgx_env: pytest.MonkeyPatch) -> None:
    rank, size = cgx_world
    cgx_env.setenv("CGX_COMPRESSION_QUANTIZATION_BITS", "32")
    for x, expected in _equal_cases(rank, size):
        t = x.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        assert torch.equal(t, expected), (t.dtype, t.numel())


@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_compressed_exact(cgx_world: tuple[int, int], cgx_env: pytest.MonkeyPatch) -> None:
    """Constant tensors: each quantization bucket's range is 0, so 2-8 bits are exact."""
    rank, size = cgx_world
    cases = _equal_cases(rank, size)
    for bits in (2, 4, 8):
        cgx_env.setenv("CGX_COMPRESSION_QUANTIZATION_BITS", str(bits))
        for x, expected in cases:
            for _ in range(10):
                t = x.clone()
                dist.all_reduce(t, op=dist.ReduceOp.SUM)
                assert torch.equal(t, expected), (bits, t.dtype, t.numel())


@pytest.mark.mpi
@pytest.mark.timeout(900)
def test_compressed_non_exact(cgx_world: tuple[int, int], cgx_env: pytest.MonkeyPatch) -> None:
    """CGX's bound, with bits and bucket size changed between calls through the environment.

    mpx read the variables once, when the group was made (here: none set, 32
    bits): the sums came back exact, and in CGX's own order of tests off by
    5.9176 where the bound of 8 bits and 64 values is 3.0118.
    """
    rank, size = cgx_world
    coef = size * (size + 1)
    for bits in (2, 3, 4, 6, 8):
        cgx_env.setenv("CGX_COMPRESSION_QUANTIZATION_BITS", str(bits))
        inexact = 0  # sums off at all: quantized, not sent exact (the variables were read)
        for dtype in (torch.float16, torch.float32):
            for n in (128, 1024, 1025, 16384, 1000000):
                ramp = _ramp(n, dtype)
                x = torch.tensor((rank + 1) * ramp, dtype=dtype)
                expected = torch.tensor(coef / 2 * ramp, dtype=dtype)
                for bucket_size in (64, 512, 2048):
                    cgx_env.setenv("CGX_COMPRESSION_BUCKET_SIZE", str(bucket_size))
                    # CGX's ten repeats; the 1M-element tensors twice (a 2-core machine)
                    for _ in range(2 if n == 1000000 else 10):
                        t = x.clone()
                        dist.all_reduce(t, op=dist.ReduceOp.SUM)
                        error = torch.norm((t - expected).float(), p=float("inf")).item()
                        bound = 2 * min(bucket_size, n) / ((1 << bits) - 1) * coef
                        assert error < bound, (bits, bucket_size, dtype, n, error, bound)
                        # float32 sums of integers are exact unless quantized; float16's
                        # sums round whatever the bits
                        inexact += error > 0 and dtype == torch.float32
        # (A ramp can be exact: 6 bits over 64 integers is a unit of rank + 1.)
        assert inexact > 0 or size == 1, bits


@pytest.mark.mpi
def test_the_variables_are_read_at_each_all_reduce(
    cgx_world: tuple[int, int], cgx_env: pytest.MonkeyPatch
) -> None:
    rank, size = cgx_world
    ramp = torch.arange(-2048.0, 2048.0) * (rank + 1)
    expected = ramp / (rank + 1) * (size * (size + 1) / 2)

    def error() -> float:
        t = ramp.clone()
        dist.all_reduce(t)
        return (t - expected).abs().max().item()

    assert error() == 0  # no variable: CGX's 32 bits
    cgx_env.setenv("CGX_COMPRESSION_QUANTIZATION_BITS", "2")
    cgx_env.setenv("CGX_COMPRESSION_BUCKET_SIZE", "4096")
    coarse = error()
    cgx_env.setenv("CGX_COMPRESSION_QUANTIZATION_BITS", "8")
    cgx_env.setenv("CGX_COMPRESSION_BUCKET_SIZE", "64")
    fine = error()
    # the 8-bit, 64-value bound (CGX's), well below anything 2 bits over 4096 values give
    assert fine < 2 * 64 / 255 * size * (size + 1)
    cgx_env.setenv("CGX_COMPRESSION_QUANTIZATION_BITS", "32")
    assert error() == 0
    if size > 1:
        assert coarse > 4 * fine > 0, (coarse, fine)


@pytest.mark.mpi
def test_an_out_of_range_variable_is_an_error_naming_it(
    cgx_world: tuple[int, int], cgx_env: pytest.MonkeyPatch
) -> None:
    """bits=40 was read (once) as an error only where the group was made, else never."""
    t = torch.ones(4096)
    for name, value in (
        ("CGX_COMPRESSION_QUANTIZATION_BITS", "40"),
        ("CGX_COMPRESSION_BUCKET_SIZE", "0"),
    ):
        cgx_env.setenv("CGX_COMPRESSION_QUANTIZATION_BITS", "4")
        cgx_env.setenv(name, value)
        with pytest.raises(QuantizeValueError, match=f"{name}='{value}'"):
            dist.all_reduce(t)
        cgx_env.delenv(name)
    dist.all_reduce(t)  # every rank raised before sending: the group still works


@pytest.mark.mpi
def test_register_layer_gives_each_layer_its_bits_and_bucket_size(
    cgx_world: tuple[int, int], cgx_env: pytest.MonkeyPatch
) -> None:
    """Per-layer bits within one bucket, buckets in index order, as CGX's register_layer."""
    rank, size = cgx_world
    cgx_env.setenv("CGX_COMPRESSION_QUANTIZATION_BITS", "8")  # layers with bits 0 take this
    layers = [(1000, 32, 0), (4096, 2, 64), (4096, 0, 0)]  # exact; 2 bits/64; the env's
    for i, (n, bits, bucket) in enumerate(layers):
        torch_cgx.register_layer(0, i, n, bits, bucket)
    torch_cgx.register_layer(1, 0, 300, 32, 0)
    gen = torch.Generator().manual_seed(rank)
    coef = size * (size + 1)
    for _ in range(2):  # twice round: bucket 0, bucket 1, bucket 0, bucket 1
        x = torch.randn(9192, generator=gen) * (rank + 1)
        every = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(every, x)  # all_gather is exact on "cgx"
        exact = torch.stack(every).double().sum(0)
        t = x.clone()
        dist.all_reduce(t)
        err = (t.double() - exact).abs()
        span = max(float(e.max() - e.min()) for e in every)  # every bucket's range <= this
        assert err[:1000].max().item() <= 1e-4  # bits 32: exact (float32 sums)
        assert err[1000:5096].max().item() <= 2 * span / 3 * coef / 2
        assert err[5096:].max().item() <= 2 * span / 255 * coef / 2
        if size > 1:  # 2 bits where asked, 8 bits where the environment said
            assert err[1000:5096].max().item() > 4 * err[5096:].max().item()
        small = torch.full((300,), float(rank))
        dist.all_reduce(small)
        assert torch.equal(small, torch.full((300,), float(size * (size - 1) // 2)))
    torch_cgx.set_quantization_bits(0, 1, 32)
    torch_cgx.set_quantization_bucket_size(0, 2, 16)
    x = torch.randn(9192, generator=gen)
    every = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(every, x)
    t = x.clone()
    dist.all_reduce(t)
    err = (t.double() - torch.stack(every).double().sum(0)).abs()
    assert err[:5096].max().item() <= 1e-4  # now exact
    if size > 1:
        assert err[5096:].max().item() > 0
    dist.all_reduce(torch.zeros(300))  # bucket 1, to leave the cycle at bucket 0
    # a tensor of 16 elements or more that is not the bucket due: an error, on every rank
    with pytest.raises(QuantizeValueError, match=r"all_reduce of 777 elements.*bucket 0"):
        dist.all_reduce(torch.zeros(777))


def test_register_layer_refuses_bad_values() -> None:
    try:
        for args, match in (
            ((0, 0, 100, 40, 0), "bits=40"),
            ((0, 0, 100, 9, 0), "bits=9"),
            ((0, 0, 0, 4, 0), "numel=0"),
            ((-1, 0, 100, 4, 0), "bucket_idx=-1"),
            ((0, 0, 100, 4, 2**61), "bucket_size=2305843009213693952"),
            # negatives were read as "the environment's", and 10**12 past CGX's C int
            ((0, 0, 100, -1, 0), "bits=-1"),
            ((0, 0, 100, 4, -3), "bucket_size=-3"),
            ((0, 0, 100, 4, 10**12), r"bucket_size=1000000000000 .*2\*\*31 - 1"),
        ):
            with pytest.raises(QuantizeValueError, match=match):
                torch_cgx.register_layer(*args)
        with pytest.raises(
            QuantizeValueError, match=r"set_quantization_bits\(3, 0.*register_layer"
        ):
            torch_cgx.set_quantization_bits(3, 0, 4)
        torch_cgx.register_layer(0, 0, 100, 4, 0)
        with pytest.raises(QuantizeValueError, match="bits=33"):
            torch_cgx.set_quantization_bits(0, 0, 33)
        with pytest.raises(QuantizeValueError, match="bits=-1"):
            torch_cgx.set_quantization_bits(0, 0, -1)
        for bad in (-5, 10**12):
            with pytest.raises(QuantizeValueError, match=f"bucket_size={bad}"):
                torch_cgx.set_quantization_bucket_size(0, 0, bad)
        torch_cgx.set_quantization_bucket_size(0, 0, 2**31 - 1)  # the largest CGX takes
        torch_cgx.set_quantization_bucket_size(0, 0, 0)  # the environment's again
        torch_cgx.set_quantization_bits(0, 0, 0)
    finally:
        torch_cgx.clear_layers()


def test_settings_check_reports_out_of_range_cgx_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``CGX_COMPRESSION_QUANTIZATION_BITS=40 mpxrun --settings`` exited 0 without a word."""
    import io

    from mpx.launch.settings import check_environment

    for name, value in (
        ("CGX_COMPRESSION_QUANTIZATION_BITS", "40"),
        ("CGX_COMPRESSION_BUCKET_SIZE", "0"),
        ("CGX_INNER_COMMUNICATOR_TYPE", "NCCL"),
    ):
        with monkeypatch.context() as env:
            env.setenv(name, value)
            out = io.StringIO()
            assert check_environment(out) == 1, name
            assert f"{name}='{value}'" in out.getvalue()
    monkeypatch.setenv("CGX_COMPRESSION_QUANTIZATION_BITS", "32")
    assert check_environment(io.StringIO()) == 0
