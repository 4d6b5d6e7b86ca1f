"""Under ``mpxrun``, a Python rank that dies of an uncaught exception exits at once.

Why: mpi4py finalizes MPI when the interpreter exits, and ``MPI_Finalize``
waits for the peers, which may sit in a collective waiting for this rank: the
job hangs with the traceback already printed. ``python -m mpi4py`` solves this
with ``MPI_Abort``; mpx does it for every Python rank started by ``mpxrun``
(the ``mpx_launch_hook.pth`` file installs this hook when ``MPX_JOB_ID`` is
set), by printing the traceback and leaving with ``os._exit(1)``. The rank's
supervisor then reports the failure and ``mpxrun`` stops the others.

``sys.exit(code)`` with a non-zero code (argparse's errors among them) is the
same story without a traceback: the hook records the code, and an ``atexit``
step (run before mpi4py finalizes MPI) leaves with ``os._exit(code)``. A bare
``raise SystemExit(code)`` is not seen; ``mpxrun --timeout`` still ends that.

Only an initialized, not yet finalized MPI triggers the fast exit; otherwise
the interpreter exits normally.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from types import TracebackType
from typing import Any, NoReturn

from mpx.launch import stacks

__all__ = ["install"]


def _mpi_is_live() -> bool:
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return False
    try:
        return bool(mpi.Is_initialized()) and not bool(mpi.Is_finalized())
    except Exception:  # a half-imported or broken MPI: take the normal path
        return False


def _leave(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _exit_code(arg: Any) -> int:
    if arg is None:
        return 0
    if isinstance(arg, int):
        return arg
    return 1  # sys.exit("message"): Python prints it and exits 1


def install() -> None:
    """Installs the rank's hooks: fast exit on failure, and its stack on SIGUSR1."""
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        previous(exc_type, exc, tb)
        if _mpi_is_live():
            _leave(1)

    sys.excepthook = hook
    exits: list[int] = []
    original_exit = sys.exit

    def recording_exit(arg: Any = None) -> NoReturn:
        exits.append(_exit_code(arg))
        if not isinstance(arg, (int, type(None))):
            with contextlib.suppress(Exception):
                print(arg, file=sys.stderr)
            original_exit(1)
        original_exit(arg)

    def at_exit() -> None:
        if exits and exits[-1] != 0 and _mpi_is_live():
            _leave(exits[-1])

    sys.exit = recording_exit
    # Registered before mpi4py is imported: Python runs atexit steps last in,
    # first out, and mpi4py finalizes MPI after all of them.
    atexit.register(at_exit)
    stacks.register()
