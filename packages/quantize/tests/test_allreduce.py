"""The compressed allreduce under 1, 2 and 3 ranks (run with mpxrun; size-agnostic).

The independent check is a one-process simulation of the algorithm with the
pure-torch reference quantizer: with nearest rounding the distributed result
must equal it bit for bit, and both must lie within the analytical bound
(sum of the senders' half units + the owner's half unit) of the exact sum.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import mpx.quantize as mq
from mpx.collectives import allreduce as plain_allreduce
from mpx.collectives import world
from mpx.quantize import reference as R
from mpx.quantize.reduction.compressed_allreduce import chunk_bounds

pytestmark = pytest.mark.mpi


def _inputs(n: int, dtype: torch.dtype, size: int) -> list[torch.Tensor]:
    """Every rank's input, known to every rank (seeded by the rank)."""
    return [
        (torch.randn(n, generator=torch.Generator().manual_seed(50 + j)) * (j + 1)).to(dtype)
        for j in range(size)
    ]


def _units(q: mq.QuantizedTensor, n: int) -> torch.Tensor:
    owner = torch.arange(q.layout.quantized) // q.bucket_size
    units = torch.zeros(n)
    units[: q.layout.quantized] = q.units.float()[owner]
    return units


def _simulate(
    xs: list[torch.Tensor], config: mq.CompressionConfig, op: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The algorithm in one process with nearest rounding: (result, error bound per element)."""
    p, n, dtype = len(xs), xs[0].numel(), xs[0].dtype
    if p == 1:  # as allreduce does: one rank's sum is its tensor, nothing quantized
        return xs[0].clone(), torch.zeros(n)
    kw: dict[str, Any] = {
        "bits": config.bits,
        "bucket_size": config.bucket_size,
        "stochastic": False,
        "skip_incomplete_buckets": config.skip_incomplete_buckets,
    }
    out = torch.empty(n, dtype=dtype)
    bound = torch.zeros(n)
    for c, (s, e) in enumerate(chunk_bounds(n, p)):
        acc = xs[c][s:e].float()
        for j in range(p):
            if j != c:
                q = R.quantize(xs[j][s:e], **kw)
                R.dequantize_add(q, acc)
                bound[s:e] += _units(q, e - s) / 2 / (p if op == "avg" else 1)
        if op == "avg":
            acc.div_(p)
        q = R.quantize(acc.to(dtype), **kw)
        R.dequantize(q, out=out[s:e])
        bound[s:e] += _units(q, e - s) / 2
    return out, bound


def _same_on_all_ranks(t: torch.Tensor) -> bool:
    raw = t.contiguous().view(-1).view(torch.uint8).numpy()
    everyone = world().mpi.allgather(raw)
    return all(np.array_equal(everyone[0], other) for other in everyone)


EPS = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

Case = tuple[torch.dtype, int, int, int, str, bool]
CASES: list[Case] = [
    # dtype, n, bits, bucket_size, op, skip_incomplete_buckets
    (torch.float32, 1000, 4, 512, "sum", False),
    (torch.float32, 4099, 1, 7, "avg", False),
    (torch.float32, 17, 8, 1, "sum", False),
    (torch.float32, 3001, 3, 100, "avg", True),
    (torch.float16, 2000, 4, 256, "sum", False),
    (torch.bfloat16, 999, 8, 64, "avg", False),
    (torch.float32, 20_000, 2, 1024, "sum", False),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_equals_the_simulation_bit_for_bit_and_is_within_the_bound(case: Case) -> None:
    dtype, n, bits, bucket_size, op, skip = case
    comm = world()
    xs = _inputs(n, dtype, comm.size)
    config = mq.CompressionConfig(
        bits=bits, bucket_size=bucket_size, skip_incomplete_buckets=skip, stochastic=False
    )
    t = xs[comm.rank].clone()
    assert mq.allreduce(t, comm, op=op, config=config) is t
    assert _same_on_all_ranks(t)
    exact = torch.stack([x.double() for x in xs]).sum(0) / (comm.size if op == "avg" else 1)
    expected, bound = _simulate(xs, config, op)
    assert torch.equal(t, expected)
    err = (t.double() - exact).abs()
    magnitude = torch.stack([x.double().abs() for x in xs]).sum(0)  # float32 sums round too
    slack = EPS[dtype] * (magnitude + bound.double()) + 1e-12
    assert (err <= bound.double() * (1 + 1e-5) + slack).all(), (err - bound).max().item()


def test_stochastic_rounding_within_twice_the_bound_and_identical_on_ranks() -> None:
    comm = world()
    n = 5000
    xs = _inputs(n, torch.float32, comm.size)
    config = mq.CompressionConfig(bits=4, bucket_size=512, stochastic=True)
    t = xs[comm.rank].clone()
    mq.allreduce(t, comm, op="sum", config=config)
    assert _same_on_all_ranks(t)
    exact = torch.stack([x.double() for x in xs]).sum(0)
    if comm.size == 1:
        assert torch.equal(t, xs[0])  # nothing to reduce: the tensor itself
        pytest.skip("one rank: nothing is quantized, so there is no stochastic rounding to check")
    _, bound = _simulate(xs, config, "sum")
    # stochastic: at most a whole unit per quantization; the owner's unit may grow by the
    # senders' errors (range + 2 * sum of sender units) / levels
    senders = 2 * bound.max().item()
    err = (t.double() - exact).abs()
    assert (err <= 2 * bound.double() + 2 * senders / 15 + 1e-4).all()
    # unbiased on average: the mean signed error is far below the mean absolute error
    assert abs((t.double() - exact).mean().item()) < 0.1 * err.mean().item()


def test_small_and_integer_tensors_go_uncompressed() -> None:
    comm = world()
    small = torch.arange(15, dtype=torch.float32) * (comm.rank + 1)
    expected = small.clone()
    plain_allreduce(expected, "sum", comm=comm)
    mq.allreduce(small, comm, bits=2, op="sum")
    assert torch.equal(small, expected)
    ints = torch.full((1000,), comm.rank + 1, dtype=torch.int64)
    mq.allreduce(ints, comm, op="sum")
    assert (ints == comm.size * (comm.size + 1) // 2).all()
    big = torch.randn(5000, generator=torch.Generator().manual_seed(comm.rank))
    expected = big.clone()
    plain_allreduce(expected, "avg", comm=comm)
    mq.allreduce(big, comm, op="avg", config=mq.CompressionConfig(bits=32))  # CGX's "off"
    assert torch.equal(big, expected)


def test_flat_bucket_from_dataparallel_is_compressed() -> None:
    # mpx-dataparallel calls allreduce(flat_bucket, comm=comm, config=config, op="avg")
    comm = world()
    state = mq.QuantizeState(mq.CompressionConfig(bits=4), comm)
    flat = torch.randn(100_000, generator=torch.Generator().manual_seed(comm.rank))
    mq.allreduce(flat, comm=comm, config=state.config, op="avg", state=state)
    assert _same_on_all_ranks(flat)
    if comm.size > 1:
        # metadata included, 4 bits is about 1/7.5 of float32 on the wire
        assert state.bytes_sent <= state.bytes_uncompressed / 7


def test_non_contiguous_and_shaped_tensors() -> None:
    comm = world()
    base = torch.randn(64, 48, generator=torch.Generator().manual_seed(comm.rank))
    t = base.t()
    config = mq.CompressionConfig(bits=8, stochastic=False)
    mq.allreduce(t, comm, op="sum", config=config)
    assert t.shape == (48, 64)
    assert _same_on_all_ranks(t.contiguous())
    exact = sum(
        (torch.randn(64, 48, generator=torch.Generator().manual_seed(j)) for j in range(comm.size)),
        torch.zeros(64, 48),
    ).t()
    assert (t - exact).abs().max() < 0.1 * comm.size


def test_allreduce_tensors_filters_layers_and_fuses() -> None:
    comm = world()
    g = torch.Generator().manual_seed(comm.rank)
    shapes = {
        "conv.weight": (16, 8, 3),
        "conv.bias": (16,),
        "bn.weight": (40, 40),
        "fc.weight": (10, 30),
        "tiny.weight": (2, 3),
    }
    tensors = [torch.randn(s, generator=g) for s in shapes.values()]
    exact = [t.clone() for t in tensors]
    for e in exact:
        plain_allreduce(e, "avg", comm=comm)
    config = mq.CompressionConfig(bits=2, exclude=("bn",), fusion_buffer_mb=0.001, stochastic=False)
    state = mq.QuantizeState(config, comm)
    out = mq.allreduce_tensors(tensors, comm, config, "avg", names=list(shapes), state=state)
    assert out is not tensors
    assert all(a is b for a, b in zip(out, tensors, strict=True))
    for name, t, e in zip(shapes, tensors, exact, strict=True):
        assert _same_on_all_ranks(t), name
        if name in ("conv.bias", "bn.weight", "tiny.weight") or comm.size == 1:
            assert torch.equal(t, e), name  # 1-D, excluded, too small: full precision
        else:
            assert not torch.equal(t, e), name  # compressed at 2 bits
            assert (t - e).abs().max() < 2.0, name
    with pytest.raises(ValueError, match="names has 1 entries for 5 tensors"):
        mq.allreduce_tensors(tensors, comm, config, names=["x"])


def test_error_feedback_removes_the_bias_over_steps() -> None:
    comm = world()
    if comm.size == 1:
        pytest.skip("one rank: nothing is compressed")
    n = 4096
    xs = _inputs(n, torch.float32, comm.size)
    exact = torch.stack(xs).double().sum(0)
    means = {}
    for feedback in (False, True):
        config = mq.CompressionConfig(bits=2, stochastic=False, error_feedback=feedback)
        state = mq.QuantizeState(config, comm)
        total = torch.zeros(n, dtype=torch.float64)
        steps = 16
        for _ in range(steps):
            t = xs[comm.rank].clone()
            mq.allreduce(t, comm, op="sum", config=config, state=state, key="grad")
            total += t.double()
        means[feedback] = (total / steps - exact).abs().mean().item()
    # nearest rounding without feedback repeats the same error every step
    assert means[True] < 0.25 * means[False]


def test_bad_op_and_input() -> None:
    with pytest.raises(ValueError, match="op='max'"):
        mq.allreduce(torch.zeros(100), op="max")
    with pytest.raises(TypeError, match="list"):
        mq.allreduce([1.0])  # type: ignore[arg-type]


@pytest.mark.gpu
def test_cuda_tensor_allreduce_matches_cpu() -> None:
    comm = world()
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(comm.rank))
    config = mq.CompressionConfig(bits=4, stochastic=False)
    on_cpu = mq.allreduce(x.clone(), comm, config=config)
    on_gpu = mq.allreduce(x.cuda(), comm, config=config)
    assert torch.equal(on_cpu, on_gpu.cpu())


@pytest.mark.parametrize(
    ("field", "mine"),
    [
        ("bits", lambda r: {"bits": 4 if r == 0 else 2}),
        ("bucket_size", lambda r: {"bucket_size": 512 if r == 0 else 128}),
    ],
)
def test_ranks_with_different_configurations_raise_naming_the_field(field: str, mine: Any) -> None:
    """Different bits or bucket sizes gave values up to 1e35 and diverging ranks, silently."""
    from mpx.collectives import MismatchError

    comm = world()
    t = torch.ones(4096)
    if comm.size == 1:
        mq.allreduce(t, comm, **mine(0))  # nothing can differ
        return
    with pytest.raises(
        MismatchError, match=f"quantized allreduce: ranks disagree on {field}: rank 0 passed"
    ):
        mq.allreduce(t, comm, **mine(comm.rank))
    assert torch.equal(t, torch.ones(4096))  # no data moved


def test_an_mpi4py_communicator_is_accepted_as_comm() -> None:
    """torchbraid's convention, comm=MPI.COMM_WORLD (an AttributeError before)."""
    from mpi4py import MPI

    size = world().size
    t = torch.full((4096,), 2.0)
    mq.allreduce(t, MPI.COMM_WORLD, bits=8, op="avg")
    torch.testing.assert_close(t, torch.full((4096,), 2.0))
    state = mq.QuantizeState(comm=MPI.COMM_WORLD)
    assert state.comm is world()
    mq.allreduce_tensors([t], MPI.COMM_WORLD, mq.CompressionConfig(bits=8), op="sum")
    torch.testing.assert_close(t, torch.full((4096,), 2.0 * size), rtol=0.02, atol=0.0)


@pytest.mark.parametrize("communicator", ["mpi", "shm"])
def test_cgx_communicator_type_gives_the_same_result(communicator: str) -> None:
    """CGX's COMMUNICATOR_TYPE=MPI/SHM is honoured (it was ignored): same bits as auto."""
    comm = world()
    inputs = _inputs(5000, torch.float32, comm.size)
    results = []
    for name in ("auto", communicator):
        t = inputs[comm.rank].clone()
        config = mq.CompressionConfig(bits=4, stochastic=False, communicator=name)
        mq.allreduce(t, comm, config=config, op="sum")
        results.append(t)
    assert torch.equal(results[0], results[1])


def test_a_state_saved_and_loaded_rounds_the_next_calls_as_the_original(tmp_path: Any) -> None:
    """state_dict/load_state_dict: what a resumed training run needs (issue 18)."""
    comm = world()
    config = mq.CompressionConfig(bits=2, bucket_size=16, minimal_size=0, error_feedback=True)
    names = ["a.weight", "b.weight"]

    def grads(call: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(100 * call + comm.rank)
        return [torch.randn(30, 20, generator=g), torch.randn(12, 12, generator=g)]

    original = mq.QuantizeState(config, comm)
    mq.allreduce_tensors(grads(0), comm, config, "avg", names=names, state=original)
    # Through a file, as a checkpoint does (torch.load with weights_only).
    torch.save(original.state_dict(), tmp_path / "state.pt")
    loaded = mq.QuantizeState(config, comm)
    loaded.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    for call in (1, 2):
        expected = mq.allreduce_tensors(grads(call), comm, config, names=names, state=original)
        got = mq.allreduce_tensors(grads(call), comm, config, names=names, state=loaded)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), call
    # The generator's draws and the residuals themselves, on every rank count.
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    first = mq.quantize(x, 2, 16, True, original.generator)
    second = mq.quantize(x, 2, 16, True, loaded.generator)
    assert torch.equal(first.buffer, second.buffer)
    assert original.residuals.keys() == loaded.residuals.keys()
    assert all(torch.equal(original.residuals[k], loaded.residuals[k]) for k in original.residuals)


def test_a_bucket_size_past_int64_raises_the_same_error_on_every_rank() -> None:
    """bucket_size=2**63 reached the kernels: a raw pybind11 TypeError (issue 30)."""
    t = torch.ones(4096)
    with pytest.raises(mq.QuantizeValueError, match=r"bucket_size=9223372036854775808 .*2\*\*60"):
        mq.allreduce(t, world(), bits=4, bucket_size=2**63)
    assert torch.equal(t, torch.ones(4096))  # nothing moved: the next call works
    mq.allreduce(t, world(), bits=8, bucket_size=2**60, op="avg")
    torch.testing.assert_close(t, torch.ones(4096), rtol=0.01, atol=0.0)


def test_values_near_the_float32_limits_reduce_without_nan() -> None:
    """-3e38 and 3e38 in a bucket made its 512 values NaN (max - min overflowed, issue 30)."""
    comm = world()
    g = torch.Generator().manual_seed(5)
    big = torch.linspace(-3e38, 3e38, 4096, dtype=torch.float64)[torch.randperm(4096, generator=g)]
    mine = big.float() if comm.rank == 0 else torch.zeros(4096)  # the sum stays finite
    t = mine.clone()
    mq.allreduce(t, comm, config=mq.CompressionConfig(bits=4, stochastic=False))
    assert not bool(t.isnan().any())
    # Quantized twice (by rank 0, then by the chunk's owner) to 16 levels of a 6e38
    # range: off by at most two half units, 6e38 / 15 in all.
    assert (t.double() - big.float().double()).abs().max().item() <= 6e38 / 15 * 1.001
