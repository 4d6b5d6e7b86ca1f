"""float16 and bfloat16 reductions: summed in float32 and rounded once, on every path.

Each element has one rank holding 1 and every other rank holding half a unit
in the last place of 1 (``2**-11`` for float16, ``2**-8`` for bfloat16), and
the rank holding the 1 changes from element to element. A reduction that
rounds to the 16-bit dtype after each pairwise step loses the halves that meet
the 1 one at a time (``1 + h`` rounds to 1, tie to even), so at 3 ranks it
gives 1 for some elements and ``1 + 2h`` for others; one that accumulates in
float32 gives ``1 + (P-1)h`` rounded once, on every element. MPICH's own
float16 sum rounded at every step (``impl="mpi"`` failed here at 3 ranks
before float16 went to MPI as float32) and was ~10x slower than the float32
detour. At 2 ranks every way rounds once: mpx equals gloo bitwise there.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mpx.collectives import allreduce, reduce, reduce_scatter, world

pytestmark = pytest.mark.mpi

DTYPES = [torch.float16, torch.bfloat16]
IMPLS = ["auto", "mpi", "ring", "shm"]
# Half a unit in the last place of 1.0 in each dtype.
_HALF_ULP = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def _mine(dtype: torch.dtype, rank: int, size: int, rows: int = 4) -> torch.Tensor:
    """This rank's input: 1 where ``element % size == rank``, half an ulp of 1 elsewhere."""
    n = rows * size
    x = torch.full((n,), _HALF_ULP[dtype], dtype=torch.float64)
    x[rank::size] = 1.0
    return x.to(dtype)


def _exact(dtype: torch.dtype, size: int, op: str = "sum") -> torch.Tensor:
    """Every rank's input summed exactly (float64), divided for avg, rounded once to ``dtype``."""
    total = sum(_mine(dtype, r, size).double() for r in range(size))
    assert isinstance(total, torch.Tensor)
    return (total / size if op == "avg" else total).to(dtype)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_allreduce_rounds_once(dtype: torch.dtype, op: str, impl: str) -> None:
    comm = world()
    t = _mine(dtype, comm.rank, comm.size)
    allreduce(t, op, impl=impl)
    assert torch.equal(t, _exact(dtype, comm.size, op)), t.tolist()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_async_allreduce_rounds_once(dtype: torch.dtype) -> None:
    """The asynchronous call (what the torch backend makes) takes the same detour."""
    comm = world()
    t = _mine(dtype, comm.rank, comm.size)
    allreduce(t, impl="mpi", async_op=True).wait(60)
    assert torch.equal(t, _exact(dtype, comm.size)), t.tolist()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("impl", ["mpi", "ring"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reduce_and_reduce_scatter_round_once(dtype: torch.dtype, impl: str) -> None:
    comm = world()
    root = comm.size - 1
    t = _mine(dtype, comm.rank, comm.size)
    reduce(t, root, "sum", impl=impl)
    rows = _mine(dtype, comm.rank, comm.size).reshape(comm.size, -1)
    out = reduce_scatter(rows, "sum", impl=impl)
    # Both collectives made before any rank checks: a failed check ends the test on
    # one rank, and must not leave the others waiting in the second collective.
    want = _exact(dtype, comm.size)
    if comm.rank == root:
        assert torch.equal(t, want), t.tolist()
    assert torch.equal(out.reshape(-1), want.reshape(comm.size, -1)[comm.rank]), out.tolist()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_backend_rounds_once_and_equals_gloo_at_two_ranks(
    groups: dict[str, dist.ProcessGroup], dtype: torch.dtype
) -> None:
    """``dist.all_reduce`` on mpx (DDP's fp16/bf16 hooks call it): rounded once; gloo at 2 ranks."""
    rank, size = dist.get_rank(), dist.get_world_size()
    on_mpx = _mine(dtype, rank, size)
    dist.all_reduce(on_mpx, group=groups["mpx"])
    assert torch.equal(on_mpx, _exact(dtype, size)), on_mpx.tolist()
    if size <= 2:  # gloo rounds after each step of its ring: once at 2 ranks
        on_gloo = _mine(dtype, rank, size)
        dist.all_reduce(on_gloo, group=groups["gloo"])
        assert torch.equal(on_mpx, on_gloo)
