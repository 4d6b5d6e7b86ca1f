"""What a user's mistakes and corner cases do: the same behaviour on every implementation.

Each case here once did something else on some implementation: backward used
a reduced value on one path and raised on another, a broadcast into a
Parameter raised on one rank and hung the others, ``root=True`` raised a
numpy error on one rank, a freed communicator crashed the process, a string
color and a short receive buffer surfaced raw library errors. Run under
mpxrun -n 1, 2, 3.
"""

from __future__ import annotations

import math

import pytest
import torch

from mpx.collectives import (
    Communicator,
    MPXTypeError,
    MPXValueError,
    allgather,
    allreduce,
    broadcast,
    recv,
    reduce,
    send,
    world,
)

pytestmark = pytest.mark.mpi

CPU_IMPLS = [None, "mpi", "ring", "shm"]


# -- autograd: as on gloo, whatever the implementation ------------------------------
#
# Measured on gloo (torch 2.13, 2 ranks): dist.all_reduce / broadcast / all_gather
# on tensors that require grad -- leaves, non-leaves, Parameters -- raise nothing,
# record nothing (no grad_fn, the version counter stays 0), reduce the memory in
# place, and a later backward uses the reduced value (exp's backward reads its
# output: a.grad = size * e). all_gather's outputs do not require grad.


@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("n", [3, 1 << 20])  # small (mpi) and 4 MiB (shm/ring by default)
def test_a_leaf_that_requires_grad_is_reduced_like_gloo(impl: str | None, n: int) -> None:
    comm = world()
    x = torch.ones(n, requires_grad=True)
    out = allreduce(x, impl=impl, timeout=120)
    assert out is x
    assert x.requires_grad
    assert x.grad_fn is None
    assert x._version == 0
    assert torch.equal(x.detach(), torch.full((n,), float(comm.size)))


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_backward_after_reducing_a_non_leaf_uses_the_reduced_value(impl: str | None) -> None:
    comm = world()
    a = torch.ones(1000, dtype=torch.float64, requires_grad=True)
    y = a.exp()
    allreduce(y, impl=impl, timeout=120)
    assert y._version == 0  # gloo's: unrecorded, so backward raises no version error
    y.sum().backward()
    assert a.grad is not None
    assert torch.allclose(a.grad, torch.full((1000,), comm.size * math.e, dtype=torch.float64))


@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("n", [4, 1 << 20])
def test_broadcast_into_a_parameter(impl: str | None, n: int) -> None:
    comm = world()
    p = torch.nn.Parameter(torch.full((n,), float(comm.rank)))
    assert broadcast(p, 0, impl=impl, timeout=120) is p
    assert isinstance(p, torch.nn.Parameter)
    assert p.requires_grad
    assert p._version == 0
    assert torch.equal(p.detach(), torch.zeros(n))
    view = torch.nn.Parameter(torch.full((2, n), float(comm.rank)))[1]  # a view of a leaf
    broadcast(view, comm.size - 1, impl=impl, timeout=120)
    assert torch.equal(view.detach(), torch.full((n,), float(comm.size - 1)))


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_out_of_place_results_do_not_require_grad(impl: str | None) -> None:
    comm = world()
    x = torch.full((5,), float(comm.rank), requires_grad=True)
    gathered = allgather(x, impl=impl, timeout=120)
    assert not gathered.requires_grad
    assert torch.equal(gathered[:, 0], torch.arange(comm.size, dtype=torch.float32))
    assert x._version == 0
    assert torch.equal(x.detach(), torch.full((5,), float(comm.rank)))
    r = torch.ones(6, requires_grad=True)
    assert reduce(r, 0, timeout=120) is r
    expected = float(comm.size) if comm.rank == 0 else 1.0
    assert torch.equal(r.detach(), torch.full((6,), expected))


# -- bad arguments: a clear error on every rank, nothing moved ------------------------


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_a_bool_root_is_named(impl: str | None) -> None:
    t = torch.ones(1 << 16)
    with pytest.raises(MPXTypeError, match=r"root must be a rank .* got the bool True"):
        broadcast(t, True, impl=impl, timeout=60)
    with pytest.raises(TypeError):  # MPXTypeError is also the builtin it replaces
        reduce(t, False, timeout=60)
    assert torch.equal(t, torch.ones(1 << 16))
    allreduce(t, impl=impl, timeout=60)  # and the ranks are still in step
    assert torch.equal(t, torch.full((1 << 16,), float(world().size)))


