"""max and min propagate NaN alike on every implementation and every rank (issue 41).

MPI's own MAX/MIN (C's ``a > b ? a : b``) keep or drop a NaN by its side of
the comparison, and MPICH combines the operands in a different order on each
rank: a NaN on rank 0 came out NaN there and 1.0 on rank 1. Each case puts
NaN, +inf and -inf on one rank (the first, then the last), gathers every
rank's input and result, and checks on every rank -- so a failure fails every
rank -- that each rank holds numpy's NaN-propagating reduction of the inputs
(``np.maximum.reduce``: NaN wherever any rank has NaN at that element) with
the NaNs at the same places. Run under mpxrun -n 1, 2, 3 (``hier`` runs on
nodes of 2 ranks simulated with ``MPX_RANKS_PER_NODE``: at 3 ranks; on one
node it is refused, which is checked too; the lanes algorithm of equal nodes
runs in a 4-rank job started by a unit test here).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI

from mpx.collectives import Communicator, allreduce, reduce, reduce_scatter, world
from mpx.collectives.base.dtypes import SUPPORTED_DTYPES
from mpx.collectives.core.policy import PolicyError, current
from mpx.collectives.core.registry import Implementation, all_implementations
from mpx.launch.settings import reload

# Every implementation the registry has that takes CPU tensors (the built-in
# ones and those of other packages), and auto; the same for CUDA tensors (mpi's
# CUDA-aware path has a test of its own: MPX_CUDA_AWARE=1).
CPU_IMPLS = sorted(name for name, impl in all_implementations().items() if "cpu" in impl.devices)
CUDA_IMPLS = sorted(name for name, impl in all_implementations().items() if "cuda" in impl.devices)
# torch's own process groups, to compare with: not held to propagating NaN.
COMPARE_ONLY = ("gloo", "nccl")
# Every dtype the collectives take: the package's own list, not a copy of it.
DTYPES = list(SUPPORTED_DTYPES)
REDUCING = ("allreduce", "reduce", "reduce_scatter")
# Elements in all (divisible by 1, 2 and 3 ranks). Small: MPI's own algorithms
# and the fast path; large (over MPX_AUTO_SMALL_BYTES but in uint8): auto's
# shm or ring, and MPI's large-message algorithms.
SIZES = (294, 270_000)
PERIOD = 97  # the pattern of special values repeats every PERIOD elements


def _input(rank: int, n: int, dtype: torch.dtype, special: int) -> torch.Tensor:
    """Rank ``rank``'s input; rank ``special`` holds the NaNs and the extremes.

    Per period, floats: [0] NaN vs numbers, [1] +inf vs numbers, [2] -inf vs
    numbers, [3] NaN vs +inf, [4] NaN vs -inf, [5] +inf vs -inf, [6] NaN on
    every rank. Integers: their largest and smallest values.
    """
    rng = np.random.default_rng([rank, n, DTYPES.index(dtype)])
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        x = torch.from_numpy(rng.integers(info.min, info.max, n, endpoint=True)).to(dtype)
        if rank == special:
            x[0::PERIOD], x[1::PERIOD] = info.max, info.min
        return x
    x = torch.from_numpy(rng.normal(0, 100, n)).to(dtype)
    if rank == special:
        x[0::PERIOD] = x[3::PERIOD] = x[4::PERIOD] = math.nan
        x[1::PERIOD] = x[5::PERIOD] = math.inf
        x[2::PERIOD] = -math.inf
    else:
        x[3::PERIOD] = math.inf
        x[4::PERIOD] = x[5::PERIOD] = -math.inf
    x[6::PERIOD] = math.nan
    return x


def _exact(t: torch.Tensor) -> np.ndarray:
    """``t`` as numpy without losing a value (float64 holds every 16-bit float)."""
    return (t.double() if t.is_floating_point() else t.long()).cpu().numpy()


def _every(t: torch.Tensor) -> list[np.ndarray]:
    return MPI.COMM_WORLD.allgather(_exact(t))


@pytest.fixture(scope="module")
def two_per_node() -> Iterator[Communicator]:
    """The world's ranks as nodes of 2 (``hier`` needs several nodes, one with 2 ranks)."""
    before = os.environ.get("MPX_RANKS_PER_NODE")
    os.environ["MPX_RANKS_PER_NODE"] = "2"
    reload()  # settings are cached: the session's first communicator read them
    try:
        comm = Communicator.from_mpi(MPI.COMM_WORLD)
    finally:
        if before is None:
            del os.environ["MPX_RANKS_PER_NODE"]
        else:
            os.environ["MPX_RANKS_PER_NODE"] = before
        reload()
    assert comm.num_nodes == (comm.size + 1) // 2  # the simulation took effect
    yield comm
    comm.free()


