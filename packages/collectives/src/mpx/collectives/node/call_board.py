"""The call board: where the ranks of one node compare each collective call.

Each communicator whose ranks share one node keeps, in MPI-3 shared memory,
two slots per rank (the halves of the board). The k-th checked call of the
communicator goes to half ``k % 2``::

    slot (8 int64)   [0] k, the call's number       written last: a peer that
                     [1..6] the call's row          reads k there sees the row
                     (consistency.encode)
                     [7] unused (a slot is one 64-byte cache line)

    rank r, call k:  write row, then k, into its slot of half k % 2; wait until
                     every peer's slot of half k % 2 says >= k; compare the rows

A peer cannot overwrite a row another rank has yet to read: to post call k+2
into the same half it must first pass the wait of call k+1, which needs every
rank to have posted k+1 -- after reading the rows of k. So two halves suffice,
whatever the ranks do between calls, and a failed comparison leaves nothing
behind: every rank has moved on by exactly one call.

The wait is a barrier that carries the call; the collective behind it would
wait for its peers anyway.

The protocol runs in C wherever :mod:`mpx.collectives.core.fast_path` is compiled:
its fast path runs it inline, and every board made after it was imported (the
package imports it first) runs it through its ``board_*`` functions, on the
board's address, slot layout and counter (:func:`use_compiled`; this module
cannot import fast_path, which imports it). The numpy form below is the
fallback where the extension is not built; it writes the same memory the same
way (``compiled`` says which one a board runs). The C form saves the general
path ~10-15 µs of numpy per call (a 1 MiB shm allreduce paid 29-64 µs, +6..+21 %,
for the whole numpy check).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
from mpi4py import MPI

from mpx.collectives.base import Backoff, Pending

__all__ = [
    "ROW",
    "SLOT",
    "Arrival",
    "CallBoard",
    "CompiledProtocol",
    "calls_differ",
    "compiled_protocol",
    "use_compiled",
]

ROW = 6
"""int64s per call: op, dtype, element count, reduce op, root, configuration hash
(the row :func:`mpx.collectives.core.consistency.encode` makes of a call)."""

SLOT = 8
"""int64s per slot: the call's number, its row (``ROW``), padding."""


def calls_differ(rows: np.ndarray) -> bool:
    """Whether the ranks' rows (one per rank, ``ROW`` int64s each) are not all equal."""
    return bool((rows[:, :ROW] != rows[0, :ROW]).any())


@dataclass(frozen=True)
class CompiledProtocol:
    """The board's protocol in C (``fast_path.board_*``), on addresses as ints.

    ``post(slots, counter, me, row) -> number``, ``arrived(slots, size, number)``,
    ``same(slots, size, me, number)``, ``wait(slots, size, number, yielding)``.
    """

    post: Callable[[int, int, int, np.ndarray], int]
    arrived: Callable[[int, int, int], bool]
    same: Callable[[int, int, int, int], bool]
    wait: Callable[[int, int, int, bool], None]


_compiled: list[CompiledProtocol] = []


def use_compiled(
    post: Callable[[int, int, int, np.ndarray], int],
    arrived: Callable[[int, int, int], bool],
    same: Callable[[int, int, int, int], bool],
    wait: Callable[[int, int, int, bool], None],
) -> None:
    """Boards made from now on run the protocol through these C functions.

    Called by the compiled :mod:`mpx.collectives.core.fast_path` when it is imported.
    """
    _compiled[:] = [CompiledProtocol(post, arrived, same, wait)]


def compiled_protocol() -> CompiledProtocol | None:
    """The C protocol new boards run, or None (numpy: the extension is not built)."""
    return _compiled[0] if _compiled else None


