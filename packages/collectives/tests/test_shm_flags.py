"""shm's flag-based small allreduce (mpx.collectives.node.shm_flags): chosen, taken, equal to numpy.

Every rank builds every rank's input from (rank, case), so numpy sums them
all: an independent reference. Which path a rank takes (the fast path's C call,
or the general path's steps) is decided from values that agree across ranks,
or, where a test mixes them on purpose, both paths run the same protocol.
Run under mpxrun -n 1, 2, 3.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from mpx.collectives import Communicator, MismatchError, allreduce, world
from mpx.collectives.core import fast_path
from mpx.collectives.core.policy import choose
from mpx.collectives.node import shm_flags
from mpx.collectives.node.shm_flags import FlagWindow, takes
from mpx.launch.settings import reload as reload_settings

pytestmark = pytest.mark.mpi

DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64]


@pytest.fixture
def comm() -> Iterator[Communicator]:
    """A fresh communicator: no window yet, its calls numbered from 1."""
    created = Communicator.from_mpi(world().mpi)
    yield created
    created.free()


def _several(comm: Communicator) -> bool:
    """Whether the flags can run here (several ranks, compiled): the same on every rank."""
    return comm.size > 1 and fast_path.COMPILED


def _inputs(size: int, dtype: torch.dtype, n: int, salt: int) -> list[torch.Tensor]:
    out = []
    for r in range(size):
        rng = np.random.default_rng([r, n, salt])
        if dtype.is_floating_point:
            out.append(torch.from_numpy(rng.normal(size=n)).to(dtype))
        else:
            out.append(torch.from_numpy(rng.integers(-1000, 1000, size=n)).to(dtype))
    return out


def _expected(inputs: list[torch.Tensor], op: str) -> np.ndarray:
    if inputs[0].dtype.is_floating_point:
        total: np.ndarray = np.sum([t.double().numpy() for t in inputs], axis=0)
        return total / len(inputs) if op == "avg" else total
    exact: np.ndarray = np.sum([t.numpy() for t in inputs], axis=0)
    return exact


def _same_on_every_rank(comm: Communicator, t: torch.Tensor) -> None:
    """The ranks' results are the same bits (each sums in rank order)."""
    gathered = comm.mpi.allgather(t.numpy().tobytes())
    assert all(g == gathered[0] for g in gathered)


def _flags(comm: Communicator) -> FlagWindow:
    window = comm.cached("shm_flags")
    assert isinstance(window, FlagWindow)
    return window


def test_auto_chooses_it_for_small_sums_on_one_node() -> None:
    comm = world()
    several = _several(comm) and comm.single_node
    for nbytes in (4, 4 << 10, 64 << 10, 1 << 20, 4 << 20):
        for dtype in DTYPES:
            chosen = choose("allreduce", False, nbytes, comm, None, dtype, "sum")
            assert chosen == ("shm" if several else "mpi"), (nbytes, dtype)
    # what the kernel does not sum stays MPI's below MPX_AUTO_SMALL_BYTES
    assert choose("allreduce", False, 4096, comm, None, torch.float32, "max") == "mpi"
    assert choose("allreduce", False, 4096, comm, None, torch.bfloat16, "sum") == "mpi"
    assert choose("broadcast", False, 4096, comm, None, torch.float32, "") == "mpi"
    assert shm_flags.AVAILABLE is fast_path.COMPILED  # the kernel is the compiled module's


def test_the_setting_bounds_it_and_zero_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    comm = world()
    several = _several(comm) and comm.single_node
    try:
        monkeypatch.setenv("MPX_SHM_FLAG_BYTES", "64K")
        reload_settings()
        small = choose("allreduce", False, 64 << 10, comm, None, torch.float32, "sum")
        assert small == ("shm" if several else "mpi")
        # above it: MPI below MPX_AUTO_SMALL_BYTES, as before
        above = choose("allreduce", False, (64 << 10) + 4, comm, None, torch.float32, "sum")
        assert above == "mpi"
        monkeypatch.setenv("MPX_SHM_FLAG_BYTES", "0")
        reload_settings()
        assert choose("allreduce", False, 4096, comm, None, torch.float32, "sum") == "mpi"
    finally:
        monkeypatch.delenv("MPX_SHM_FLAG_BYTES")
        reload_settings()
    assert not takes(2, True, torch.float32, "sum", 4096, 0)
    assert not takes(2, False, torch.float32, "sum", 4096, 1 << 20)  # several nodes
    assert not takes(1, True, torch.float32, "sum", 4096, 1 << 20)  # one rank: nothing to do
    assert not takes(2, True, torch.float16, "sum", 4096, 1 << 20)
    assert not takes(2, True, torch.float32, "prod", 4096, 1 << 20)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_equals_numpy_through_both_paths_and_growing_buffers(
    comm: Communicator, dtype: torch.dtype, op: str
) -> None:
    """Sizes across the buffers' growth (64 KiB, 128 KiB, ... 4 MiB), each called
    twice (both buffers), blocking (the fast path after the first call) and async."""
    if op == "avg" and not dtype.is_floating_point:
        pytest.skip("avg needs a floating dtype (the general path raises)")
    element = torch.empty(0, dtype=dtype).element_size()
    for salt, nbytes in enumerate((8, 64 << 10, (64 << 10) + 8, 1 << 20, 4 << 20)):
        n = nbytes // element
        inputs = _inputs(comm.size, dtype, n, salt)
        expected = _expected(inputs, op)
        for call in range(3):
            t = inputs[comm.rank].clone()
            if call == 2:
                allreduce(t, op, comm=comm, async_op=True).wait(timeout=120)
            else:
                allreduce(t, op, comm=comm)
            if dtype.is_floating_point:
                tol = 1e-5 if dtype == torch.float32 else 1e-12
                np.testing.assert_allclose(t.double().numpy(), expected, rtol=tol, atol=tol)
            else:
                np.testing.assert_array_equal(t.numpy(), expected)
            _same_on_every_rank(comm, t)
        if _several(comm):
            assert _flags(comm).buffer >= nbytes
    if _several(comm):
        # every call above went through the flags: numbered since the last window
        assert all(_flags(comm).posted(r) >= 3 for r in range(comm.size))


