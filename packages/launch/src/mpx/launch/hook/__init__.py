"""What ``mpx_launch_hook.pth`` puts in every Python program that ``mpxrun`` starts.

What lives here: ``excepthook`` (:func:`install`: a failing rank leaves at
once instead of hanging in ``MPI_Finalize``, its traceback prefixed with its
rank, and the program's start and end told to its rank supervisor) and
``stacks`` (both ends of a rank's Python stack on request: :func:`register`
in the program, :func:`dump` in the rank supervisor, :func:`wait_point` in
``mpxrun``). The ``.pth`` file imports it by its public path,
``mpx.launch.excepthook``. It runs in the user's program: it stays small.

What it may import: ``environment``, ``settings`` and ``errors``; nothing else
of mpx-launch (the rank supervisor and ``mpxrun``'s side build on this one).
"""

from mpx.launch.hook import stacks
from mpx.launch.hook.excepthook import install
from mpx.launch.hook.stacks import (
    DUMP_SIGNAL,
    DUMP_WAIT_S,
    WaitPoint,
    dump,
    handles_dump_signal,
    register,
    wait_point,
)

__all__ = [
    "DUMP_SIGNAL",
    "DUMP_WAIT_S",
    "WaitPoint",
    "dump",
    "handles_dump_signal",
    "install",
    "register",
    "stacks",
    "wait_point",
]
