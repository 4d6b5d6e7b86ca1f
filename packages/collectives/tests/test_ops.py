"""Every operation x dtype x implementation against numpy, under any number of ranks.

Each rank's input is a deterministic function of (rank, case), so every rank
can build all the ranks' inputs and reduce them in numpy (float64 or the
integer type itself): an independent reference. Run under mpxrun -n 1, 2, 3.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from typing_extensions import assert_type

from mpx.collectives import (
    Handle,
    allgather,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    recv,
    reduce,
    reduce_scatter,
    send,
    world,
)

pytestmark = pytest.mark.mpi

IMPLS = ["mpi", "ring", "shm"]
DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.uint8,
]
SIZES = [0, 1, 7, 1000, (1 << 20) + 3]
OPS = ["sum", "avg", "max", "min", "prod"]
NP_REDUCE: dict[str, Callable[..., np.ndarray]] = {
    "sum": np.sum,
    "avg": np.mean,
    "max": np.max,
    "min": np.min,
    "prod": np.prod,
}
_INT_NP = {torch.int32: np.int32, torch.int64: np.int64, torch.uint8: np.uint8}


def make(rank: int, n: int, dtype: torch.dtype, op: str = "sum", salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input: small integers for int dtypes, normals for floats."""
    rng = np.random.default_rng([rank, n, DTYPES.index(dtype), salt])
    if dtype.is_floating_point:
        values = rng.uniform(0.5, 1.5, n) if op == "prod" else rng.normal(0, 1, n)
        return torch.from_numpy(values).to(dtype)
    high = 3 if op == "prod" else 50
    return torch.from_numpy(rng.integers(1 if op == "prod" else 0, high, n)).to(dtype)


def reference(inputs: list[torch.Tensor], op: str) -> np.ndarray:
    dtype = inputs[0].dtype
    if dtype.is_floating_point:
        stacked = np.stack([x.double().numpy() for x in inputs])
        return NP_REDUCE[op](stacked, axis=0)
    # Integer reductions wrap around in the type itself, as MPI's do.
    stacked = np.stack([x.numpy() for x in inputs]).astype(_INT_NP[dtype])
    if op in ("sum", "prod"):
        return NP_REDUCE[op](stacked, axis=0, dtype=_INT_NP[dtype])
    return NP_REDUCE[op](stacked, axis=0)


def assert_matches(got: torch.Tensor, want: np.ndarray, dtype: torch.dtype, terms: int) -> None:
    assert got.dtype == dtype
    if dtype.is_floating_point:
        # The reference is exact (float64); allow the rounding of `terms` additions.
        eps = {
            torch.float16: 1e-3,
            torch.bfloat16: 8e-3,
            torch.float32: 1.2e-7,
            torch.float64: 2.3e-16,
        }
        tol = 4 * eps[dtype] * max(terms, 1)
        np.testing.assert_allclose(got.double().numpy(), want, rtol=tol, atol=tol)
    else:
        np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("op", OPS)
def test_allreduce(impl: str, dtype: torch.dtype, n: int, op: str) -> None:
    if op == "avg" and not dtype.is_floating_point:
        pytest.skip("avg needs a floating dtype (tested in test_avg_of_integers_is_refused)")
    if n > 1000 and op in ("avg", "min", "prod"):
        pytest.skip("large sizes are covered by sum and max")
    comm = world()
    inputs = [make(r, n, dtype, op) for r in range(comm.size)]
    t = inputs[comm.rank].clone()
    out = allreduce(t, op, impl=impl)
    assert out is t
    assert_matches(t, reference(inputs, op), dtype, comm.size)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [7, (1 << 20) + 3])
