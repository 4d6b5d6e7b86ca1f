"""The call board's protocol: in C where fast_path is compiled, numpy otherwise.

The general path's check (``Communicator._compare``) posts, waits and compares
through :class:`CallBoard`; with the extension built, the board runs the
compiled module's C functions (the numpy form cost a 1 MiB shm allreduce
29-64 µs). Both forms write the same memory the same way, so a rank running
one meets a rank running the other.
"""

from __future__ import annotations

import importlib.machinery
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

from mpx.collectives import Communicator, world
from mpx.collectives.core import fast_path
from mpx.collectives.core.consistency import encode
from mpx.collectives.node.call_board import CallBoard, CompiledProtocol, compiled_protocol


def _extension_built() -> bool:
    """Whether a compiled fast_path sits beside its source (what Python would import)."""
    folder = Path(str(fast_path.__file__)).parent
    return any(
        (folder / f"fast_path{suffix}").exists()
        for suffix in importlib.machinery.EXTENSION_SUFFIXES
    )


def test_boards_run_the_compiled_protocol_when_the_extension_is_built() -> None:
    built = _extension_built()
    assert built == fast_path.COMPILED, "fast_path.COMPILED disagrees with the files installed"
    comm = Communicator.from_mpi(world().mpi)
    try:
        assert comm.call_board is not None  # one node: the check runs on the board
        # The general path runs numpy only where the extension is not built.
        assert comm.call_board.compiled == built
        assert (compiled_protocol() is not None) == built
    finally:
        comm.free()


def test_a_board_forced_to_numpy_says_so() -> None:
    node = MPI.COMM_SELF.Dup()
    board = CallBoard(node, [0], numpy_only=True)
    try:
        assert not board.compiled
        row = encode(("allreduce", "float32", 10, "sum", -1))
        number = board.post(row)
        assert board.arrived(number)
        assert board.same(number)
        assert board.rows(number).tolist() == [row.tolist()]
    finally:
        board.free()
        node.Free()


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_the_numpy_form_meets_the_compiled_form() -> None:
    """Even node ranks run numpy, odd ones the compiled form (where built): same answers."""
    node = MPI.Intracomm(MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED))
    me = node.Get_rank()
    board = CallBoard(node, list(range(node.Get_size())), numpy_only=me % 2 == 0)
    try:
        agree = encode(("allreduce", "float32", 1000, "sum", -1))
        differ = encode(("allreduce", "float32", 1000 + me, "sum", -1), configuration=7)
        # Both halves of the board, twice, agreeing and (beyond one rank) not.
        for call in range(6):
            row = differ if call % 3 == 2 else agree
            number = board.post(row)
            assert number == call + 1
            if call % 2:
                board.wait(number)
            else:
                while not board.arrived(number):
                    pass
            assert board.arrived(number)
            expected = node.Get_size() == 1 or row is agree
            assert board.same(number) == expected
            rows = np.array(board.rows(number))
            assert rows[me].tolist() == row.tolist()
    finally:
        board.free()
        node.Free()


def _recording(real: CompiledProtocol, asked: list[bool]) -> Any:
    """``real.wait``, recording whether each wait was asked to yield (sleep)."""

    def wait(slots: int, size: int, number: int, yielding: bool) -> None:
        asked.append(yielding)
        real.wait(slots, size, number, yielding)

    return wait


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_the_board_waits_as_its_communicator_waits() -> None:
    """A communicator with a core per rank waits at the board without sleeping.

    Its unchecked calls wait in MPI's spinning wait; a board wait that slept
    (20 µs growing to 1 ms after 0.5 ms) woke up to ~1 ms late whenever the
    peers came late, which the check added to the data-parallel step. Both
    the C and the numpy form take the communicator's choice.
    """
    import dataclasses

    comm = Communicator.from_mpi(world().mpi)
    try:
        board = comm.call_board
        assert board is not None
        assert board.yielding == comm.yielding
        for yielding in (False, True):
            board.yielding = yielding
            asked: list[bool] = []
            real = board._c
            if real is not None:
                board._c = dataclasses.replace(real, wait=_recording(real, asked))
            try:
                number = board.post(encode(("allreduce", "float32", 10, "sum", -1)))
                board.wait(number)
                assert board.same(number)
            finally:
                board._c = real
            assert asked in ([yielding], [])  # [] where the extension is not built
    finally:
        comm.free()
