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

The traceback carries the rank, as torch's ``[rank1]: `` prefix does. torch's
``init_process_group`` wraps ``sys.excepthook`` in one that sends the previous
hook's output to a buffer and prints it prefixed when that hook returns; a
hook below it that leaves the process at once (this one, with MPI live under
the ``mpx`` backend) took the traceback with it. So this hook collects what
the hook before it prints and writes it itself: to the stream it was given
when nothing will come back to print it, else, when it leaves, straight to
the process's stderr, prefixed with ``[rank<N>]: ``.

Under ``mpxrun`` the program also tells its rank supervisor (``MPX_END_FILE``)
that it started (``A <pid>``) and that it reached its end (``E <pid> <code>``,
when the interpreter starts to shut down: after ``return`` from the program or
``sys.exit``, before ``MPI_Finalize`` and before any ``atexit`` step that
might wait for peers). A rank that exits 0 without the second line left in
the middle of its program (``os._exit(0)``, an ``exit`` from C); ``mpxrun``
tells the two apart (see :mod:`mpx.launch.cli`).

The hook is installed in every Python process of an ``mpxrun`` job
(``MPX_JOB_ID``) and of a plain ``mpiexec``/``mpirun`` job (``PMI_RANK``,
``OMPI_COMM_WORLD_RANK``): the prefixed traceback and the fast exit do not
depend on the launcher.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import io
import os
import sys
import threading
from types import TracebackType
from typing import Any, NoReturn

from mpx.launch.hook import stacks
from mpx.launch.settings import END_FILE

__all__ = ["install"]

_BuiltinSystemExit = builtins.SystemExit
# The C slot behind ``SystemExit.code``, which the subclass's property wraps.
_CODE_SLOT: Any = vars(_BuiltinSystemExit)["code"]
# The codes of the SystemExits the interpreter is exiting with (one at most).
_exiting_with: list[object] = []
# An uncaught exception reached sys.excepthook: the interpreter exits with 1.
_raised: list[bool] = []
# The descriptor of the supervisor's end channel, and the pid that opened it
# (a forked child inherits both, and must not speak for its parent).
_end_channel: list[tuple[int, int]] = []


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


def _rank_prefix() -> str:
    """``[rank<N>]: `` as torch writes it, or nothing when the rank cannot be read."""
    try:
        from mpx.launch.environment import environment

        return f"[rank{environment().rank}]: "
    except Exception:  # a malformed launcher variable must not hide the traceback
        return ""


def _prefixed(text: str, prefix: str) -> str:
    # Empty lines stay empty, and lines a hook already tagged are not tagged twice.
    return "\n".join(
        f"{prefix}{line}" if line and not line.startswith(prefix) else line
        for line in text.split("\n")
    )


def _say(message: str) -> None:
    """Writes one line to the supervisor's end channel, from the process that opened it."""
    for fd, pid in _end_channel:
        if pid == os.getpid():
            with contextlib.suppress(OSError):
                os.write(fd, f"{message}\n".encode())


def _open_end_channel() -> None:
    path = END_FILE.read()
    if not path:
        return
    try:
        # Not inherited: a program this one starts speaks for itself.
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return
    _end_channel.append((fd, os.getpid()))
    _say(f"A {os.getpid()}")


def _program_ended() -> None:
    if _raised:
        code = 1
    elif _exiting_with:
        code = _exit_code(_exiting_with[-1])
    else:
        code = 0
    _say(f"E {os.getpid()} {code}")


def install() -> None:
    """Installs the rank's hooks: fast exit on failure, its stack on SIGUSR1, its end."""
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        _raised.append(True)
        given = sys.stderr
        captured = io.StringIO()
        sys.stderr = captured
        try:
            previous(exc_type, exc, tb)
        finally:
            sys.stderr = given
        text = captured.getvalue()
        leaving = _mpi_is_live()
        target = given
        if leaving or given is sys.__stderr__:
            # Leaving now (a wrapping hook never gets to print what it collected),
            # or no hook wraps this one: the traceback is printed here, tagged.
            target = sys.__stderr__
            text = _prefixed(text, _rank_prefix())
        if target is not None:
            with contextlib.suppress(Exception):
                target.write(text)
                target.flush()
        if leaving:
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
    _open_end_channel()
    if _end_channel:
        # threading's exit steps run first when the interpreter shuts down,
        # before non-daemon threads are joined and before any atexit step (a
        # library's may wait for peers that will never come): the earliest
        # point at which the program has certainly ended.
        register = getattr(threading, "_register_atexit", atexit.register)
        register(_program_ended)
