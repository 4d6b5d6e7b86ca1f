"""The errors mpx-pipeline raises.

:class:`PipelineError` derives from :class:`mpx.collectives.MPXError`, so one
``except MPXError`` catches every mpx failure. A bad argument (a balance that
does not match the module, chunks that do not divide the batch, weights tied
across stages) raises :class:`PipelineValueError`, which is also a
``ValueError``; one of the wrong type (a module that is not an ``nn.Sequential``,
a layer that returns no tensor, an unsupported optimizer or dtype) raises
:class:`PipelineTypeError`, a ``TypeError``. Every one of these was a
``PipelineError`` that was a ``ValueError`` before, so :class:`PipelineTypeError`
derives from :class:`PipelineValueError` too and ``except ValueError`` keeps
catching it. Ranks that build one pipeline with different arguments raise
:class:`PipelineMismatchError` on every rank (a :class:`PipelineValueError` and a
:class:`mpx.collectives.MismatchError`). A bare :class:`PipelineError` is a failure while running (a
schedule that deadlocks, an internal inconsistency), not a bad argument.
:class:`PipelineRemoteError` (also a :class:`mpx.collectives.RemoteError`) is
raised on every stage when one stage failed (e.g. timing the layers for
``balance=None``), naming the failed ranks and their errors.
"""

from __future__ import annotations

from mpx.collectives import MismatchError, MPXError, RemoteError

__all__ = [
    "PipelineError",
    "PipelineMismatchError",
    "PipelineRemoteError",
    "PipelineTypeError",
    "PipelineValueError",
]


class PipelineError(MPXError):
    """A pipeline cannot be built or run as asked; the message names the bad value.

    Example::

        try: Pipeline(model, balance=[2, 3], chunks=4)
        except PipelineError as error: print(error)   # balance=[2, 3] sums to 5 ...
    """


class PipelineValueError(PipelineError, ValueError):
    """An argument has a bad value; the message names it and the fix.

    Example::

        with pytest.raises(ValueError, match="chunks=0"):
            Pipeline(model, chunks=0)
    """


class PipelineTypeError(PipelineValueError, TypeError):
    """An argument (or a layer's output) has the wrong type; also a ``ValueError``, as before.

    Example::

        with pytest.raises(TypeError, match=r"nn\\.Sequential"):
            Pipeline([nn.Linear(2, 2)], chunks=1)
    """


class PipelineMismatchError(PipelineValueError, MismatchError):
    """The ranks built the pipeline differently (raised on every rank, before anything moves).

    Also a :class:`mpx.collectives.MismatchError`. The message names the
    argument and each side's value.

    Example::

        Pipeline(model, balance=[3, 3] if rank == 0 else [2, 4], chunks=4)
        # every rank: PipelineMismatchError: Pipeline: ranks disagree on balance:
        #             rank 0 passed [3, 3], rank 1 [2, 4]; ...
    """


class PipelineRemoteError(PipelineError, RemoteError):
    """Raised on every stage when one stage failed (``failures`` names it and its error).

    Example::

        try: Pipeline(model, balance=None, sample=x)
        except PipelineError as err: print(err)  # "... could not time the layers on rank 0: ..."
    """
