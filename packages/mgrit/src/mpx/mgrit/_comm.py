"""The ``comm=`` argument of mpx-mgrit: an mpx Communicator, or a raw mpi4py one.

torchbraid's users pass ``MPI.COMM_WORLD``; mpx-mgrit wraps such a communicator
once, where it is given (``Communicator.from_mpi`` duplicates it: collective).
"""

from __future__ import annotations

from typing import TypeAlias

from mpi4py import MPI

from mpx.collectives import Communicator, world
from mpx.mgrit.errors import MGRITTypeError

__all__ = ["CommLike", "as_communicator"]

#: What a ``comm=`` argument may be (None: all ranks).
CommLike: TypeAlias = "Communicator | MPI.Intracomm | None"


def as_communicator(comm: CommLike) -> Communicator:
    """``comm`` as an mpx Communicator: all ranks for None, a raw mpi4py one wrapped."""
    if comm is None:
        return world()
    if isinstance(comm, Communicator):
        return comm
    if isinstance(comm, MPI.Intracomm):
        return Communicator.from_mpi(comm)
    raise MGRITTypeError(
        f"comm must be an mpx.collectives.Communicator, an mpi4py intracommunicator "
        f"(e.g. MPI.COMM_WORLD) or None, got {type(comm).__name__}"
    )
