"""The errors mpx-launch raises; all derive from :class:`LaunchError`.

Why not :class:`mpx.collectives.MPXError`: mpx-launch is the bottom layer and
imports neither torch nor mpi4py nor any other mpx package, while ``MPXError``
lives in mpx-collectives, which needs both. So :class:`LaunchError` is a root of
its own and derives from ``Exception``. :class:`UsageError`, a bad argument
(to ``mpxrun`` or to the API behind it), is also a ``ValueError``, as the
argument errors of the other mpx packages are. :class:`LaunchEnvironmentError`
is not: besides malformed variables it covers a machine that lacks something
(root, iproute2, mpi4py).
"""

from __future__ import annotations

__all__ = ["LaunchEnvironmentError", "LaunchError", "LauncherNotFound", "UsageError"]


class LaunchError(Exception):
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
