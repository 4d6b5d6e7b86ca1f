"""Zero-copy ``shm`` on tensors from ``empty_shared``, alone and mixed with ordinary ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpx.collectives import (
    MismatchError,
    MPXValueError,
    allreduce,
    broadcast,
    empty_shared,
    free_shared,
    world,
)
from mpx.collectives.core.shared_memory import SharedBuffers

pytestmark = pytest.mark.mpi

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64]


def _inputs(size: int, n: int, dtype: torch.dtype) -> list[torch.Tensor]:
    rng = [np.random.default_rng([r, n]) for r in range(size)]
    if dtype.is_floating_point:
        return [torch.from_numpy(g.normal(size=n)).to(dtype) for g in rng]
    return [torch.from_numpy(g.integers(-50, 50, n)).to(dtype) for g in rng]


def _check(got: torch.Tensor, inputs: list[torch.Tensor], op: str) -> None:
    stacked = np.stack([x.double().numpy() for x in inputs])
    want = {"sum": stacked.sum(0), "max": stacked.max(0), "avg": stacked.mean(0)}[op]
    tol = 2e-2 if got.dtype == torch.bfloat16 else 1e-5
    np.testing.assert_allclose(got.double().numpy(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 7, 100_003, (5 << 20) + 1])
@pytest.mark.parametrize("op", ["sum", "max"])
def test_allreduce_of_shared_tensors(dtype: torch.dtype, n: int, op: str) -> None:
    comm = world()
    inputs = _inputs(comm.size, n, dtype)
    t = empty_shared(n, dtype=dtype)
    assert SharedBuffers.of(comm).locate(t) is not None
    t.copy_(inputs[comm.rank])
    allreduce(t, op, impl="shm")
    _check(t, inputs, op)


@pytest.mark.parametrize("shared_ranks", ["even", "odd"])
def test_shared_and_ordinary_tensors_mix(shared_ranks: str) -> None:
    comm = world()
    n = 300_001
    inputs = _inputs(comm.size, n, torch.float32)
    shared = empty_shared(n)  # collective on every rank; only some use it
    use = (comm.rank % 2 == 0) == (shared_ranks == "even")
    t = shared if use else torch.empty(n)
    t.copy_(inputs[comm.rank])
    allreduce(t, "avg", impl="shm")
    _check(t, inputs, "avg")


def test_slice_of_a_shared_tensor_touches_only_the_slice() -> None:
    comm = world()
    base = empty_shared(3, 100_000)
    base.fill_(7.0)
    base[1].fill_(float(comm.rank))
    allreduce(base[1], impl="shm")
    assert float(base[1, 0]) == sum(range(comm.size))
    assert torch.all(base[0] == 7.0)
    assert torch.all(base[2] == 7.0)


@pytest.mark.parametrize("n", [1, 300_001, (5 << 20) + 1])
def test_broadcast_from_a_shared_tensor(n: int) -> None:
    comm = world()
    for root in range(comm.size):
        t = empty_shared(n, dtype=torch.float64)  # peers copy straight out of root's
        t.fill_(float(comm.rank))
        broadcast(t, root, impl="shm")
        assert bool(torch.all(t == root))
        t.fill_(-1.0)  # the root may write at once: every peer has its copy


def test_sizes_that_differ_across_ranks_are_refused() -> None:
    comm = world()
    if comm.size == 1:
        pytest.skip("needs two ranks to differ")
    with pytest.raises(MismatchError, match="different sizes"):
        empty_shared(10 + comm.rank)


def test_free_shared_gives_the_memory_back_and_the_other_blocks_keep_working() -> None:
    comm = world()
    kept = empty_shared(1000)
    # More blocks than MPICH has windows a process (about 2000): each one given back.
    for i in range(2100):
        t = empty_shared(64)
        t.fill_(comm.rank + i)
        if i % 500 == 0:
            allreduce(t, "sum", impl="shm")
            assert torch.equal(t, torch.full((64,), float(sum(range(comm.size)) + comm.size * i)))
        free_shared(t)
    assert SharedBuffers.of(comm).locate(t) is None
    # A block allocated before the others were freed is still found where it was.
    kept.fill_(comm.rank + 1)
    assert SharedBuffers.of(comm).locate(kept) is not None
    allreduce(kept, "sum", impl="shm")
    assert torch.equal(kept, torch.full((1000,), float(comm.size * (comm.size + 1) // 2)))
    free_shared(kept)


def test_free_shared_refuses_what_empty_shared_did_not_return_on_every_rank() -> None:
    comm = world()
    block = empty_shared(100)
    for bad in (torch.zeros(100), block[10:]):
        with pytest.raises(MPXValueError, match=r"free_shared: ranks .* empty_shared"):
            free_shared(bad)
    free_shared(block)
    with pytest.raises(MPXValueError, match="free_shared"):
        free_shared(block)  # twice
    if comm.size > 1:
        first, second = empty_shared(10), empty_shared(10)
        with pytest.raises(MismatchError, match="same order"):
            free_shared(first if comm.rank == 0 else second)
        free_shared(first)
        free_shared(second)
