"""Communicators, timeouts that name the peer, and the MPX_CHECK mismatch check."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
from mpi4py import MPI

from mpx.collectives import (
    CollectiveTimeout,
    Communicator,
    CommunicatorBroken,
    MismatchError,
    allreduce,
    broadcast,
    recv,
    world,
)
from mpx.launch.settings import reload as reload_settings

pytestmark = pytest.mark.mpi


def test_world_matches_comm_world_and_is_private() -> None:
    comm = world()
    assert (comm.rank, comm.size) == (MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())
    assert MPI.Comm.Compare(comm.mpi, MPI.COMM_WORLD) == MPI.CONGRUENT
    assert world() is comm


def test_from_mpi_duplicates() -> None:
    comm = Communicator.from_mpi(MPI.COMM_WORLD)
    assert MPI.Comm.Compare(comm.mpi, MPI.COMM_WORLD) == MPI.CONGRUENT
    t = torch.ones(3)
    allreduce(t, comm=comm)
    assert t.eq(comm.size).all()
    comm.free()


def test_split_by_parity() -> None:
    comm = world()
    half = comm.split(comm.rank % 2)
    assert half is not None
    assert half.size == len(range(comm.rank % 2, comm.size, 2))
    t = torch.tensor([float(comm.rank)])
    allreduce(t, comm=half)
    assert t.item() == sum(range(comm.rank % 2, comm.size, 2))
    assert comm.split(None) is None


def test_node_and_leaders() -> None:
    comm = world()
    node = comm.node()
    assert node.size == comm.node_size
    assert node.rank == comm.node_rank
    leaders = comm.leaders()
    assert (leaders is not None) == (comm.node_rank == 0)
    if leaders is not None:
        assert leaders.size == comm.num_nodes


def test_recv_timeout_names_the_peer() -> None:
    comm = world().split(0)
    assert comm is not None
    left = (comm.rank - 1) % comm.size
    buf = torch.zeros(4)
    start = time.monotonic()
    with pytest.raises(CollectiveTimeout) as info:
        recv(buf, left, tag=99, comm=comm, timeout=0.5)
    assert time.monotonic() - start < 5
    assert info.value.peers == [left]
    assert f"waiting for rank(s) {left}" in str(info.value)
    assert "recv" in str(info.value)
    # The communicator is now marked broken rather than silently reused.
    with pytest.raises(CommunicatorBroken, match="earlier recv"):
        broadcast(buf, 0, comm=comm)
    # Only once every rank has timed out: satisfy the dangling receive (posted
    # on comm) so that nothing is left in flight.
    MPI.COMM_WORLD.Barrier()
    comm.mpi.Send(torch.zeros(4).numpy(), dest=(comm.rank + 1) % comm.size, tag=99)
    MPI.COMM_WORLD.Barrier()


def test_collective_timeout_names_the_rank_that_never_came() -> None:
    comm = world().split(0, key=None)
    assert comm is not None
    if comm.size == 1:
        pytest.skip("needs a second rank to be late")
    late = comm.size - 1
    try:
        if comm.rank == late:
            time.sleep(3.0)  # arrives after the others gave up
            # The others abandoned the call: the comparison of its new signature
            # (MPX_CHECK=auto) meets theirs, its data never will.
            with contextlib.suppress(CollectiveTimeout):
                allreduce(torch.ones(3), comm=comm, impl="mpi", timeout=3)
        else:
            start = time.monotonic()
            with pytest.raises(CollectiveTimeout) as info:
                allreduce(torch.ones(3), comm=comm, impl="mpi", timeout=1.0)
            # Raised at the timeout, not when the late rank finally came.
            assert time.monotonic() - start < 2.9
            assert late in info.value.peers
    finally:
        MPI.COMM_WORLD.Barrier()  # a failed assertion must not strand the others


def test_mismatched_shapes_are_named_on_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPX_CHECK", "1")
    reload_settings()
    comm = world()
    allreduce(torch.ones(4))  # agreeing shapes pass the check
    if comm.size == 1:
        pytest.skip("a mismatch needs two ranks")
    shape = (4,) if comm.rank == 0 else (5,)
    with pytest.raises(MismatchError) as info:
        allreduce(torch.ones(shape), timeout=30)
    message = str(info.value)
    assert "allreduce: ranks disagree on element count: rank 0 passed float32[4], rank" in message
    assert "float32[5]" in message


def test_mismatched_dtype_and_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPX_CHECK", "1")
    reload_settings()
    comm = world()
    if comm.size == 1:
        pytest.skip("a mismatch needs two ranks")
    dtype = torch.float32 if comm.rank == 0 else torch.float64
    with pytest.raises(MismatchError, match=r"rank 0 passed float32\[2\], rank 1 float64\[2\]"):
        allreduce(torch.ones(2, dtype=dtype), timeout=30)
    with pytest.raises(MismatchError, match="rank 0 passed root=0, rank 1 root=1"):
        broadcast(torch.ones(2), 0 if comm.rank == 0 else 1, timeout=30)


def test_an_mpi4py_communicator_is_accepted_as_comm() -> None:
    """torchbraid's convention, comm=MPI.COMM_WORLD: an AttributeError ('split') before."""
    from mpx.collectives import as_communicator

    comm = world()
    t = torch.full((5,), float(comm.rank))
    allreduce(t, comm=MPI.COMM_WORLD)
    assert t.tolist() == [float(sum(range(comm.size)))] * 5
    assert as_communicator(MPI.COMM_WORLD) is world()  # the same group, the same state
    halves = MPI.Intracomm(MPI.COMM_WORLD.Split(comm.rank % 2, comm.rank))
    try:
        big = torch.ones(300_000)  # the shm path on several ranks: a wrapped communicator's own
        allreduce(big, comm=halves)
        assert float(big[0]) == halves.Get_size()
        assert as_communicator(halves) is as_communicator(halves)  # wrapped once
        broadcast(t, 0, comm=halves)
        assert float(t[0]) == float(sum(range(comm.size)))
    finally:
        as_communicator(halves).free()
        halves.Free()
    with pytest.raises(
        TypeError, match=r"comm must be an mpx\.collectives\.Communicator, an mpi4py"
    ):
        allreduce(t, comm="world")  # type: ignore[call-overload]
