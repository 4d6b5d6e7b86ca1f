"""Handles: asynchronous collectives waited in any order, on any rank, stay correct.

Every rank polls and waits in a different, rank-dependent order: the FIFO per
communicator must still make all ranks issue the same MPI calls in the same
order (a wrong order would mix up data or deadlock, which the timeout turns
into a failure).
"""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
import torch

from mpx.collectives import Handle, allgather, allreduce, broadcast, recv, send, world
from mpx.collectives.base.handle import Done, Queue, Steps
from mpx.collectives.base.progress import enabled

pytestmark = pytest.mark.mpi

IMPLS = ["mpi", "ring", "shm"]


def _inputs(size: int, n: int, salt: int) -> list[torch.Tensor]:
    return [
        torch.from_numpy(np.random.default_rng([r, n, salt]).normal(size=n)).float()
        for r in range(size)
    ]


@pytest.mark.parametrize("impl", IMPLS)
def test_many_async_collectives_waited_in_a_rank_dependent_order(impl: str) -> None:
    comm = world()
    sizes = [5, 300_000, 17, 1 << 20, 1000, 70_000]
    cases = [_inputs(comm.size, n, salt) for salt, n in enumerate(sizes)]
    tensors = [case[comm.rank].clone() for case in cases]
    gathered_in = torch.full((3,), float(comm.rank))
    bcast = torch.arange(50_000, dtype=torch.float64) * (comm.rank + 1)
    handles: list[Handle[torch.Tensor]] = [
        allreduce(t, impl=impl, async_op=True) for t in tensors[:3]
    ]
    handles.append(broadcast(bcast, 0, impl=impl, async_op=True))
    handles.append(allgather(gathered_in, impl=impl, async_op=True))
    handles += [allreduce(t, "max", impl=impl, async_op=True) for t in tensors[3:]]
    order = list(range(len(handles)))
    random.Random(comm.rank).shuffle(order)
    for index in order:
        handles[random.Random(index + comm.rank).randrange(len(handles))].done()
        handles[index].wait(timeout=120)
    for i, case in enumerate(cases):
        stacked = torch.stack(case).double()
        want = stacked.sum(0) if i < 3 else stacked.max(0).values
        torch.testing.assert_close(tensors[i].double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bcast, torch.arange(50_000, dtype=torch.float64))
    gathered = handles[4].wait()
    assert gathered.tolist() == [[float(r)] * 3 for r in range(comm.size)]


def test_a_later_collective_waits_for_the_earlier_ones() -> None:
    comm = world()
    first = torch.ones(1 << 18)
    second = torch.ones(10)
    h1 = allreduce(first, impl="shm", async_op=True)
    h2 = allreduce(second, impl="mpi", async_op=True)
    h2.wait(timeout=60)
    # FIFO: h1 had to finish before h2 could even start.
    assert h1.completed
    assert float(first[0]) == comm.size
    assert float(second[0]) == comm.size


def test_point_to_point_bypasses_the_queue() -> None:
    comm = world()
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    blocker = allreduce(torch.ones(1 << 16), impl="ring", async_op=True)
    incoming = torch.empty(4)
    # Posted while a collective is in flight: must not wait behind it.
    h_recv = recv(incoming, left, tag=3, async_op=True)
    send(torch.full((4,), float(comm.rank)), right, tag=3)
    h_recv.wait(timeout=60)
    blocker.wait(timeout=60)
    assert incoming.tolist() == [float(left)] * 4


@pytest.mark.skipif(not enabled(), reason="MPI_THREAD_MULTIPLE not available")
def test_progress_thread_finishes_operations_nobody_polls() -> None:
    comm = world()
    tensors = [torch.ones(1 << 20) for _ in range(3)]
    handles = [allreduce(t, impl="shm", async_op=True) for t in tensors]
    deadline = time.monotonic() + 60
    while not all(h.completed for h in handles) and time.monotonic() < deadline:
        time.sleep(0.01)  # never calls done()/wait(): only the progress thread advances them
    assert all(h.completed for h in handles), "the progress thread did not finish the operations"
    for h, t in zip(handles, tensors, strict=True):
        assert h.wait() is t
        assert float(t[-1]) == comm.size


