"""The errors mpx-dataparallel raises; all derive from :class:`DataParallelError`.

:class:`DataParallelError` derives from :class:`mpx.collectives.MPXError`. A bad
argument raises :class:`DataParallelValueError` or :class:`DataParallelTypeError`,
which are also the builtin ``ValueError`` / ``TypeError`` they replace, so
``except ValueError`` keeps working. A bare :class:`DataParallelError` says the
ranks' state disagrees or an operation was used out of order;
:class:`DataParallelRemoteError` (also a :class:`mpx.collectives.RemoteError`) is
raised on every rank when some ranks failed, naming them.
"""

from __future__ import annotations

from mpx.collectives import MismatchError, MPXError, RemoteError

__all__ = [
    "DataParallelError",
    "DataParallelMismatchError",
    "DataParallelRemoteError",
    "DataParallelTypeError",
    "DataParallelValueError",
    "ParameterServerError",
]


class DataParallelError(MPXError):
    """Base class of the errors raised by ``mpx.dataparallel``.

    Example::

        try: synchronize(model)
        except DataParallelError as error: print(error)   # names the rank that differs
    """


class DataParallelValueError(DataParallelError, ValueError):
    """An argument has a bad value; the message names it and the fix.

    Example::

        with pytest.raises(ValueError, match="bucket_mb must be positive"):
            DistributedOptimizer(opt, model, bucket_mb=0)
    """


class DataParallelTypeError(DataParallelError, TypeError):
    """An argument has the wrong type; the message names it and the fix.

    Example::

        with pytest.raises(TypeError, match="torch.optim.Optimizer"):
            DistributedOptimizer(model)
    """


class DataParallelMismatchError(DataParallelError, MismatchError):
    """Ranks hold different models: parameter values differ at the first step (or, under
    live recovery, a replica group's gradients differ in size, dtype or compression from
    another group's: the lighthouse refused it).

    Example::

        opt.step()   # DataParallelMismatchError: parameter 'fc.weight' has different values ...
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
        ps.pull(key)          # ParameterServerError: the parameter server is closed: close() ...
    """
