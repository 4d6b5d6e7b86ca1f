"""``timeout=`` is checked before anything moves, on every entry point that takes it (issue 41).

``allreduce(t, timeout=-1)`` used to start the call, raise ``CollectiveTimeout
"did not complete within -1 s"`` and leave the communicator broken: every
later call raised ``CommunicatorBroken``. A timeout of 0 or less, or NaN (it
never expired), is now an ``MPXValueError`` naming the value and the fix, a
value that is not a number an ``MPXTypeError``, on every rank alike, and the
communicator stays usable. ``math.inf`` is accepted as "no limit", as
``MPX_TIMEOUT=inf`` already was (``MPX_TIMEOUT`` itself is parsed by
mpx.launch.settings, which refuses 0, negative and NaN values). Run under
mpxrun -n 1, 2, 3.
"""

from __future__ import annotations

import datetime
import math
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from mpi4py import MPI

from mpx.collectives import (
    Communicator,
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
from mpx.collectives.base.errors import MPXTypeError, MPXValueError

pytestmark = pytest.mark.mpi

BAD_VALUES = [-1, 0, 0.0, -0.5, math.nan, -math.inf]
BAD_TYPES: list[object] = ["30", True, datetime.timedelta(seconds=30), [30]]


def _calls(comm: Communicator) -> dict[str, Callable[[Any], object]]:
    """Every operation, as a call taking the timeout (the same on every rank)."""
    size, rank = comm.size, comm.rank
    rows = torch.ones(size, 2)

    def point_to_point(timeout: Any) -> object:
        # Ring neighbours (at 1 rank, itself): no rank waits for one that refused.
        sent = send(torch.ones(2), (rank + 1) % size, comm=comm, async_op=True, timeout=timeout)
        received = recv(torch.empty(2), (rank - 1) % size, comm=comm, timeout=timeout)
        sent.wait()
        return received

    return {
        "allreduce": lambda timeout: allreduce(torch.ones(3), comm=comm, timeout=timeout),
        "allreduce async": lambda timeout: allreduce(
            torch.ones(3), comm=comm, async_op=True, timeout=timeout
        ),
        "allreduce of a float": lambda timeout: allreduce(1.5, comm=comm, timeout=timeout),
        "broadcast": lambda timeout: broadcast(torch.ones(3), 0, comm=comm, timeout=timeout),
        "broadcast of an int": lambda timeout: broadcast(7, 0, comm=comm, timeout=timeout),
        "reduce": lambda timeout: reduce(torch.ones(3), 0, comm=comm, timeout=timeout),
        "allgather": lambda timeout: allgather(torch.ones(3), comm=comm, timeout=timeout),
        "reduce_scatter": lambda timeout: reduce_scatter(rows, comm=comm, timeout=timeout),
        "alltoall": lambda timeout: alltoall(rows, comm=comm, timeout=timeout),
        "send and recv": point_to_point,
        "barrier": lambda timeout: barrier(comm=comm, timeout=timeout),
        "agree": lambda timeout: comm.agree(None, "test", timeout=timeout),
        "allgather_object": lambda timeout: comm.allgather_object(rank, timeout=timeout),
    }


def _still_works(comm: Communicator) -> None:
    """The communicator took no harm: blocking, bounded and async calls all complete."""
    t = torch.ones(5)
    allreduce(t, comm=comm)
    assert t.tolist() == [float(comm.size)] * 5
    allreduce(t, comm=comm, timeout=60)
    assert t.tolist() == [float(comm.size) ** 2] * 5
    handle = allreduce(torch.ones(2), "max", comm=comm, async_op=True)
    assert handle.wait(timeout=60).tolist() == [1.0, 1.0]


@pytest.mark.parametrize("bad", BAD_VALUES, ids=repr)
def test_a_timeout_of_zero_or_less_or_nan_is_refused_and_the_communicator_works(
    bad: float,
) -> None:
    comm = world()
    for call in _calls(comm).values():
        with pytest.raises(
            MPXValueError, match=rf"timeout must be .*> 0, got {re.escape(repr(bad))}"
        ):
            call(bad)
        _still_works(comm)
        done = call(60)  # the same call with a good timeout
        if isinstance(done, Handle):
            done.wait()


@pytest.mark.parametrize("bad", BAD_TYPES, ids=repr)
def test_a_timeout_that_is_not_a_number_is_refused(bad: object) -> None:
    comm = world()
    for call in _calls(comm).values():
        with pytest.raises(MPXTypeError, match=rf"got {re.escape(repr(bad))} of type"):
            call(bad)
    _still_works(comm)
    if isinstance(bad, datetime.timedelta):  # the message says how to convert it
        with pytest.raises(MPXTypeError, match=r"timeout=delta\.total_seconds\(\)"):
            allreduce(torch.ones(1), timeout=bad)  # type: ignore[call-overload]


def test_infinity_means_no_limit() -> None:
    comm = world()
    for call in _calls(comm).values():
        done = call(math.inf)
        if isinstance(done, Handle):
            done.wait()
    handle = allreduce(torch.ones(2), comm=comm, async_op=True, timeout=math.inf)
    assert handle.wait(timeout=math.inf).tolist() == [float(comm.size)] * 2
    # ... also over a communicator's default (the call's own timeout wins).
    bounded = Communicator.from_mpi(MPI.COMM_WORLD, timeout=30)
    assert allreduce(torch.ones(1), comm=bounded, timeout=math.inf).item() == comm.size
    bounded.free()


@pytest.mark.parametrize("bad", [-1, 0, math.nan], ids=repr)
def test_handle_wait_refuses_a_bad_timeout_and_the_operation_goes_on(bad: float) -> None:
    comm = world()
    handle = allreduce(torch.ones(4), comm=comm, async_op=True)
    assert isinstance(handle, Handle)
    with pytest.raises(
        MPXValueError, match=rf"Handle.wait: timeout must be .*{re.escape(repr(bad))}"
    ):
        handle.wait(timeout=bad)
    assert handle.wait(timeout=60).tolist() == [float(comm.size)] * 4
    _still_works(comm)


@pytest.mark.parametrize("bad", [-1, 0, math.nan, "60"], ids=repr)
def test_communicators_refuse_a_bad_default_timeout(bad: object) -> None:
    error = MPXTypeError if isinstance(bad, str) else MPXValueError
    with pytest.raises(error, match=rf"Communicator.from_mpi: timeout .*{re.escape(repr(bad))}"):
        Communicator.from_mpi(MPI.COMM_WORLD, timeout=bad)  # type: ignore[arg-type]
    duplicate = MPI.COMM_WORLD.Dup()
    try:
        with pytest.raises(error, match=rf"Communicator: timeout .*{re.escape(repr(bad))}"):
            Communicator(duplicate, timeout=bad)  # type: ignore[arg-type]
    finally:
        duplicate.Free()
    unbounded = Communicator.from_mpi(MPI.COMM_WORLD, timeout=math.inf)
    _still_works(unbounded)
    unbounded.free()
    _still_works(world())
