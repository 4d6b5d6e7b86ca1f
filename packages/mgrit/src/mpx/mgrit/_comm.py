"""The ``comm=`` argument of mpx-mgrit: an mpx Communicator, or a raw mpi4py one.

torchbraid's users pass ``MPI.COMM_WORLD``; mpx-collectives wraps such a
communicator once (collective the first time) and reuses the wrapper.
"""

from __future__ import annotations

from typing import TypeAlias

from mpi4py import MPI

from mpx.collectives import Communicator, MPXTypeError
from mpx.collectives import as_communicator as wrap
from mpx.mgrit.errors import MGRITTypeError

__all__ = ["CommLike", "as_communicator"]

#: What a ``comm=`` argument may be (None: all ranks).
CommLike: TypeAlias = "Communicator | MPI.Intracomm | None"


def as_communicator(comm: CommLike) -> Communicator:
    """``comm`` as an mpx Communicator: all ranks for None, a raw mpi4py one wrapped once.

    mpx-collectives' :func:`~mpx.collectives.as_communicator`, raising this
    package's error type for anything else.
    """
    try:
        return wrap(comm)
    except MPXTypeError as error:
        raise MGRITTypeError(str(error)) from None
