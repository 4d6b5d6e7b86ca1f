"""init() and the rank queries agree with MPI itself."""

from __future__ import annotations

import pytest
from mpi4py import MPI

import mpx.dataparallel as dp

pytestmark = pytest.mark.mpi


def test_rank_queries_match_mpi() -> None:
    comm = dp.init()
    assert comm.size == MPI.COMM_WORLD.Get_size() == dp.world_size()
    assert comm.rank == MPI.COMM_WORLD.Get_rank() == dp.rank()
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    assert dp.local_rank() == node.Get_rank()
    node.Free()
    assert dp.is_root() == (dp.rank() == 0)
    roots = MPI.COMM_WORLD.allreduce(int(dp.is_root()))
    assert roots == 1


def test_init_is_idempotent() -> None:
    assert dp.init() is dp.init()


def test_fluxmpi_spellings() -> None:
    assert dp.total_workers() == dp.world_size()
    assert dp.DistributedOptimiser is dp.DistributedOptimizer
