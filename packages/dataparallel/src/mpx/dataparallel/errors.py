"""The errors mpx-dataparallel raises; all derive from :class:`DataParallelError`."""

from __future__ import annotations

from mpx.collectives import MPXError

__all__ = ["DataParallelError", "ParameterServerError"]


class DataParallelError(MPXError):
    """Base class of the errors raised by ``mpx.dataparallel``.

    Bad arguments raise the builtin ``ValueError``/``TypeError`` instead; this
    one says the ranks' state disagrees or an operation was used out of order.
    """


class ParameterServerError(DataParallelError):
    """The parameter server's progress thread failed, or was used after ``close()``."""
