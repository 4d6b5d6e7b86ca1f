"""``shm``'s small allreduce: one copy in, one wait on flags, one sum, in C.

Up to ``MPX_SHM_FLAG_BYTES`` (4 MiB) a float32/float64/int32/int64 ``sum`` or
``avg`` on one node is not worth ``shm``'s pieces and barriers, and MPI's own
allreduce costs 2-3x the memory traffic in protocol (a 64 KiB allreduce is ~10 µs of
copying; MPICH took 90-130 µs on two ranks, DeepSpeed's flag-based shared-memory
allreduce 42 µs). Each rank owns a flag and two buffers in one shared window::

    window:  rank 0: [flag | buf 0 | buf 1]   rank 1: [flag | buf 0 | buf 1]   ...
    call s, for each 128 KiB piece k of the tensor:
             copy piece k into buf s % 2; flag = s << 20 | k + 1   (release)
             wait until every rank's flag >= s << 20 | k + 1       (acquire)
             piece k = buf s % 2 of rank 0 + ... + rank P-1        (rank order: equal bits)

The pieces pipeline copy, wait and sum: a piece is summed while the caches its
copy warmed still hold it, and a rank sums the first piece while its peers
copy the last (BENCHMARKS.md, issue 46, session 17). A rank
writes buffer s % 2 again at call s + 2, after every peer has posted all of
s + 1, which it starts only once it has summed all of call s: one wait a
piece, no second barrier. The kernel is C (``fast_path.pxd``:
``mpx_flags_*``). The small-call fast path (:mod:`mpx.collectives.core.fast_path`)
runs the whole call in C without the GIL; the general path (``async_op``,
``timeout=``, calls queued behind others) posts every piece at once and then
runs the same waits as steps, so the two meet: a rank on either path matches
its peers on the other.

The policy's ``shm<small`` entry picks this for ``auto``; ``impl="shm"``
takes it for the same calls. Where the package is not compiled it is off
(``AVAILABLE``), and the lists fall through to ``mpi`` as before.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from mpx.collectives.base import Pending, Requests, Steps
from mpx.launch.settings import declare

__all__ = [
    "AVAILABLE",
    "CODES",
    "FLAG_BYTES",
    "MAX_RANKS",
    "FlagWindow",
    "allreduce",
    "takes",
    "use_compiled",
]

FLAG_BYTES = declare(
    "MPX_SHM_FLAG_BYTES",
    "size",
    4 << 20,
    "shm's flag-based small allreduce (sum/avg of float32/64, int32/64, one node) up to "
    "these bytes: the whole call in C, one wait; 0: off (MPI below MPX_AUTO_SMALL_BYTES)",
    package="collectives",
    unit="bytes",
    minimum=0,
)

# The dtypes the C kernel sums, with its codes (mpx_flags_reduce).
CODES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.float64: 1,
    torch.int32: 2,
    torch.int64: 3,
}
MAX_RANKS = 64  # mpx_flags_reduce's table of sources
_HEADER = 64  # MPX_FLAGS_HEADER: the flag's cache line
_SHIFT = 20  # MPX_FLAGS_SHIFT: a flag is its call's number << 20 | the pieces posted
_SMALLEST = 64 << 10  # the first buffers' bytes


AVAILABLE = False
"""Whether the C kernel is there: the compiled fast path hands it over (:func:`use_compiled`)."""


class _Kernel:
    """fast_path's wrappers of the C functions (it imports the policy, which imports this
    module: it calls :func:`use_compiled` when the package is imported)."""

    post: Any = None
    arrived: Any = None
    wait: Any = None
    reduce: Any = None


def use_compiled(post: Any, arrived: Any, wait: Any, reduce: Any) -> None:
    """Takes the compiled kernel: ``fast_path.flags_post`` .. ``flags_reduce``."""
    global AVAILABLE  # noqa: PLW0603 -- set once, when the package is imported
    _Kernel.post, _Kernel.arrived, _Kernel.wait, _Kernel.reduce = post, arrived, wait, reduce
    AVAILABLE = True


def takes(
    size: int, single_node: bool, dtype: Any, reduce_op: str, nbytes: int, limit: int
) -> bool:
    """Whether an allreduce of this signature runs here (the same answer on every rank).

    ``limit``: the policy's ``flag_bytes`` (``MPX_SHM_FLAG_BYTES``).
    """
    return (
        AVAILABLE
        and 1 < size <= MAX_RANKS
        and single_node
        and dtype in CODES
        and reduce_op in ("sum", "avg")
        and 0 < nbytes <= limit
    )


class FlagWindow:
    """One communicator's flags and buffers (``comm.cached("shm_flags")``); collective.

    ``bases``: every rank's part of the window, as addresses (int64, for C);
    ``buffer``: bytes per buffer.
    """

    def __init__(self, comm: Any, buffer: int) -> None:
        self.buffer = -(-buffer // _HEADER) * _HEADER  # keeps every rank's flag on its own line
        self.size = comm.size
        self.rank = comm.rank
        self.yielding = bool(comm.yielding)
        self.win = MPI.Win.Allocate_shared(_HEADER + 2 * self.buffer, _HEADER, comm=comm.mpi)
        self.bases = np.zeros(comm.size, dtype=np.int64)
        for r in range(comm.size):
            memory, _ = self.win.Shared_query(r)
            self.bases[r] = memory.address
        ctypes.c_int64.from_address(int(self.bases[self.rank])).value = 0
        self.address = int(self.bases.ctypes.data)
        comm.mpi.Barrier()  # every flag is 0 before any rank posts

    @classmethod
    def ready(cls, comm: Any, nbytes: int) -> Steps[FlagWindow]:
        """The communicator's window with buffers of at least ``nbytes``; the first call
        (and one larger than the buffers) makes it, as ``impl_shm.Workspace`` does: a
        non-blocking barrier first, which a timeout can interrupt, then the window.

        Buffers grow in powers of two from 64 KiB, as the calls need: a
        communicator that only reduces a few scalars holds 128 KiB, not 2 x the limit.
        Every rank makes the same calls, so every rank grows at the same call.
        """
        found = comm.cached("shm_flags")
        if isinstance(found, FlagWindow) and found.buffer >= nbytes:
            return found
        yield Requests([comm.mpi.Ibarrier()])
        if isinstance(found, FlagWindow):
            found.free()  # every rank is past its last call: the barrier
        window = cls(comm, max(_SMALLEST, 1 << (nbytes - 1).bit_length()))
        comm.cache("shm_flags", window)
        return window

    def flag(self, rank: int) -> int:
        """Rank ``rank``'s flag: its last call's number << 20 | the pieces it posted."""
        if not self.address:
            return 0  # freed: the memory is MPI's again
        return ctypes.c_int64.from_address(int(self.bases[rank])).value

    def posted(self, rank: int) -> int:
        """The number of the last call rank ``rank`` began to post (0: none)."""
        return self.flag(rank) >> _SHIFT

    def free(self) -> None:
        if self.address:
            self.address = 0
            self.win.Free()


class _Posted(Pending):
    """A step that waits until every rank's flag reads ``reached`` (all of a call posted)."""

    __slots__ = ("reached", "window")

    def __init__(self, window: FlagWindow, reached: int) -> None:
        self.window = window
        self.reached = reached

    @property
    def peers(self) -> list[int]:  # type: ignore[override]  # computed when a timeout asks
        w = self.window
        return [r for r in range(w.size) if w.flag(r) < self.reached]

    def test(self) -> bool:
        return bool(_Kernel.arrived(self.window.address, self.window.size, self.reached))

    def wait(self) -> None:
        w = self.window
        _Kernel.wait(w.address, w.size, self.reached, w.yielding)


def allreduce(comm: Any, t: torch.Tensor, op: str) -> Steps[torch.Tensor]:
    """The general path's steps of the protocol (the fast path runs it in one C call)."""
    window = yield from FlagWindow.ready(comm, t.nbytes)
    address = t.data_ptr()  # contiguous: check_tensor refuses others
    # every piece at once: `reached` is the call's last flag value
    reached = _Kernel.post(window.address, window.rank, window.buffer, address, t.nbytes)
    yield _Posted(window, reached)
    w = window
    _Kernel.reduce(w.address, w.size, w.buffer, reached, address, t.numel(), CODES[t.dtype])
    if op == "avg":
        t.div_(comm.size)
    return t
