"""A process group destroyed and created again on the same ``MASTER_PORT``."""

from __future__ import annotations

import gc
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from mpx.collectives import init_process_group, world
from mpx.launch import init_torch_env

pytestmark = pytest.mark.mpi


@pytest.mark.timeout(120)
def test_second_group_on_the_same_port_when_rank_0_leaves_the_first_late() -> None:
    # Rank 0 hosts the env:// store. If it is still busy with the first group
    # while the others already rendezvous for the second, they reach its old
    # store, and its new one then waits for workers that never come: the job
    # hung in CI. mpx's init_process_group agrees on the world first.
    init_torch_env()
    comm = world()
    for round_ in range(2):
        init_process_group("env://", timeout=timedelta(seconds=30))
        t = torch.tensor([float(comm.rank + round_)])
        dist.all_reduce(t)
        assert t.item() == sum(r + round_ for r in range(comm.size))
        if comm.rank == 0:
            time.sleep(1.0)  # the slower last test of a module
        dist.destroy_process_group()
        gc.collect()  # the old store goes now, not at some later collection
