"""The default-on cross-rank check of collective calls (MPX_CHECK=auto).

Every mismatch here returned garbage (or hung) before the check was on by
default; now each raises MismatchError on every rank, naming the op, the
field that differs and both values. Run under mpxrun -n 1, 2, 3: with one
rank nothing can differ, and the tests check that agreeing calls pass.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from mpx.collectives import Communicator, MismatchError, allreduce, broadcast, world
from mpx.collectives.consistency import (
    CallLedger,
    decode,
    encode,
    fields_differ,
    first_difference,
    signature_of,
)
from mpx.launch.settings import reload as reload_settings


@pytest.fixture
def comm(monkeypatch: pytest.MonkeyPatch) -> Iterator[Communicator]:
    """A fresh communicator under the default MPX_CHECK, comparing digests every 4 calls."""
    world()  # made first, under the default interval (it lives for the whole session)
    monkeypatch.delenv("MPX_CHECK", raising=False)
    monkeypatch.setenv("MPX_CHECK_INTERVAL", "4")
    reload_settings()
    created = Communicator.from_mpi(world().mpi)
    yield created
    created.free()
    monkeypatch.delenv("MPX_CHECK_INTERVAL")
    reload_settings()


def _every_rank_raises(comm: Communicator, call: object, match: str) -> None:
    assert callable(call)
    if comm.size == 1:
        call()  # nothing can differ: the call passes
        return
    with pytest.raises(MismatchError, match=match):
        call()


# -- without MPI: the pieces ----------------------------------------------------


def test_signatures_survive_the_wire() -> None:
    sig = signature_of("allreduce", torch.ones(3, 5, dtype=torch.bfloat16), "max", -1)
    assert sig == ("allreduce", "bfloat16", 15, "max", -1)
    assert decode(encode(sig, 7, 1234)) == (sig, 7, 1234)
    bcast = signature_of("broadcast", torch.ones(2, dtype=torch.int16), "", 2)
    assert decode(encode(bcast, 0, 0))[0] == bcast


def test_the_error_names_the_field_and_both_values() -> None:
    a = ("allreduce", "float32", 1000, "sum", -1)
    error = first_difference("allreduce", [a, a, ("allreduce", "float64", 1000, "sum", -1)], "")
    assert error is not None
    assert str(error).startswith(
        "allreduce: ranks disagree on dtype: rank 0 passed float32[1000], rank 2 float64[1000]"
    )
    op = first_difference("allreduce", [a, ("allreduce", "float32", 1000, "max", -1)], "")
    assert "disagree on reduce op: rank 0 passed op='sum', rank 1 op='max'" in str(op)
    other = first_difference("allreduce", [a, ("broadcast", "float32", 1000, "", 0)], "")
    assert "rank 0 called allreduce(float32[1000], op='sum'), rank 1 broadcast(" in str(other)
    assert first_difference("allreduce", [a, a], "") is None


def test_the_ledger_says_when_to_compare() -> None:
    ledger = CallLedger(interval=3)
    a = ("allreduce", "float32", 8, "sum", -1)
    b = ("broadcast", "float32", 8, "", 0)
    assert ledger.count(a) == (True, False)
    assert ledger.count(a) == (False, False)  # new only once, compared or not yet
    assert ledger.count(b) == (True, True)  # the third call: digests due
    assert [ledger.count(b) for _ in range(3)] == [(False, False), (False, False), (False, True)]
    assert [n for n, _ in ledger.recent()] == [4, 5, 6]
    assert [s for _, s in ledger.recent()] == [b, b, b]


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
def test_a_later_divergence_is_found_at_the_next_comparison(comm: Communicator) -> None:
    """Signatures each rank has used before: caught within MPX_CHECK_INTERVAL calls, named."""
    t = torch.ones(8)
    allreduce(t, "sum", comm=comm)  # call 1: compared (new)
    allreduce(t, "max", comm=comm)  # call 2: compared (new)
    assert comm.ledger.calls == 2
    # Call 3: rank 0 repeats "sum", the others "max" -- both compared already,
    # so the call runs (on the fast path) and returns wrong values.
    allreduce(t, "sum" if comm.rank == 0 else "max", comm=comm, timeout=60)
    assert comm.ledger.calls == 3

    def fourth() -> None:
        allreduce(t, "sum", comm=comm, timeout=60)  # call 4: the digests are compared

    _every_rank_raises(
        comm, fourth, r"reduce op: rank 0 passed op='sum', rank 1 op='max'.* \(call 3 on this"
    )


@pytest.mark.mpi
def test_agreeing_calls_compare_only_new_signatures_and_digests(comm: Communicator) -> None:
    t = torch.ones(16)
    for _ in range(10):
        allreduce(t, comm=comm)
        broadcast(t, 0, comm=comm)
    assert comm.ledger.calls == 20
    assert comm.ledger.verified == {
        ("allreduce", "float32", 16, "sum", -1),
        ("broadcast", "float32", 16, "", 0),
    }
    np.testing.assert_array_equal(t.numpy(), np.full(16, float(comm.size) ** 10))


@pytest.mark.mpi
def test_check_same_compares_each_configuration_once(comm: Communicator) -> None:
    comm.check_same("quantized allreduce", {"bits": 4, "bucket_size": 512})
    assert len(comm._same) == 1
    comm.check_same("quantized allreduce", {"bits": 4, "bucket_size": 512})  # no collective
    _every_rank_raises(
        comm,
        lambda: comm.check_same("quantized allreduce", {"bits": 4 if comm.rank == 0 else 8}),
        "quantized allreduce: ranks disagree on bits: rank 0 passed 4, rank 1 8",
    )
