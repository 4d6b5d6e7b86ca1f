"""The default-on cross-rank check of collective calls (MPX_CHECK=auto).

Every mismatch here returned garbage (or hung) before the check was on by
default, and the ones marked "out of step" did so even with it on, before
every call took part in the comparison: each raises MismatchError on every
rank, naming the op, the field that differs and every rank's call, and the
next correct call is correct. Run under mpxrun -n 1, 2, 3: with one rank
nothing can differ, and the tests check that agreeing calls pass.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from mpx.collectives import Communicator, MismatchError, allreduce, broadcast, world
from mpx.collectives.core.consistency import (
    call_of,
    decode,
    encode,
    fields_differ,
    first_difference,
    signature_of,
)
from mpx.collectives.node.call_board import calls_differ
from mpx.launch.settings import reload as reload_settings


@pytest.fixture(params=["auto", "1"])
def comm(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Communicator]:
    """A fresh communicator under the default MPX_CHECK (the call board) and under 1 (MPI)."""
    world()  # made first, under the default settings (it lives for the whole session)
    monkeypatch.setenv("MPX_CHECK", request.param)
    reload_settings()
    created = Communicator.from_mpi(world().mpi)
    yield created
    created.free()
    monkeypatch.delenv("MPX_CHECK")
    reload_settings()


def _every_rank_raises(comm: Communicator, call: object, match: str) -> None:
    assert callable(call)
    if comm.size == 1:
        call()  # nothing can differ: the call passes
        return
    with pytest.raises(MismatchError, match=match):
        call()


# -- without MPI: the pieces ----------------------------------------------------


def test_rows_are_shared_read_only_and_their_cache_is_bounded() -> None:
    """A repeated call reuses its row (~3 us of numpy less); varying shapes stay bounded."""
    from mpx.collectives.core import consistency

    first = encode(("allreduce", "float32", 10, "sum", -1))
    assert encode(("allreduce", "float32", 10, "sum", -1)) is first
    assert encode(("allreduce", "float32", 10, "sum", -1), 5) is not first
    with pytest.raises(ValueError, match="read-only"):
        first[2] = 11  # shared by every call of that signature: never written
    for n in range(3 * consistency._ROWS_LIMIT):
        assert decode(encode(("allreduce", "float32", n, "sum", -1)))[0][2] == n
    assert len(consistency._ROWS) <= consistency._ROWS_LIMIT


def test_signatures_survive_the_wire() -> None:
    sig = signature_of("allreduce", torch.ones(3, 5, dtype=torch.bfloat16), "max", -1)
    assert sig == ("allreduce", "bfloat16", 15, "max", -1)
    assert decode(encode(sig, 1234)) == (sig, 1234)
    bcast = signature_of("broadcast", torch.ones(2, dtype=torch.int16), "", 2)
    assert decode(encode(bcast))[0] == bcast
    rows = np.stack([encode(sig), encode(sig)])
    assert not calls_differ(rows)
    rows[1, 2] += 1
    assert calls_differ(rows)


def test_the_error_names_the_field_and_every_call() -> None:
    a = ("allreduce", "float32", 1000, "sum", -1)
    error = first_difference("allreduce", [a, a, ("allreduce", "float64", 1000, "sum", -1)], "")
    assert error is not None
    assert str(error).startswith(
        "allreduce: ranks disagree on dtype: rank 0 passed float32[1000], rank 2 float64[1000]"
    )
    assert "rank 1: allreduce(float32[1000], op='sum'); rank 2: allreduce(float64[1000]" in str(
        error
    )
    op = first_difference("allreduce", [a, ("allreduce", "float32", 1000, "max", -1)], "")
    assert "disagree on reduce op: rank 0 passed op='sum', rank 1 op='max'" in str(op)
    other = first_difference("allreduce", [a, ("broadcast", "float32", 1000, "", 0)], "")
    assert "rank 0 called allreduce(float32[1000], op='sum'), rank 1 broadcast(" in str(other)
    assert first_difference("allreduce", [a, a], "") is None
    # Calls show their shapes; the same element count in another shape is no mismatch.
    shaped = call_of("allreduce", torch.ones(2, 5), "sum", -1)
    flat = call_of("allreduce", torch.ones(10), "sum", -1)
    assert first_difference("allreduce", [shaped, flat], "") is None
    wide = call_of("allreduce", torch.ones(4, 5), "sum", -1)
    assert "rank 0 passed float32[2, 5], rank 1 float32[4, 5]" in str(
        first_difference("allreduce", [shaped, wide], "")
    )


def test_configurations_name_the_differing_field() -> None:
    error = fields_differ("quantized allreduce", [{"bits": 4, "n": 1}, {"bits": 8, "n": 1}])
    assert error is not None
    assert str(error).startswith(
        "quantized allreduce: ranks disagree on bits: rank 0 passed 4, rank 1 8"
    )
    assert fields_differ("x", [{"bits": 4}, {"bits": 4}]) is None


# -- under MPI: caught by default -----------------------------------------------


@pytest.mark.mpi
def test_different_dtypes_raise_on_every_rank(comm: Communicator) -> None:
    dtype = torch.float32 if comm.rank == 0 else torch.float64
    t = torch.ones(1000, dtype=dtype)
    _every_rank_raises(
        comm,
        lambda: allreduce(t, comm=comm, timeout=60),
        r"allreduce: ranks disagree on dtype: "
        r"rank 0 passed float32\[1000\], rank 1 float64\[1000\]",
    )
    assert torch.equal(t, torch.ones(1000, dtype=dtype))  # no data moved


@pytest.mark.mpi
@pytest.mark.parametrize("impl", [None, "mpi", "ring", "shm"])
def test_different_sizes_raise_on_every_rank(comm: Communicator, impl: str | None) -> None:
    """``ring`` with different sizes: a raw 'Message truncated' on one rank, a hang on another."""
    t = torch.ones(100 + (comm.rank > 0))
    _every_rank_raises(
        comm,
        lambda: allreduce(t, comm=comm, impl=impl, timeout=60),
        r"element count: rank 0 passed float32\[100\], rank 1 float32\[101\]",
    )


@pytest.mark.mpi
def test_different_reduce_ops_and_roots_raise(comm: Communicator) -> None:
    t = torch.ones(10)
    _every_rank_raises(
        comm,
        lambda: allreduce(t, "sum" if comm.rank == 0 else "max", comm=comm, timeout=60),
        "reduce op: rank 0 passed op='sum', rank 1 op='max'",
    )
    _every_rank_raises(
        comm,
        lambda: broadcast(t, min(comm.rank, 1), comm=comm, timeout=60),
        "root: rank 0 passed root=0, rank 1 root=1",
    )


@pytest.mark.mpi
def test_different_ops_raise(comm: Communicator) -> None:
    t = torch.ones(10)
    _every_rank_raises(
        comm,
        lambda: (
            allreduce(t, comm=comm, timeout=60)
            if comm.rank == 0
            else broadcast(t, 0, comm=comm, timeout=60)
        ),
        r"rank 0 called allreduce\(float32\[10\], op='sum'\), "
        r"rank 1 broadcast\(float32\[10\], root=0\)",
    )


@pytest.mark.mpi
@pytest.mark.parametrize("impl", [None, "mpi", "ring", "shm"])
@pytest.mark.parametrize("count", [10, 1024, 262144])
def test_signatures_each_rank_used_before_are_compared(
    comm: Communicator, impl: str | None, count: int
) -> None:
    """Out of step: rank 0 repeats [count] while the others repeat [20] -- both seen before.

    Then a call whose signature is new on rank 0 only (the old ledger compared
    it on rank 0 alone: garbage there, a garbled error elsewhere).
    """
    for n in (count, 20):
        allreduce(torch.ones(n), comm=comm, impl=impl, timeout=60)
    mine = torch.ones(count if comm.rank == 0 else 20)
    _every_rank_raises(
        comm,
        lambda: allreduce(mine, comm=comm, impl=impl, timeout=60),
        rf"element count: rank 0 passed float32\[{count}\], rank 1 float32\[20\]",
    )
    assert torch.equal(mine, torch.ones_like(mine))  # no data moved
    new = torch.ones(count + 7 if comm.rank == 0 else 20)
    _every_rank_raises(
        comm, lambda: allreduce(new, comm=comm, impl=impl, timeout=60), "element count"
    )
    # The next correct call is correct, on every path.
    for n in (count, 20):
        t = torch.full((n,), float(comm.rank + 1))
        allreduce(t, comm=comm, impl=impl, timeout=60)
        assert torch.equal(t, torch.full((n,), float(sum(range(1, comm.size + 1)))))


@pytest.mark.mpi
def test_a_fast_path_call_meets_a_general_path_call(comm: Communicator) -> None:
    """Out of step: rank 0's call on the compiled fast path, the others' on the general one."""
    t = torch.ones(16)
    allreduce(t, comm=comm)  # the fast path's call is cached on rank 0
    t.fill_(1)
    if comm.rank == 0:
        call = lambda: allreduce(t, "sum", comm=comm)  # noqa: E731 -- fast path (no timeout)
    else:
        call = lambda: allreduce(t, "max", comm=comm, timeout=60)  # noqa: E731 -- general
    _every_rank_raises(comm, call, "reduce op: rank 0 passed op='sum', rank 1 op='max'")
    allreduce(t, comm=comm)
    assert torch.equal(t, torch.full((16,), float(comm.size)))


@pytest.mark.mpi
def test_asynchronous_calls_are_compared_in_order(comm: Communicator) -> None:
    a, b = torch.ones(8), torch.ones(8 + (comm.rank > 0))
    first = allreduce(a, comm=comm, async_op=True, timeout=60)
    second = allreduce(b, comm=comm, async_op=True, timeout=60)
    assert torch.equal(first.wait(), torch.full((8,), float(comm.size)))
    if comm.size == 1:
        second.wait()
    else:
        with pytest.raises(MismatchError, match="element count"):
            second.wait()
    c = torch.ones(8)
    assert torch.equal(allreduce(c, comm=comm, timeout=60), torch.full((8,), float(comm.size)))


@pytest.mark.mpi
def test_check_same_compares_every_call(comm: Communicator) -> None:
    """Out of step: a configuration every rank passed before, then one rank another."""
    for bits in (4, 8):
        comm.check_same("quantized allreduce", {"bits": bits, "bucket_size": 512})
    _every_rank_raises(
        comm,
        lambda: comm.check_same(
            "quantized allreduce", {"bits": 4 if comm.rank == 0 else 8, "bucket_size": 512}
        ),
        "quantized allreduce: ranks disagree on bits: rank 0 passed 4, rank 1 8",
    )
    comm.check_same("quantized allreduce", {"bits": 2, "bucket_size": 512})


@pytest.mark.mpi
def test_the_check_keeps_no_state_per_signature(comm: Communicator) -> None:
    """Dynamic shapes: 100,000 distinct element counts grew the old check by 41 MiB.

    What remains are the bounded caches of the policy and the fast path
    (4096 entries each, cleared when full): traced from the first call, the
    memory in use never exceeds ~2.7 MiB over 12,000 new shapes, and would
    pass 7 MiB with the old check's ~0.4 KB per shape. (12,000 small counts:
    30,000 shapes took 3 minutes of CI at 3 ranks.)
    """
    shapes, most = 12_000, 0
    tracemalloc.start()
    try:
        start, _ = tracemalloc.get_traced_memory()
        for n in range(1, shapes + 1):
            allreduce(torch.ones(n), comm=comm)
            if n % 500 == 0:
                most = max(most, tracemalloc.get_traced_memory()[0] - start)
    finally:
        tracemalloc.stop()
    assert most < 3.5 * 1024 * 1024, f"grew by up to {most} bytes over {shapes} new shapes"
