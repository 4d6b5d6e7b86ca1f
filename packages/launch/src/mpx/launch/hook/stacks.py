"""A rank's Python stack on request: what ``mpxrun --timeout`` shows of a hung job.

Both ends live here::

    rank supervisor                           the rank's program (Python)
    ---------------                           ---------------------------
    MPX_STACK_FILE=<a file of its own>  ───>  register(): faulthandler writes every
                                              thread's stack to that file on SIGUSR1
    dump(pid, file): SIGUSR1, then read  <───

``faulthandler`` writes from its C signal handler, so the stack comes out
even while the program is blocked inside an MPI call. The dump goes to a file
rather than to stderr so that the supervisor can hand it to ``mpxrun`` in one
piece (see :mod:`mpx.launch.rank.status`), not interleaved with other ranks' output.

A program that does not handle SIGUSR1 (not Python, or one that never
registered) is never sent it: the signal's default action would kill it.
"""

from __future__ import annotations

import faulthandler
import linecache
import os
import re
import signal
import sysconfig
import time
from dataclasses import dataclass

from mpx.launch.settings import STACK_FILE

__all__ = ["DUMP_SIGNAL", "WaitPoint", "dump", "handles_dump_signal", "register", "wait_point"]

DUMP_SIGNAL = signal.SIGUSR1
# A dump of a few threads takes milliseconds; a rank under heavy load may be slow.
DUMP_WAIT_S = 2.0
_SETTLE_S = 0.1
MAX_LINES = 400

_dump_fds: list[int] = []  # kept open for the life of the process
_stdlib: list[str] = []  # the standard library's directory, once looked up


def register() -> bool:
    """In a rank's program: dump every thread's stack to ``MPX_STACK_FILE`` on SIGUSR1.

    Returns whether it did (``MPX_STACK_FILE`` is set and can be opened).
    """
    path = STACK_FILE.read()
    if not path:
        return False
    try:
        # A bare descriptor, kept open until the process ends (faulthandler writes to
        # it whenever the signal comes, in MPI_Finalize too): a Python file object
        # left open so long was a "ResourceWarning: unclosed file" at every exit.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
    except OSError:
        return False
    _dump_fds.append(fd)
    faulthandler.register(DUMP_SIGNAL, file=fd, all_threads=True, chain=False)
    return True


def handles_dump_signal(pid: int) -> bool:
    """Whether process ``pid`` catches SIGUSR1 (Linux: its ``SigCgt`` mask)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (DUMP_SIGNAL - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def dump(pid: int, path: str, wait: float = DUMP_WAIT_S) -> list[str]:
    """Asks process ``pid`` for its stack; returns the lines it wrote to ``path``.

    Returns a one-line explanation instead when ``pid`` does not handle the
    signal or wrote nothing within ``wait`` seconds.
    """
    if not handles_dump_signal(pid):
        return ["(no Python stack: the program does not handle SIGUSR1)"]
    with open(path, "w"):
        pass  # forget an earlier dump
    try:
        os.kill(pid, DUMP_SIGNAL)
    except ProcessLookupError:
        return ["(no Python stack: the program has exited)"]
    deadline = time.monotonic() + wait
    size, settled_at = 0, time.monotonic()
    while time.monotonic() < deadline:
        now_size = os.path.getsize(path)
        if now_size != size:
            size, settled_at = now_size, time.monotonic()
        elif size > 0 and time.monotonic() - settled_at >= _SETTLE_S:
            break
        time.sleep(0.02)
    with open(path, errors="replace") as fh:
        lines = fh.read().splitlines()
    if not lines:
        return [f"(no Python stack: the program wrote none within {wait:g} s)"]
    if len(lines) > MAX_LINES:
        lines = [*lines[:MAX_LINES], f"... ({len(lines) - MAX_LINES} more lines)"]
    return lines


# Frames of these libraries wait for peers when a rank is blocked in a collective.
_COMMUNICATION_PATHS = re.compile(
    r"/torch/distributed/|/mpi4py/|/mpx/(collectives|dataparallel|pipeline|quantize)/"
)
# Frames that are not the user's own code: a wait inside them is the library's.
_LIBRARY_PATHS = re.compile(
    r"/(site|dist)-packages/|/mpx/(collectives|dataparallel|pipeline|quantize|mgrit|launch)/"
    r"|^<frozen "
)
# Methods that wait for peers when called straight from the program (mpi4py's
# and torch's are C functions: no frame of theirs shows in the stack).
_COMMUNICATION_CALLS = frozenset(
    """barrier ibarrier allreduce iallreduce all_reduce reduce ireduce reduce_scatter
    reducescatter reduce_scatter_tensor bcast ibcast broadcast broadcast_object_list gather
    igather gather_object allgather iallgather all_gather all_gather_object
    all_gather_into_tensor scatter iscatter scatter_object_list alltoall ialltoall all_to_all
    all_to_all_single send recv isend irecv sendrecv ssend wait waitall waitany probe mprobe
    synchronize monitored_barrier allreduce_coalesced""".split()  # noqa: SIM905 (a word list)
)
_FRAME = re.compile(r'^\s*File "(.*)", line (\d+) in (.*)$')
_CALLED = re.compile(r"\.\s*(\w+)\s*\(")


@dataclass(frozen=True)
class WaitPoint:
    """Where a rank's main thread stands, read from its stack dump.

    Attributes:
        where: the frames from the outermost to the innermost frame of the
            program's own code (file, line, function): while it is the same,
            the program has not moved on.
        communicating: the program waits in a communication call there (a
            frame of torch.distributed, mpi4py or mpx above it, or a call such
            as ``comm.Barrier()`` or ``work.wait()`` on that line).
    """

    where: tuple[tuple[str, int, str], ...]
    communicating: bool


def _is_library(path: str) -> bool:
    if not _stdlib:
        _stdlib.append(sysconfig.get_paths()["stdlib"] + os.sep)
    return bool(_LIBRARY_PATHS.search(path)) or path.startswith(_stdlib[0])


def wait_point(lines: list[str]) -> WaitPoint | None:
    """The main thread's :class:`WaitPoint` in a ``faulthandler`` dump; None without one."""
    threads: list[tuple[bool, list[tuple[str, int, str]]]] = []
    for line in lines:
        if line.startswith(("Current thread", "Thread")):
            threads.append((line.startswith("Current"), []))
            continue
        match = _FRAME.match(line)
        if match and threads:
            threads[-1][1].append((match.group(1), int(match.group(2)), match.group(3)))
    # The main thread runs the program: its outermost frame is a module's.
    ranked = sorted(
        (frames for _, frames in threads if frames),
        key=lambda frames: frames[-1][2] != "<module>",
    )
    if not ranked:
        return None
    frames = ranked[0]
    inner_user = next(
        (i for i, (path, _, _) in enumerate(frames) if not _is_library(path)), len(frames) - 1
    )
    above = frames[:inner_user]
    communicating = any(_COMMUNICATION_PATHS.search(path) for path, _, _ in above)
    if not above:
        path, number, _ = frames[inner_user]
        called = _CALLED.findall(linecache.getline(path, number))
        communicating = any(name.lower() in _COMMUNICATION_CALLS for name in called)
    return WaitPoint(tuple(reversed(frames[inner_user:])), communicating)
