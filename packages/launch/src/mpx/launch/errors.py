"""The errors mpx-launch raises; all derive from :class:`LaunchError`."""

from __future__ import annotations

__all__ = ["LaunchEnvironmentError", "LaunchError", "LauncherNotFound", "UsageError"]


class LaunchError(Exception):
    """Base class of every error raised by ``mpx.launch``."""


class LaunchEnvironmentError(LaunchError):
    """A launcher's variable is present but malformed or inconsistent."""


class UsageError(LaunchError):
    """``mpxrun`` was called with a bad argument (a bad ``-n``, a missing program)."""


class LauncherNotFound(LaunchError):
    """No MPI launcher (``mpiexec``, ``mpirun``, ``srun``) could be found."""
