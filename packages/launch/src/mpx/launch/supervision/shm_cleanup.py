"""Shared-memory segments a job's MPI left behind when its ranks died.

MPICH keeps each node's shared memory in ``/dev/shm/mpich_shm_*`` files and
unlinks them in ``MPI_Finalize``; a rank that is killed, or that leaves with
``os._exit`` (mpx's fast exit on a failure), never gets there, and each such
job leaves a 2 MiB segment for good. ``mpxrun`` notes the segments that exist
before it starts a job and, when the job has ended, removes the new ones that
no running process has open or mapped: those are its job's (a job started
meanwhile by someone else still maps its own, so it keeps them).

Example::

    before = segments()
    ... run the job ...
    removed = remove_orphans(before)
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

__all__ = ["SHM_DIR", "remove_orphans", "segments"]

SHM_DIR = Path("/dev/shm")
_PREFIXES = ("mpich_shm_",)


def segments(directory: Path = SHM_DIR) -> set[str]:
    """Names of MPI shared-memory segments in ``directory`` now."""
    try:
        return {e.name for e in os.scandir(directory) if e.name.startswith(_PREFIXES)}
    except OSError:  # no /dev/shm (not Linux): nothing to clean
        return set()


def _in_use(paths: Iterable[str]) -> set[str]:
    """Those of ``paths`` that a running process has open or mapped."""
    wanted = set(paths)
    used: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as maps:
                used.update(line.split(None, 5)[-1].strip() for line in maps if "/dev/shm/" in line)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    used.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
                except OSError:
                    continue
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return used & wanted


def remove_orphans(before: set[str], directory: Path = SHM_DIR) -> list[str]:
    """Removes the segments created since ``before`` that no process uses; returns their names."""
    new = segments(directory) - before
    if not new:
        return []
    paths = {str(directory / name) for name in new}
    removed = []
    for path in sorted(paths - _in_use(paths)):
        try:
            os.unlink(path)
            removed.append(os.path.basename(path))
        except OSError:
            continue
    return removed
