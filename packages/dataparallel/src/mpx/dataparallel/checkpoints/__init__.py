"""Checkpoints every rank agrees on, and resuming a loop from them after a restart.

What lives here: :func:`save_checkpoint` / :func:`load_checkpoint`
(``checkpoint``: root writes atomically with a checksum, every rank loads
root's bits) and, on top of them, :func:`save_resumable` / :func:`resume` /
:func:`latest_checkpoint` (``resumable``: a loop restarted by ``mpxrun
--max-restarts`` continues mid-epoch, bit for bit). Restarting from a file is
this role; surviving a death without a restart is ``recovery``'s.

What it may import: ``mpx.dataparallel.errors``, ``mpx.dataparallel.runtime``
and ``mpx.dataparallel.synchronous`` (root's state broadcast, the data
container's epoch), and mpx-collectives. Not ``asynchronous`` or ``recovery``:
the roles beside it.
"""

from mpx.dataparallel.checkpoints.checkpoint import load_checkpoint, save_checkpoint
from mpx.dataparallel.checkpoints.resumable import (
    ResumePoint,
    latest_checkpoint,
    resume,
    save_resumable,
)

__all__ = [
    "ResumePoint",
    "latest_checkpoint",
    "load_checkpoint",
    "resume",
    "save_checkpoint",
    "save_resumable",
]
