"""The errors mpx-dataparallel raises; all derive from :class:`DataParallelError`."""

from __future__ import annotations

from mpx.collectives import MPXError

__all__ = ["DataParallelError", "ParameterServerError"]


class DataParallelError(MPXError):
    """Base class of the errors raised by ``mpx.dataparallel``.

    Bad arguments raise the builtin ``ValueError``/``TypeError`` instead; this
    one says the ranks' state disagrees or an operation was used out of order.

    Example::

        try: synchronize(model)
        except DataParallelError as error: print(error)   # names the rank that differs
    """


class ParameterServerError(DataParallelError):
    """The parameter server's progress thread failed, or was used after ``close()``.

    Example::

        ps.close()
        ps.pull(key)          # ParameterServerError: the parameter server is closed
    """