def test_the_fast_path_takes_it_once_the_window_is_there(comm: Communicator) -> None:
    t = torch.full((1000,), float(comm.rank + 1))
    allreduce(t, comm=comm)  # the first: the general path makes the window
    assert float(t[0]) == sum(range(1, comm.size + 1))
    if not _several(comm):
        return
    window = _flags(comm)
    before = window.posted(comm.rank)
    t = torch.full((1000,), float(comm.rank + 1))
    assert fast_path.allreduce(t, "sum", comm, None)
    assert window.posted(comm.rank) == before + 1
    assert torch.equal(t, torch.full((1000,), float(sum(range(1, comm.size + 1)))))
    # impl="shm" named (the tuner times it so): the same call
    assert fast_path.allreduce(t, "sum", comm, "shm")
    assert window.posted(comm.rank) == before + 2
    assert float(t[0]) == sum(range(1, comm.size + 1)) * comm.size
    # a deadline: the general path, the same protocol as steps
    allreduce(t, comm=comm, timeout=60)
    assert window.posted(comm.rank) == before + 3
    assert float(t[0]) == sum(range(1, comm.size + 1)) * comm.size**2


# one piece; and three 128 KiB pieces, the last short (the fast path posts and sums
# them one by one, the general path posts them all at once)
@pytest.mark.parametrize("numel", [4096, (300 << 10) // 4 + 2])
def test_blocking_and_async_ranks_meet(comm: Communicator, numel: int) -> None:
    """Even ranks block (the fast path, in C), odd ranks go async (steps): one protocol;
    a call with a deadline and one needing grad take the general path on their rank."""
    for k in range(6):
        t = torch.full((numel,), float(comm.rank + k))
        t[-1] = -float(comm.rank * k)  # the last piece's last element: its own value
        if comm.rank % 2 == 0:
            allreduce(t, comm=comm)
        elif k % 3 == 0:
            allreduce(t, comm=comm, async_op=True).wait(timeout=60)
        elif k % 3 == 1:
            allreduce(t, comm=comm, timeout=60)  # a deadline: the general path, blocking
        else:
            t.requires_grad_(True)
            allreduce(t, comm=comm)
            t = t.detach()
        expected = torch.full((numel,), float(sum(r + k for r in range(comm.size))))
        expected[-1] = -float(sum(r * k for r in range(comm.size)))
        assert torch.equal(t, expected)
    if _several(comm):
        assert _flags(comm).posted(comm.rank) == 6


def test_different_sizes_raise_on_every_rank_before_any_flag(comm: Communicator) -> None:
    """MPX_CHECK=auto (the default) compares the call first: a mismatch raises on every
    rank, through the fast path as through the general path, and nothing is posted."""
    allreduce(torch.ones(64), comm=comm)  # the window, and a matched call
    t = torch.ones(100 + (comm.rank > 0))
    if comm.size == 1:
        allreduce(t, comm=comm)
        return
    posted = _flags(comm).posted(comm.rank) if _several(comm) else 0
    with pytest.raises(MismatchError, match=r"element count"):
        allreduce(t, comm=comm)
    assert torch.equal(t, torch.ones(100 + (comm.rank > 0)))  # nothing moved
    with pytest.raises(MismatchError, match=r"element count"):
        allreduce(t, comm=comm, async_op=True).wait(timeout=60)
    assert torch.equal(t, torch.ones(100 + (comm.rank > 0)))
    if _several(comm):
        assert _flags(comm).posted(comm.rank) == posted
    u = torch.ones(64)
    allreduce(u, comm=comm)  # and the communicator goes on
    assert float(u[0]) == comm.size


def test_free_gives_the_window_back() -> None:
    comm = Communicator.from_mpi(world().mpi)
    allreduce(torch.ones(10), comm=comm)
    window = comm.cached("shm_flags")
    comm.free()
    if _several(comm):
        assert isinstance(window, FlagWindow)
        assert window.address == 0
        assert window.posted(0) == 0  # freed: no read of memory given back
    assert comm.cached("shm_flags") is None
