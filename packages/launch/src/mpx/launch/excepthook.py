"""Under ``mpxrun``, a Python rank that dies of an uncaught exception exits at once.

Why: mpi4py finalizes MPI when the interpreter exits, and ``MPI_Finalize``
waits for the peers, which may sit in a collective waiting for this rank: the
job hangs with the traceback already printed. ``python -m mpi4py`` solves this
with ``MPI_Abort``; mpx does it for every Python rank started by ``mpxrun``
(the ``mpx_launch_hook.pth`` file installs this hook when ``MPX_JOB_ID`` is
set), by printing the traceback and leaving with ``os._exit(1)``. The rank's
supervisor then reports the failure and ``mpxrun`` stops the others.

Only an initialized, not yet finalized MPI triggers the fast exit; otherwise
the interpreter exits normally.
"""

from __future__ import annotations

import contextlib
import os
import sys
from types import TracebackType

__all__ = ["install"]


def _mpi_is_live() -> bool:
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return False
    try:
        return bool(mpi.Is_initialized()) and not bool(mpi.Is_finalized())
    except Exception:  # a half-imported or broken MPI: take the normal path
        return False


def install() -> None:
    """Chains a fast-exit step after the current ``sys.excepthook``."""
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        previous(exc_type, exc, tb)
        if _mpi_is_live():
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(1)

    sys.excepthook = hook
