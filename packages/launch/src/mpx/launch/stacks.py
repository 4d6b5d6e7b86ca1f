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
piece (see :mod:`mpx.launch.status`), not interleaved with other ranks' output.

A program that does not handle SIGUSR1 (not Python, or one that never
registered) is never sent it: the signal's default action would kill it.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from typing import IO

from mpx.launch.settings import STACK_FILE

__all__ = ["DUMP_SIGNAL", "dump", "handles_dump_signal", "register"]

DUMP_SIGNAL = signal.SIGUSR1
# A dump of a few threads takes milliseconds; a rank under heavy load may be slow.
DUMP_WAIT_S = 2.0
_SETTLE_S = 0.1
MAX_LINES = 400

_dump_file: list[IO[str]] = []  # kept open for the life of the process


def register() -> bool:
    """In a rank's program: dump every thread's stack to ``MPX_STACK_FILE`` on SIGUSR1.

    Returns whether it did (``MPX_STACK_FILE`` is set and can be opened).
    """
    path = STACK_FILE.read()
    if not path:
        return False
    try:
        fh = open(path, "a")  # noqa: SIM115 (faulthandler writes to it until exit)
    except OSError:
        return False
    _dump_file.append(fh)
    faulthandler.register(DUMP_SIGNAL, file=fh, all_threads=True, chain=False)
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
