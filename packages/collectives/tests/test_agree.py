"""Communicator.agree / agreement: one rank's failure raises the same error on every rank."""

from __future__ import annotations

import pickle
import time

import pytest
import torch
from mpi4py import MPI

from mpx.collectives import (
    CollectiveTimeout,
    MPXError,
    RemoteError,
    allreduce,
    world,
)


def _last() -> int:
    return world().size - 1


def test_remote_error_message_and_pickle() -> None:
    err = RemoteError("could not load x.pt", {2: "OSError: no", 0: "ValueError: bad"})
    assert isinstance(err, MPXError)
    assert err.ranks == [0, 2]
    assert (
        str(err)
        == "could not load x.pt on ranks 0, 2: rank 0: ValueError: bad; rank 2: OSError: no"
    )
    same = RemoteError("could not load x.pt", {1: "OSError: no", 3: "OSError: no"})
    assert str(same) == "could not load x.pt on ranks 1, 3: OSError: no"
    one = RemoteError("failed", {1: "KeyError: 'w'"})
    assert str(one) == "failed on rank 1: KeyError: 'w'"
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is RemoteError
    assert (back.what, back.failures, str(back)) == (err.what, err.failures, str(err))


@pytest.mark.mpi
def test_nobody_fails_nothing_raised() -> None:
    comm = world()
    comm.agree(None, "never shown")
    with comm.agreement("never shown"):
        pass
    # The communicator still works, in step on every rank.
    t = torch.ones(2)
    allreduce(t, comm=comm)
    assert t.eq(comm.size).all()


@pytest.mark.mpi
def test_one_rank_fails_every_rank_raises_its_message() -> None:
    comm = world()
    failing = _last()
    mine = ValueError(f"bad value on {comm.rank}") if comm.rank == failing else None
    with pytest.raises(RemoteError) as info:
        comm.agree(mine, "loading the shard")
    err = info.value
    assert err.ranks == [failing]
    assert err.failures == {failing: f"ValueError: bad value on {failing}"}
    assert str(err) == f"loading the shard on rank {failing}: ValueError: bad value on {failing}"
    # The failing rank keeps its own exception as the cause.
    assert err.__cause__ is (mine if comm.rank == failing else None)


@pytest.mark.mpi
def test_agreement_block_raises_everywhere_with_each_message() -> None:
    comm = world()

    def step() -> None:
        with comm.agreement("step"):
            if comm.rank % 2 == 0:
                raise KeyError(f"k{comm.rank}")

    with pytest.raises(RemoteError) as info:
        step()
    evens = list(range(0, comm.size, 2))
    assert info.value.ranks == evens
    for r in evens:
        assert info.value.failures[r] == f"KeyError: 'k{r}'"
        assert f"rank {r}" in str(info.value)
    if comm.rank % 2 == 0:
        assert isinstance(info.value.__cause__, KeyError)


@pytest.mark.mpi
def test_error_type_and_string_summaries() -> None:
    class MyError(RemoteError, RuntimeError):
        pass

    comm = world()
    summary = "disk full" if comm.rank == 0 else None
    with pytest.raises(MyError, match="writing on rank 0: disk full"):
        comm.agree(summary, "writing", error_type=MyError)


@pytest.mark.mpi
def test_agree_keeps_the_order_of_queued_collectives() -> None:
    comm = world()
    t = torch.full((1000,), float(comm.rank))
    handle = allreduce(t, comm=comm, async_op=True)
    comm.agree(None)  # queued behind the allreduce, on every rank
    handle.wait()
    assert t.eq(sum(range(comm.size))).all()


@pytest.mark.mpi
def test_allgather_object_any_size() -> None:
    comm = world()
    mine = {"rank": comm.rank, "data": list(range(comm.rank * 100))}
    every = comm.allgather_object(mine)
    assert every == [{"rank": r, "data": list(range(r * 100))} for r in range(comm.size)]
    assert comm.allgather_object(None) == [None] * comm.size


@pytest.mark.mpi
def test_agree_times_out_naming_the_late_rank() -> None:
    comm = world().split(0)
    assert comm is not None
    if comm.size == 1:
        pytest.skip("needs a second rank to be late")
    late = comm.size - 1
    try:
        if comm.rank == late:
            time.sleep(3.0)  # arrives after the others gave up
            comm.agree(None, timeout=60)
        else:
            start = time.monotonic()
            with pytest.raises(CollectiveTimeout) as info:
                comm.agree(None, "the late one", timeout=1.0)
            assert time.monotonic() - start < 2.9
            assert late in info.value.peers
            assert "agree" in str(info.value)
    finally:
        MPI.COMM_WORLD.Barrier()  # a failed assertion must not strand the others