def _refusal(
    impl: Implementation, op: str, comm: Communicator, t: torch.Tensor, reduce_op: str
) -> str | None:
    """Why ``impl`` refuses the call (it must then raise), or None."""
    cuda_aware = current().cuda_aware
    return impl.refusal(op, t.is_cuda, comm, cuda_aware) or impl.declines(
        t.dtype, reduce_op, t.nbytes
    )


def _run(collective: str, t: torch.Tensor, op: str, comm: Communicator, impl: str) -> torch.Tensor:
    if collective == "allreduce":
        return allreduce(t, op, comm=comm, impl=impl)
    if collective == "reduce":
        return reduce(t, 0, op, comm=comm, impl=impl)
    return reduce_scatter(t, op, comm=comm, impl=impl)


def _check(
    impl_name: str,
    comm: Communicator,
    op: str,
    dtype: torch.dtype,
    special: int,
    device: torch.device | None = None,
) -> None:
    """Every size and reducing collective of one case; asserts on every rank."""
    impl = None if impl_name == "auto" else all_implementations()[impl_name]
    size = comm.size
    for n in SIZES:
        mine = _input(comm.rank, n, dtype, special)
        every_input = _every(mine)
        want = (np.maximum if op == "max" else np.minimum).reduce(np.stack(every_input), axis=0)
        if dtype.is_floating_point:  # the reference itself propagates NaN
            assert np.isnan(want[0::PERIOD]).all()
            assert np.isnan(want[3::PERIOD]).all()
        for collective in REDUCING:
            if impl is not None and collective not in impl.provides:
                continue  # such a call runs on mpi: the mpi case covers it
            t = mine.clone() if device is None else mine.to(device)
            if impl is not None and _refusal(impl, collective, comm, t, op) is not None:
                with pytest.raises(PolicyError):
                    _run(collective, t, op, comm, impl_name)
                continue
            every_out = _every(_run(collective, t, op, comm, impl_name))
            for r, got in enumerate(every_out):
                where = f"{collective} {op} {dtype} n={n} impl={impl_name}: rank {r} of {size}"
                if collective == "allreduce":
                    expected = want
                elif collective == "reduce":
                    expected = want if r == 0 else every_input[r]  # the others' unchanged
                else:
                    expected = np.split(want, size)[r]
                if impl_name in COMPARE_ONLY:
                    # torch's own ProcessGroupGloo (impl='gloo', to compare with)
                    # keeps a NaN only where its reduction starts from one: it is
                    # held to every other value, and to the same result on every
                    # rank, not to propagating NaN. (Its reduce also leaves partial
                    # results in the other ranks' tensors: only the root's is checked.)
                    # NCCL's (impl='nccl') is held to the same.
                    if collective == "reduce" and r != 0:
                        continue
                    numbers = ~np.isnan(expected)
                    np.testing.assert_array_equal(got[numbers], expected[numbers], err_msg=where)
                    if collective == "allreduce":
                        np.testing.assert_array_equal(got, every_out[0], err_msg=where)
                    continue
                np.testing.assert_array_equal(got, expected, err_msg=where)


@pytest.mark.mpi
@pytest.mark.parametrize("where", ["first", "last"])
@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", [*CPU_IMPLS, "auto"])
def test_max_min_propagate_nan_on_every_rank(
    impl: str, dtype: torch.dtype, op: str, where: str, two_per_node: Communicator
) -> None:
    # hier needs several nodes: it runs on the world as nodes of 2 (refused,
    # and checked to be, where that is one node).
    comm = two_per_node if impl == "hier" else world()
    if impl == "hier" and os.environ.get("MPX_TEST_HIER_LANES") == "1":
        # The 4-rank job of test_hier_lanes_on_two_nodes_of_two_ranks: equal nodes.
        assert comm.hierarchy is not None
        assert comm.hierarchy.lanes is not None
    special = 0 if where == "first" else comm.size - 1
    _check(impl, comm, op, dtype, special)