@pytest.mark.skipif(not enabled(), reason="MPI_THREAD_MULTIPLE not available")
def test_progress_thread_completes_what_waits_on_operations() -> None:
    """``when_ready``: ``complete()`` runs on the progress thread, outside LOCK, once ready;
    one that raises does not stop the thread from completing the next."""
    import threading

    from mpx.collectives.base import progress
    from mpx.collectives.base.handle import LOCK

    comm = world()
    seen: list[tuple[str, bool]] = []

    class Waiter:
        def __init__(self, handle: Handle[torch.Tensor], fail: bool) -> None:
            self.handle, self.fail = handle, fail

        def ready(self) -> bool:
            return self.handle.done()

        def complete(self) -> None:
            # Whether this thread holds LOCK (an RLock: only its private
            # _is_owned tells; a non-blocking acquire would succeed either way).
            owned = LOCK._is_owned()  # type: ignore[attr-defined]
            seen.append((threading.current_thread().name, owned))
            if self.fail:
                raise RuntimeError("a completion that fails")

    for fail in (True, False):
        t = torch.ones(1 << 16)
        handle = allreduce(t, impl="mpi", async_op=True)
        assert isinstance(handle, Handle)
        assert progress.when_ready(Waiter(handle, fail))
    deadline = time.monotonic() + 60
    while len(seen) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)  # nobody waits: only the progress thread completes them
    assert seen == [("mpx-progress", False), ("mpx-progress", False)]
    assert float(t[-1]) == comm.size


@pytest.mark.parametrize("background", [True, False])
def test_background_progress_switch(background: bool) -> None:
    """``background_progress = False``: nothing moves until the caller polls."""
    from mpx.collectives import Communicator

    if background and not enabled():
        pytest.skip("MPI_THREAD_MULTIPLE not available: no progress thread")
    comm = Communicator.from_mpi(world().mpi)
    comm.background_progress = background
    t = torch.ones(1 << 16)
    handle = allreduce(t, comm=comm, impl="mpi", async_op=True)
    deadline = time.monotonic() + (60 if background else 0.3)
    while not handle.completed and time.monotonic() < deadline:
        time.sleep(0.01)  # never polls: only a progress thread could finish it
    if comm.size > 1:  # on one rank there is nothing to communicate: done at once
        assert handle.completed == background
    assert handle.wait(timeout=60) is t
    assert float(t[-1]) == comm.size


@pytest.mark.skipif(not enabled(), reason="MPI_THREAD_MULTIPLE not available")
def test_blocking_waits_leave_the_progress_thread_free_for_other_communicators() -> None:
    """Rank 0 blocks on X while the others first need rank 0's part of Y.

    Only rank 0's progress thread can advance its shm allreduce on Y; a
    blocking wait holding the lock would stop it, and the job would deadlock
    (the others' timeouts turn that into a failure here).
    """
    from mpx.collectives import Communicator

    comm = world()
    x_comm, y_comm = Communicator.from_mpi(comm.mpi), Communicator.from_mpi(comm.mpi)
    # Each communicator's shm workspace exists before the scenario: creating
    # one is itself a blocking collective (on first use, inside the step).
    for c in (x_comm, y_comm):
        allreduce(torch.ones(4), comm=c, impl="shm")
    for blocking in ("fast path", "handle.wait()"):
        big = torch.ones(1 << 22)
        small = torch.ones(16)
        handle = allreduce(big, comm=y_comm, impl="shm", async_op=True)
        if comm.rank == 0:
            if blocking == "fast path":
                allreduce(small, comm=x_comm)
            else:
                allreduce(small, comm=x_comm, impl="shm", async_op=True).wait()  # no timeout
            handle.wait(timeout=60)
        else:
            handle.wait(timeout=60)
            if blocking == "fast path":
                allreduce(small, comm=x_comm)
            else:
                allreduce(small, comm=x_comm, impl="shm", async_op=True).wait(timeout=60)
        assert float(big[-1]) == comm.size
        assert float(small[0]) == comm.size


def test_queue_starts_only_the_head() -> None:
    started: list[str] = []

    def steps(name: str) -> Steps[str]:
        started.append(name)
        yield Done()
        return name

    queue = Queue()
    blocked = Handle("first", "test", _never(), queue=queue)
    second = Handle("second", "test", steps("second"), queue=queue)
    assert started == []
    assert not second.done()
    assert not blocked.completed
    assert len(queue) == 2


def _never() -> Steps[None]:
    class Never(Done):
        def test(self) -> bool:
            return False

    yield Never()
