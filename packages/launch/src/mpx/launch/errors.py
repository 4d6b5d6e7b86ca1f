"""The errors mpx-launch raises, and :class:`MPXError`, the root of every mpx error.

``MPXError`` is defined here because mpx-launch is the dependency-free bottom
of the stack: every package's base error derives from it (mpx.collectives
re-exports it), so ``except MPXError`` catches whatever any mpx package raises::

    MPXError
    ├── LaunchError                 mpx.launch
    │   ├── LaunchEnvironmentError
    │   ├── UsageError
    │   ├── LauncherNotFound
    │   └── SettingError            (also ValueError)
    ├── CollectivesError ...        mpx.collectives, and each upper package's own base

:class:`UsageError`, a bad argument (to ``mpxrun`` or to the API behind it),
is also a ``ValueError``, as the argument errors of the other mpx packages are.
:class:`LaunchEnvironmentError` is not: besides malformed variables it covers
a machine that lacks something (root, iproute2, mpi4py).
"""

from __future__ import annotations

__all__ = [
    "LaunchEnvironmentError",
    "LaunchError",
    "LauncherNotFound",
    "MPXError",
    "SettingError",
    "UsageError",
]


class MPXError(Exception):
    """Base class of every error raised by any mpx package."""


class LaunchError(MPXError):
    """Base class of every error raised by ``mpx.launch``."""


class LaunchEnvironmentError(LaunchError):
    """A launcher's variable is present but malformed or inconsistent."""


class UsageError(LaunchError, ValueError):
    """``mpxrun`` was called with a bad argument (a bad ``-n``, a missing program).

    Also a ``ValueError``, so ``except ValueError`` around the Python API catches it.

    Example::

        with pytest.raises(ValueError, match="'socket'"):
            Launcher("mpich", "mpiexec").command(2, ["prog"], bind="socket")
    """


class LauncherNotFound(LaunchError):
    """No MPI launcher (``mpiexec``, ``mpirun``, ``srun``) could be found."""


class SettingError(LaunchError, ValueError):
    """An ``MPX_*`` environment variable has a value that cannot be parsed or is out of range."""
