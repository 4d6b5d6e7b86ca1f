"""The small-call fast path: same results as numpy, same MPI call, same order.

Every rank builds every rank's input from (rank, case), so numpy can reduce
them all: an independent reference. Whether a call is taken is decided from
values that agree across ranks, so a test never leaves one rank in MPI alone.
Run under mpxrun -n 1, 2, 3.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from mpx.collectives import Communicator, allreduce, broadcast, world
from mpx.collectives.core import fast_path, ops
from mpx.launch.settings import reload as reload_settings

pytestmark = pytest.mark.mpi

NUMPY_REDUCE: dict[str, Callable[..., np.ndarray]] = {
    "sum": np.sum,
    "max": np.max,
    "min": np.min,
    "prod": np.prod,
}


def _inputs(size: int, dtype: torch.dtype, salt: int) -> list[torch.Tensor]:
    out = []
    for r in range(size):
        rng = np.random.default_rng([r, salt])
        if dtype.is_floating_point:
            out.append(torch.from_numpy(rng.normal(size=37)).to(dtype))
        else:
            out.append(torch.from_numpy(rng.integers(-3, 4, size=37)).to(dtype))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64])
@pytest.mark.parametrize("op", ["sum", "max", "min", "prod", "avg"])
def test_allreduce_is_taken_and_equals_numpy(dtype: torch.dtype, op: str) -> None:
    comm = world()
    if op == "avg" and not dtype.is_floating_point:
        pytest.skip("avg needs a floating dtype (the general path raises)")
    inputs = _inputs(comm.size, dtype, salt=len(op))
    stacked = np.stack([t.double().numpy() if dtype.is_floating_point else t.numpy()
                        for t in inputs])  # fmt: skip
    expected = stacked.mean(0) if op == "avg" else NUMPY_REDUCE[op](stacked, axis=0)
    t = inputs[comm.rank].clone()
    allreduce(t.clone(), op)  # MPX_CHECK=auto compares a new signature once, first
    assert fast_path.allreduce(t, op, None, None)
    if dtype.is_floating_point:
        tol = 1e-5 if dtype == torch.float32 else 1e-12
        np.testing.assert_allclose(t.double().numpy(), expected, rtol=tol, atol=tol)
    else:
        np.testing.assert_array_equal(t.numpy(), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.uint8])
def test_broadcast_is_taken_from_every_root(dtype: torch.dtype) -> None:
    comm = world()
    for root in range(comm.size):
        inputs = _inputs(comm.size, torch.int64, salt=root)
        t = inputs[comm.rank].abs().to(dtype)
        assert fast_path.broadcast(t, root, None, None)
        assert torch.equal(t, inputs[root].abs().to(dtype))


@pytest.mark.parametrize("check", ["auto", "0"])
def test_every_call_is_compared_on_the_call_board(
    check: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MPX_CHECK=auto: the fast path posts every call on the board (no first-call detour)."""
    monkeypatch.setenv("MPX_CHECK", check)
    reload_settings()
    comm = Communicator.from_mpi(world().mpi)  # a fresh board: no call posted yet
    assert comm.call_board is not None  # one node: these tests run on one host
    t = torch.arange(43, dtype=torch.float64)
    for done in range(1, 4):
        assert fast_path.allreduce(t, "max", comm, None)  # taken from the first call
        assert int(comm.call_board.counter[0]) == (done if check == "auto" else 0)
    assert torch.equal(t, torch.arange(43, dtype=torch.float64))
    comm.free()
    monkeypatch.delenv("MPX_CHECK")
    reload_settings()


def test_public_operations_count_their_payload() -> None:
    from mpx.collectives import bytes_communicated

    before = bytes_communicated()
    allreduce(torch.ones(8))
    broadcast(torch.ones(4, dtype=torch.float64), 0)
    assert bytes_communicated() - before == 8 * 4 + 4 * 8


def _declined(t: torch.Tensor, op: str = "sum", impl: str | None = None) -> None:
    before = t.detach().clone()
    assert not fast_path.allreduce(t, op, None, impl)
    assert torch.equal(t.detach(), before)  # nothing was done


def test_declines_what_it_cannot_take() -> None:
    _declined(torch.ones(4, dtype=torch.bfloat16))  # MPI cannot reduce it
    _declined(torch.ones(4, dtype=torch.float16))
    _declined(torch.ones(4, dtype=torch.int16))  # unsupported: the general path raises
    _declined(torch.ones(4, dtype=torch.complex64))
    _declined(torch.ones(4, requires_grad=True))
    _declined(torch.ones(4, 4).t()[0])  # not contiguous
    _declined(torch.ones(0))  # empty: the general path decides
    _declined(torch.ones(4, dtype=torch.int32), op="avg")  # the general path raises
    _declined(torch.ones(4), op="median")
    _declined(torch.ones(4), impl="ring")
    _declined(torch.ones(4), op="max", impl="shm")  # a sum is shm's flags (test_shm_flags)
    assert not fast_path.broadcast(torch.ones(4), world().size, None, None)  # bad root