def test_allreduce_async_interleaved_with_other_ops(impl: str, dtype: torch.dtype, n: int) -> None:
    comm = world()
    inputs = [make(r, n, dtype) for r in range(comm.size)]
    second = [make(r, 100, dtype, salt=1) for r in range(comm.size)]
    a, b = inputs[comm.rank].clone(), second[comm.rank].clone()
    handle = allreduce(a, impl=impl, async_op=True)
    assert isinstance(handle, Handle)
    allreduce(b, "max", impl="mpi")
    handle.done()  # progress, whatever the answer
    assert handle.wait(timeout=60) is a
    assert handle.done()
    assert_matches(a, reference(inputs, "sum"), dtype, comm.size)
    assert_matches(b, reference(second, "max"), dtype, comm.size)


@pytest.mark.parametrize("impl", IMPLS)
def test_repeated_calls_give_the_same_answer(impl: str) -> None:
    comm = world()
    inputs = [make(r, 300_001, torch.float32) for r in range(comm.size)]
    want = reference(inputs, "sum")
    for i in range(5):
        t = inputs[comm.rank].clone()
        allreduce(t, impl=impl)
        assert_matches(t, want, torch.float32, comm.size)
        if i % 2:
            broadcast(torch.zeros(1000), 0, impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_sliced_tensors_touch_only_their_slice(impl: str) -> None:
    comm = world()
    base = torch.full((3000,), 5.0)
    view = base[1000:2000]  # contiguous, with a storage offset
    view.copy_(make(comm.rank, 1000, torch.float32))
    allreduce(view, impl=impl)
    assert_matches(
        view,
        reference([make(r, 1000, torch.float32) for r in range(comm.size)], "sum"),
        torch.float32,
        comm.size,
    )
    assert base[:1000].eq(5).all()
    assert base[2000:].eq(5).all()


def test_non_contiguous_input_is_refused() -> None:
    t = torch.zeros(10, 10).t()
    with pytest.raises(ValueError, match="not contiguous"):
        allreduce(t)


def test_avg_of_integers_is_refused() -> None:
    with pytest.raises(TypeError, match=r"op='avg' needs a floating dtype, got torch\.int64"):
        allreduce(torch.zeros(3, dtype=torch.int64), "avg")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_broadcast(impl: str, dtype: torch.dtype, n: int) -> None:
    comm = world()
    for root in sorted({0, comm.size - 1}):
        t = make(comm.rank, n, dtype, salt=root)
        broadcast(t, root, impl=impl)
        np.testing.assert_array_equal(
            t.view(-1).float().numpy(), make(root, n, dtype, salt=root).float().numpy()
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_reduce(dtype: torch.dtype, op: str) -> None:
    if op == "avg" and not dtype.is_floating_point:
        pytest.skip("avg needs a floating dtype")
    comm = world()
    root = comm.size - 1
    inputs = [make(r, 1000, dtype, op) for r in range(comm.size)]
    t = inputs[comm.rank].clone()
    reduce(t, root, op)
    if comm.rank == root:
        assert_matches(t, reference(inputs, op), dtype, comm.size)
    else:
        assert torch.equal(t, inputs[comm.rank])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_allgather(impl: str, dtype: torch.dtype, n: int) -> None:
    comm = world()
    t = make(comm.rank, n, dtype).reshape(-1, 1) if n else make(comm.rank, n, dtype)
    out = allgather(t, impl=impl)
    assert out.shape == (comm.size, *t.shape)
    for r in range(comm.size):
        np.testing.assert_array_equal(
            out[r].reshape(-1).float().numpy(), make(r, n, dtype).float().numpy()
        )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [0, 1, 7, 1000, (1 << 18) + 3])
@pytest.mark.parametrize("op", ["sum", "max"])
def test_reduce_scatter(impl: str, dtype: torch.dtype, rows: int, op: str) -> None:
    comm = world()
    inputs = [
        make(r, rows * comm.size * 4, dtype, op).view(rows * comm.size, 4) for r in range(comm.size)
    ]
    out = reduce_scatter(inputs[comm.rank].clone(), op, impl=impl)
    want = reference(inputs, op)[comm.rank * rows : (comm.rank + 1) * rows]
    assert out.shape == (rows, 4)
    assert_matches(out, want, dtype, comm.size)


def test_reduce_scatter_needs_divisible_rows() -> None:
    comm = world()
    with pytest.raises(ValueError, match=f"must be divisible by the {comm.size} ranks"):
        reduce_scatter(torch.zeros(comm.size * 3 + 1, 2) if comm.size > 1 else torch.zeros(()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [0, 1, 1000])
def test_alltoall(dtype: torch.dtype, n: int) -> None:
    comm = world()
    inputs = [make(r, n * comm.size, dtype).view(comm.size, n) for r in range(comm.size)]
    out = alltoall(inputs[comm.rank].clone())
    for j in range(comm.size):
        np.testing.assert_array_equal(out[j].float().numpy(), inputs[j][comm.rank].float().numpy())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("async_op", [False, True])
def test_send_recv_around_the_ring(dtype: torch.dtype, async_op: bool) -> None:
    comm = world()
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    outgoing = make(comm.rank, 1000, dtype)
    incoming = torch.empty_like(outgoing)
    handle = recv(incoming, left, tag=7, async_op=True)
    sent = send(outgoing, right, tag=7, async_op=async_op)
    handle.wait(timeout=60)
    if async_op:
        assert isinstance(sent, Handle)
        sent.wait(timeout=60)
    else:
        assert sent is None
    assert torch.equal(incoming, make(left, 1000, dtype))


def test_barrier_sync_and_async() -> None:
    barrier()
    handle = barrier(async_op=True)
    handle.wait(timeout=60)
    assert handle.done()


def test_async_op_selects_the_result_type() -> None:
    """The overloads' promise, checked twice: by mypy (lint) through assert_type, and here."""
    comm = world()
    t = torch.ones(4)
    assert assert_type(allreduce(t), torch.Tensor) is t
    handle = assert_type(allreduce(t, async_op=True), Handle[torch.Tensor])
    assert isinstance(handle, Handle)
    assert assert_type(handle.wait(timeout=60), torch.Tensor) is t
    gathered = assert_type(allgather(t), torch.Tensor)
    assert gathered.shape == (comm.size, 4)
    either = assert_type(
        broadcast(t, 0, async_op=comm.size > 0), torch.Tensor | Handle[torch.Tensor]
    )
    assert isinstance(either, Handle)
    assert either.wait(timeout=60) is t
    assert assert_type(barrier(), None) is None
    done = assert_type(barrier(async_op=True), Handle[None])
    assert done.wait(timeout=60) is None


def _made_in_inference_mode(n: int, dtype: torch.dtype, value: float) -> torch.Tensor:
    with torch.inference_mode():
        return torch.full((n,), value, dtype=dtype)


@pytest.mark.parametrize("impl", [None, *IMPLS])
@pytest.mark.parametrize("n", [5, 70_000])
def test_an_inference_tensor_is_reduced_after_its_inference_mode(impl: str | None, n: int) -> None:
    """A tensor made under torch.inference_mode(), reduced after it (an evaluation's
    metrics): 16-bit results and AVG's division were torch writes autograd refused,
    "Inplace update to inference tensor outside InferenceMode", on one path or another."""
    comm = world()
    failed = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for op, expected in (
            ("sum", comm.size * (comm.size + 1) / 2),
            ("avg", (comm.size + 1) / 2),
        ):
            t = _made_in_inference_mode(n, dtype, comm.rank + 1)
            at_root = _made_in_inference_mode(n, dtype, comm.rank + 1)
            try:
                allreduce(t, op, impl=impl)
                reduce(at_root, 0, op, impl=impl)
            except RuntimeError as exc:
                failed.append(f"{dtype} {op}: {str(exc)[:60]}")
                continue
            if not torch.equal(t, torch.full_like(t, expected)):
                failed.append(f"{dtype} {op}: allreduce gave {t[:2].tolist()}, not {expected}")
            if comm.rank == 0 and not torch.equal(at_root, torch.full_like(t, expected)):
                failed.append(f"{dtype} {op}: reduce gave {at_root[:2].tolist()}, not {expected}")
    every = allgather(torch.tensor([len(failed)]))  # every rank fails if one does
    assert every.sum().item() == 0, failed
