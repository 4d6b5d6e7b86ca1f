"""The errors mpx-pipeline raises.

:class:`PipelineError` derives from both :class:`mpx.collectives.MPXError` (so one
``except MPXError`` catches every mpx failure) and :class:`ValueError` (almost all
of them are bad arguments: a balance that does not match the module, chunks that
do not divide the batch, weights tied across stages).
"""

from __future__ import annotations

from mpx.collectives import MPXError, RemoteError

__all__ = ["PipelineError", "PipelineRemoteError"]


class PipelineError(MPXError, ValueError):
    """A pipeline cannot be built or run as asked; the message names the bad value."""


class PipelineRemoteError(PipelineError, RemoteError):
    """Raised on every stage when one stage failed (``failures`` names it and its error).

    Example::

        try: Pipeline(model, balance=None, sample=x)
        except PipelineError as err: print(err)  # "... could not time the layers on rank 0: ..."
    """