@pytest.mark.mpi
@pytest.mark.parametrize("where", ["first", "last"])
@pytest.mark.parametrize("op", ["max", "min"])
def test_auto_on_nodes_of_two_ranks(op: str, where: str, two_per_node: Communicator) -> None:
    """auto where the world is nodes of 2: hier for large calls at 3 ranks, else ring/mpi."""
    special = 0 if where == "first" else two_per_node.size - 1
    for dtype in (torch.float32, torch.bfloat16):
        _check("auto", two_per_node, op, dtype, special)


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["max", "min"])
def test_python_float_reduces_to_nan_on_every_rank(op: str) -> None:
    comm = world()
    for special in (0, comm.size - 1):
        mine = math.nan if comm.rank == special else float(comm.rank)
        got = allreduce(mine, op)
        assert all(math.isnan(x) for x in MPI.COMM_WORLD.allgather(got))


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["max", "min"])
def test_torch_distributed_on_mpx_propagates_nan(
    op: str, groups: dict[str, dist.ProcessGroup]
) -> None:
    reduce_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    for special in (0, size - 1):
        t = _input(rank, 3 * PERIOD, torch.float32, special)
        every_input = _every(t)
        dist.all_reduce(t, op=reduce_op, group=groups["mpx"])
        want = (np.maximum if op == "max" else np.minimum).reduce(np.stack(every_input), axis=0)
        for r, got in enumerate(_every(t)):
            np.testing.assert_array_equal(got, want, err_msg=f"rank {r}, NaN on rank {special}")


def _device() -> torch.device:
    return torch.device("cuda", world().node_rank % torch.cuda.device_count())


@pytest.mark.mpi
@pytest.mark.gpu
@pytest.mark.parametrize("where", ["first", "last"])
@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", [*CUDA_IMPLS, "auto"])
def test_cuda_max_min_propagate_nan_on_every_rank(
    impl: str, dtype: torch.dtype, op: str, where: str
) -> None:
    """staged (host reduction: impl_mpi's op, shm, ring), ipc (on the GPU), nccl, cgx."""
    comm = world()
    if impl == "nccl" and torch.cuda.device_count() < comm.node_size:
        # NCCL refuses two ranks on one device ("Duplicate GPU detected").
        pytest.skip(f"NCCL needs a GPU per rank: {comm.node_size} ranks share "
                    f"{torch.cuda.device_count()} GPU(s) on this node")  # fmt: skip
    _check(impl, comm, op, dtype, 0 if where == "first" else comm.size - 1, _device())


@pytest.mark.mpi
@pytest.mark.gpu
@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("dtype", [d for d in DTYPES if d.is_floating_point], ids=str)
def test_cuda_aware_mpi_max_min_reduce_on_the_host(dtype: torch.dtype, op: str) -> None:
    """MPX_CUDA_AWARE=1, impl='mpi': numpy's op cannot read device memory, so a
    floating max/min goes through a host copy (the other ops would reach MPI
    with device pointers, which this job's MPI may not take: not run here)."""
    os.environ["MPX_CUDA_AWARE"] = "1"
    reload()
    try:
        comm = Communicator.from_mpi(MPI.COMM_WORLD)
        assert current().cuda_aware
        for special in (0, comm.size - 1):
            _check("mpi", comm, op, dtype, special, _device())
        comm.free()
    finally:
        del os.environ["MPX_CUDA_AWARE"]
        reload()


@pytest.mark.timeout(400)
def test_hier_lanes_on_two_nodes_of_two_ranks() -> None:
    """The lanes algorithm (equal nodes, 2 x 2 ranks): this module's hier cases, 4 ranks."""
    env = {
        **os.environ,
        "MPX_RANKS_PER_NODE": "2",
        "MPX_TIMEOUT": "240",
        "MPX_TEST_HIER_LANES": "1",
    }
    command = [sys.executable, "-m", "mpx.launch", "-n", "4", "--timeout", "300", "--"]
    pytest_args = ["-m", "pytest", str(Path(__file__)), "-m", "mpi", "-q", "-p", "no:cacheprovider"]
    result = subprocess.run(
        [*command, sys.executable, *pytest_args, "-k", "hier and (float32 or bfloat16)"],
        env=env,
        capture_output=True,
        text=True,
        timeout=360,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "8 passed" in result.stdout, result.stdout[-3000:]  # 2 dtypes x max, min x first, last