def test_declines_large_tensors_under_auto_on_several_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MPX_AUTO_SMALL_BYTES", "64")
    monkeypatch.setenv("MPX_SHM_FLAG_BYTES", "64")  # and above shm's flag-based small allreduce
    reload_settings()
    t = torch.ones(32)  # 128 bytes: auto picks shm/hier/ring on several ranks
    if world().size > 1:
        _declined(t)
    else:
        allreduce(t.clone())  # MPX_CHECK=auto compares a new signature once, first
        assert fast_path.allreduce(t, "sum", None, None)  # one rank: always mpi
    allreduce(t.clone(), impl="mpi")
    assert fast_path.allreduce(t, "sum", None, "mpi")  # named: any size


def test_declines_under_mpx_check_and_deadlines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPX_CHECK", "1")
    reload_settings()
    _declined(torch.ones(4))
    monkeypatch.delenv("MPX_CHECK")
    reload_settings()
    timed = Communicator(world().mpi.Dup(), timeout=30.0)
    before = torch.ones(4)
    assert not fast_path.allreduce(before, "sum", timed, None)
    assert torch.equal(before, torch.ones(4))


def test_waits_behind_queued_collectives() -> None:
    """A small blocking call after an unfinished async one keeps the FIFO order."""
    comm = Communicator.from_mpi(world().mpi)
    comm.background_progress = False  # the async call stays queued until polled
    first = torch.full((1000,), float(comm.rank))
    handle = allreduce(first, comm=comm, impl="mpi", async_op=True)
    second = torch.ones(3)
    if comm.size > 1:
        assert not fast_path.allreduce(second.clone(), "sum", comm, None)
    allreduce(second, comm=comm)  # the general path: runs after ``first``
    assert handle.wait(timeout=60) is first
    assert float(first[0]) == sum(range(comm.size))
    assert second.tolist() == [float(comm.size)] * 3


def test_meets_asynchronous_calls_on_other_ranks() -> None:
    """Even ranks block (fast path), odd ranks call async: the same MPI call matches."""
    comm = world()
    for k in range(3):
        t = torch.full((16,), float(comm.rank + k))
        if comm.rank % 2 == 0:
            allreduce(t)
        else:
            allreduce(t, async_op=True).wait(timeout=60)
        assert float(t[0]) == sum(r + k for r in range(comm.size))
        b = torch.full((5,), float(comm.rank))
        if comm.rank % 2 == 1:
            broadcast(b, 0)
        else:
            broadcast(b, 0, async_op=True).wait(timeout=60)
        assert b.tolist() == [0.0] * 5


def test_the_python_form_runs_without_cython(monkeypatch: pytest.MonkeyPatch) -> None:
    """fast_path.py as Python where Cython is not installed: same results, same MPI calls.

    (Where the installed module is that form already, this runs it a second time.)
    """
    monkeypatch.setitem(sys.modules, "cython", None)  # ``import cython`` fails
    source = Path(str(fast_path.__file__)).with_name("fast_path.py")
    spec = importlib.util.spec_from_file_location("mpx.collectives._fast_path_python", source)
    assert spec is not None
    assert spec.loader is not None
    python_form = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(python_form)
    assert not python_form.COMPILED
    assert not python_form.DIRECT
    comm = world()
    # ops.allreduce calls ops' global fast_path; each form caches its own calls.
    monkeypatch.setitem(vars(ops), "fast_path", python_form)
    comm.choices.fast.clear()
    try:
        # Both checks: MPX_CHECK=auto runs the call board's protocol in Python here.
        for check in ("auto", "0"):
            monkeypatch.setenv("MPX_CHECK", check)
            # The policy gives small sums to shm's flag-based allreduce where the
            # package is compiled (as here), which the Python form leaves to the general path.
            monkeypatch.setenv("MPX_SHM_FLAG_BYTES", "0")
            reload_settings()
            before = python_form.payload()
            for dtype in (torch.float32, torch.int64):
                t = torch.full((9,), comm.rank + 1, dtype=dtype)
                allreduce(t)
                assert t.tolist() == [sum(range(1, comm.size + 1))] * 9
                b = torch.full((5,), comm.rank, dtype=dtype)
                broadcast(b, comm.size - 1)
                assert b.tolist() == [comm.size - 1] * 5
            assert python_form.payload() - before == (9 + 5) * 4 + (9 + 5) * 8  # f32, i64
    finally:
        comm.choices.fast.clear()
        monkeypatch.delenv("MPX_CHECK", raising=False)
        monkeypatch.delenv("MPX_SHM_FLAG_BYTES", raising=False)
        reload_settings()