class CallBoard:
    """One node's board of a communicator (collective to create: every node rank).

    Attributes:
        slots: ``(node_size, 2, SLOT)`` int64 view of the shared memory.
        counter: one int64, this rank's number of checked calls so far (an
            array, so the compiled fast path counts through its address).
        members: the communicator rank of each node rank (errors name them).
        compiled: whether this board runs the protocol in C (see the module).
    """

    def __init__(
        self,
        node_comm: MPI.Intracomm,
        members: list[int],
        numpy_only: bool = False,
        yielding: bool = True,
    ) -> None:
        size = node_comm.Get_size()
        # How wait() waits: as the communicator's blocking waits do. Not
        # yielding (a core per rank): polls and sched_yields, never sleeps,
        # like MPI's spinning wait that MPX_CHECK=0 leaves the call in --
        # a sleeping wait woke up to ~1 ms late (its sleeps grow to 1 ms)
        # whenever the peers came more than 0.5 ms after this rank, a cost
        # the check added to every data-parallel step whose ranks were out
        # of step. Yielding (ranks outnumber cores): sleeps after 0.5 ms.
        self.yielding = yielding
        self.node_rank: int = node_comm.Get_rank()
        self.size = size
        self.members = members
        self._win = MPI.Win.Allocate_shared(
            8 * 2 * SLOT * size if self.node_rank == 0 else 0, 8, comm=node_comm
        )
        # A passive epoch for the board's life: MPI_Win_sync (the memory barrier
        # between a row and its number) is only valid inside one.
        self._win.Lock_all(MPI.MODE_NOCHECK)
        buffer, _ = self._win.Shared_query(0)
        self.slots = np.ndarray((size, 2, SLOT), dtype=np.int64, buffer=cast(Any, buffer))
        self.slots[self.node_rank] = 0
        self.counter = np.zeros(1, dtype=np.int64)
        self._numbers = self.slots[:, :, 0]  # (size, 2) view: every rank's call numbers
        # numpy_only: the fallback on purpose (tests: it meets the C form).
        self._c = None if numpy_only else compiled_protocol()
        self.compiled = self._c is not None
        self._address = int(self.slots.ctypes.data)
        self._counter = int(self.counter.ctypes.data)
        node_comm.Barrier()  # every rank's slots are zero before any call posts

    @property
    def address(self) -> int:
        """Where the slots start in this process's memory (for the fast path)."""
        return self._address

    def post(self, row: np.ndarray) -> int:
        """Writes this rank's row (``ROW`` int64s) of its next call; returns the call's number."""
        if self._c is not None:
            return self._c.post(self._address, self._counter, self.node_rank, row)
        number = int(self.counter[0]) + 1
        self.counter[0] = number
        slot = self.slots[self.node_rank, number & 1]
        slot[1 : 1 + ROW] = row
        self._win.Sync()  # the row is visible before the number (a memory barrier)
        slot[0] = number
        return number

    def arrived(self, number: int) -> bool:
        """Whether every rank has posted call ``number``."""
        if self._c is not None:
            return self._c.arrived(self._address, self.size, number)
        return bool((self._numbers[:, number & 1] >= number).all())

    def behind(self, number: int) -> list[int]:
        """The communicator ranks that have not posted call ``number``."""
        column = self._numbers[:, number & 1]
        return [self.members[i] for i in range(self.size) if column[i] < number]

    def rows(self, number: int) -> np.ndarray:
        """Every rank's row of call ``number`` (all must have posted it)."""
        self._win.Sync()  # read the rows after the numbers that announced them
        return self.slots[:, number & 1, 1 : 1 + ROW]

    def same(self, number: int) -> bool:
        """Whether every rank's row of call ``number`` is this rank's (all have posted it)."""
        if self._c is not None:
            return self._c.same(self._address, self.size, self.node_rank, number)
        return not calls_differ(self.rows(number))

    def wait(self, number: int) -> None:
        """Blocks until every rank has posted call ``number``: polls, then yields the core,
        then (``yielding`` only) sleeps."""
        if self._c is not None:
            self._c.wait(self._address, self.size, number, self.yielding)  # without the GIL
            return
        backoff = Backoff()
        while not self.arrived(number):
            if self.yielding:
                backoff.pause()
            else:
                os.sched_yield()

    def free(self) -> None:
        # A step still polling (an operation that timed out) reads private
        # copies from now on, never the shared memory given back to MPI.
        self.slots = self.slots.copy()
        self._numbers = self.slots[:, :, 0]
        self._address = int(self.slots.ctypes.data)
        self._win.Unlock_all()
        self._win.Free()


class Arrival(Pending):
    """A step that waits for every rank to post a call on the board."""

    __slots__ = ("board", "number")

    def __init__(self, board: CallBoard, number: int) -> None:
        self.board = board
        self.number = number

    @property
    def peers(self) -> Sequence[int]:  # type: ignore[override]  # computed when a timeout asks
        return self.board.behind(self.number)

    def test(self) -> bool:
        return self.board.arrived(self.number)

    def wait(self) -> None:
        self.board.wait(self.number)
