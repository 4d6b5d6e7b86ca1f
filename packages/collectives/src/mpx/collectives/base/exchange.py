"""Messages of any length from every rank: what ``agree`` and ``allgather_object`` send.

Both are steps (see :mod:`mpx.collectives.base.handle`) that :meth:`Communicator.run`
drives, so they take their turn in the communicator's queue of collectives and
respect its timeout like any other operation::

    step 1   Iallgather   one int64 per rank: the length of its message
             (all zero: done -- the common case of agree, where every rank is ok)
    step 2   Iallgatherv  the messages' bytes, concatenated in rank order

This module does not import the communicator (which imports it): it works on
the communicator's MPI handle.
"""

from __future__ import annotations

import itertools

import numpy as np
from mpi4py import MPI

from mpx.collectives.base.handle import Requests, Steps

__all__ = ["gather_bytes", "summarize"]

_MAX_SUMMARY = 4000  # characters of one rank's exception message in an agreement


def gather_bytes(mpi: MPI.Intracomm, data: bytes) -> Steps[list[bytes]]:
    """Every rank's ``data``, in rank order (collective over ``mpi``)."""
    mine = np.array([len(data)], dtype=np.int64)
    sizes = np.empty(mpi.Get_size(), dtype=np.int64)
    yield Requests([mpi.Iallgather(mine, sizes)])
    counts = [int(n) for n in sizes]
    if not any(counts):
        return [b""] * len(counts)
    displacements = [0, *itertools.accumulate(counts[:-1])]
    out = bytearray(sum(counts))
    send = np.frombuffer(data, dtype=np.uint8) if data else np.empty(0, dtype=np.uint8)
    yield Requests([mpi.Iallgatherv(send, [out, (counts, displacements), MPI.BYTE])])
    view = memoryview(out)
    return [bytes(view[d : d + n]) for d, n in zip(displacements, counts, strict=True)]


def summarize(error: BaseException | str) -> str:
    """``"ValueError: message"`` (one rank's side of an agreement), at most 4000 characters."""
    if isinstance(error, str):
        text = error
    else:
        message = str(error)
        text = f"{type(error).__name__}: {message}" if message else type(error).__name__
    text = text or "(no message)"
    if len(text) > _MAX_SUMMARY:
        text = text[: _MAX_SUMMARY - 15] + " ... (shortened)"
    return text
