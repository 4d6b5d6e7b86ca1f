"""Under ``mpxrun``, a failing Python rank (uncaught exception, non-zero exit) leaves at once.

Why: mpi4py finalizes MPI when the interpreter exits, and ``MPI_Finalize``
waits for the peers, which may sit in a collective waiting for this rank: the
job hangs with the traceback already printed. ``python -m mpi4py`` solves this
with ``MPI_Abort``; mpx does it for every Python rank started by ``mpxrun``
(the ``mpx_launch_hook.pth`` file installs this hook when ``MPX_JOB_ID`` is
set), by printing the traceback and leaving with ``os._exit(1)``. The rank's
supervisor then reports the failure and ``mpxrun`` stops the others.

A non-zero exit (``sys.exit(3)``, ``raise SystemExit(3)``, the builtin
``exit(3)``, argparse's errors) is the same story without a traceback; but
which code the interpreter exits with is known only once the ``SystemExit``
has left the program: one that is caught does not end it. Python reads the
exception's ``code`` exactly once at that point, from C, with no Python frame
left on the stack. So ``builtins.SystemExit`` (and the class ``sys.exit``
raises) becomes a subclass whose ``code`` notes when it is read that way; an
``atexit`` step (run before mpi4py finalizes MPI) then leaves with
``os._exit(code)`` if that code is non-zero. The subclass is named
``SystemExit`` and is caught by every ``except SystemExit``.

Only an initialized, not yet finalized MPI triggers the fast exit; otherwise
the interpreter exits normally.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import os
import sys
import threading
from types import TracebackType
from typing import Any, NoReturn

from mpx.launch import stacks

__all__ = ["install"]

_BuiltinSystemExit = builtins.SystemExit
# The C slot behind ``SystemExit.code``, which the subclass's property wraps.
_CODE_SLOT: Any = vars(_BuiltinSystemExit)["code"]
# The codes of the SystemExits the interpreter is exiting with (one at most).
_exiting_with: list[object] = []


class _NotedSystemExit(_BuiltinSystemExit):
    """``SystemExit`` whose ``code`` notes the read by the interpreter's exit path."""

    @property  # type: ignore[override]
    def code(self) -> object:
        value = _CODE_SLOT.__get__(self)
        # No Python caller: the interpreter itself is handling the exit.
        if sys._getframe(0).f_back is None:
            _exiting_with.append(value)
        return value

    @code.setter
    def code(self, value: object) -> None:
        _CODE_SLOT.__set__(self, value)


# Tracebacks and reprs show the class as Python's own.
_NotedSystemExit.__name__ = _NotedSystemExit.__qualname__ = "SystemExit"
_NotedSystemExit.__module__ = "builtins"


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


def _exit_code(arg: object) -> int:
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
    previous_thread_hook = threading.excepthook

    def thread_hook(args: Any) -> None:
        # threading ignores a thread's SystemExit by identity of the class.
        if args.exc_type is not _NotedSystemExit:
            previous_thread_hook(args)

    threading.excepthook = thread_hook
    original_exit = sys.exit

    def noted_exit(arg: Any = None) -> NoReturn:
        try:
            original_exit(arg)
        except _BuiltinSystemExit as exc:
            # The same arguments, the class whose exit code can be seen.
            raise _NotedSystemExit(*exc.args) from None
        raise AssertionError("sys.exit returned")  # pragma: no cover

    def at_exit() -> None:
        if _exiting_with and _mpi_is_live():
            code = _exit_code(_exiting_with[-1])
            if code != 0:
                _leave(code)

    builtins.SystemExit = _NotedSystemExit  # type: ignore[misc]
    sys.exit = noted_exit
    # Registered before mpi4py is imported: Python runs atexit steps last in,
    # first out, and mpi4py finalizes MPI after all of them.
    atexit.register(at_exit)
    stacks.register()