def test_split_names_a_color_that_is_not_an_int() -> None:
    comm = world()
    with pytest.raises(MPXTypeError, match=r"split: color must be an int .* got 'a'"):
        comm.split("a")  # type: ignore[arg-type]
    with pytest.raises(MPXTypeError, match="split: key must be an int"):
        comm.split(0, key=1.5)  # type: ignore[arg-type]
    with pytest.raises(MPXValueError, match="color must be >= 0"):
        comm.split(-2)
    sub = comm.split(comm.rank % 2)
    assert sub is not None
    assert sub.size == len(range(comm.rank % 2, comm.size, 2))
    sub.free()


def test_a_freed_communicator_raises_instead_of_crashing() -> None:
    comm = Communicator.from_mpi(world().mpi)
    t = torch.ones(8)
    allreduce(t, comm=comm)  # the fast path caches this call
    comm.free()
    comm.free()  # twice: nothing more to release
    for call in (
        lambda: allreduce(t, comm=comm),
        lambda: allreduce(torch.ones(1 << 20), comm=comm),
        lambda: broadcast(t, 0, comm=comm),
        lambda: comm.check_same("x", {"a": 1}),
        lambda: comm.agree(None),
        lambda: comm.split(0),
        comm.node,
    ):
        with pytest.raises(MPXValueError, match="this communicator was freed"):
            call()


def test_freeing_a_communicator_after_a_timeout_does_not_crash() -> None:
    """torch's test_barrier_timeout_*: a barrier only rank 0 entered times out, then the
    group is destroyed -- the progress thread went on polling the freed call board (SIGSEGV)."""
    import time

    from mpx.collectives import CollectiveTimeout, CommunicatorBroken, barrier

    comm = Communicator.from_mpi(world().mpi)
    handle = None
    if comm.rank == 0 and comm.size > 1:
        handle = barrier(comm=comm, async_op=True)  # the progress thread polls it
        with pytest.raises(CollectiveTimeout):
            handle.wait(timeout=0.5)
    comm.free()
    time.sleep(0.3)  # the progress thread's turns, after the free
    if handle is not None:
        with pytest.raises(CommunicatorBroken, match="freed"):
            handle.wait(timeout=1)
    t = torch.ones(3)
    allreduce(t, timeout=60)  # the process is alive and the world in step
    assert torch.equal(t, torch.full((3,), float(world().size)))


def test_a_receive_buffer_too_small_is_named() -> None:
    comm = world()
    if comm.size == 1:
        pytest.skip("point to point needs two ranks")
    if comm.rank == 1:
        send(torch.arange(10, dtype=torch.float32), 0, tag=7, timeout=60)
    elif comm.rank == 0:
        small = torch.zeros(4)
        with pytest.raises(MPXValueError, match=r"from rank 1, tag 7 is larger .*float32\[4\]"):
            recv(small, 1, tag=7, timeout=60)


# -- TorchMPI's scalar collectives: a Python number in, the same type out ----------------


def test_python_numbers_are_reduced_and_broadcast() -> None:
    comm = world()
    total = allreduce(comm.rank + 1)
    assert type(total) is int
    assert total == sum(range(1, comm.size + 1))
    biggest = allreduce(0.5 * comm.rank, "max")
    assert type(biggest) is float
    assert biggest == 0.5 * (comm.size - 1)
    exact = allreduce(2**53 + comm.rank * 0)  # int64 on the wire: no float rounding
    assert exact == (2**53) * comm.size
    assert broadcast(comm.rank * 10, comm.size - 1) == (comm.size - 1) * 10
    assert type(broadcast(float(comm.rank), 0)) is float
    with pytest.raises(MPXTypeError, match=r"allreduce: a Python int \(3\) is reduced blocking"):
        allreduce(3, async_op=True)  # type: ignore[call-overload]
    with pytest.raises(MPXTypeError, match=r"must be a torch\.Tensor, got bool"):
        allreduce(True)
