"""The errors mpx-dataparallel raises; all derive from :class:`DataParallelError`."""

from __future__ import annotations

from mpx.collectives import MPXError, RemoteError

__all__ = ["DataParallelError", "DataParallelRemoteError", "ParameterServerError"]


class DataParallelError(MPXError):
    """Base class of the errors raised by ``mpx.dataparallel``.

    Bad arguments raise the builtin ``ValueError``/``TypeError`` instead; this
    one says the ranks' state disagrees or an operation was used out of order.

    Example::

        try: synchronize(model)
        except DataParallelError as error: print(error)   # names the rank that differs
    """


class DataParallelRemoteError(DataParallelError, RemoteError):
    """Raised on every rank when some ranks failed (``failures`` names them and their errors).

    Example::

        try: load_checkpoint("ckpt.pt", model)
        except DataParallelError as err: print(err)  # "... could not load ckpt.pt on rank 0: ..."
    """


class ParameterServerError(DataParallelError):
    """The parameter server's progress thread failed, or was used after ``close()``.

    Example::

        ps.close()
        ps.pull(key)          # ParameterServerError: the parameter server is closed
    """
