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


@pytest.mark.timeout(120)
def test_a_new_gloo_group_never_meets_the_old_world_still_alive() -> None:
    # Some groups outlive destroy_process_group (cycles through torch's C++,
    # such as DDP's reducer or a future's callbacks). While rank 0's old
    # TCPStore server is alive, torch hands the next env:// store on the same
    # port that server, keys included; the next dist.new_group gets the old
    # one's name again, so a rank could read rank 0's *old* gloo address and
    # connect to the old listener: a CI hang. Here the old world is kept
    # alive on purpose, and rank 0 is late for the second group's rendezvous.
    init_torch_env()
    comm = world()
    kept: list[object] = []
    for round_ in range(2):
        init_process_group("env://", timeout=timedelta(seconds=20))
        if comm.rank == 0 and round_ == 1:
            time.sleep(1.0)  # the others read the store's keys first
        gloo = dist.new_group(backend="gloo")
        t = torch.tensor([float(comm.rank + round_)])
        dist.all_reduce(t, group=gloo)
        assert t.item() == sum(r + round_ for r in range(comm.size))
        kept.append(gloo)  # its store with it: gloo's group holds the world's store
        dist.destroy_process_group()
