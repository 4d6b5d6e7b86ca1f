"""``mpxrun --bind core|numa`` for launchers that cannot bind (MPICH's gforker).

The rank supervisor pins its program to the CPUs of one core (all its
hardware threads) or of one NUMA node, chosen round robin by local rank, as
Hydra's ``-bind-to core|numa`` does::

    usable CPUs 0-3, 2 threads per core:  cores {0,2} {1,3}
    local rank 0 -> {0,2}   local rank 1 -> {1,3}   local rank 2 -> {0,2} ...

Only CPUs this process may use count (its affinity mask: a batch system's
cgroup or ``taskset`` stays in force). Linux reports the topology in sysfs;
where it does not, every CPU is a core of its own and the machine one node.
"""

from __future__ import annotations

import glob
import os

from mpx.launch.errors import UsageError

__all__ = ["BIND_LEVELS", "cpus_for"]

BIND_LEVELS = ("core", "numa")
_SYS_CPU = "/sys/devices/system/cpu"
_SYS_NODE = "/sys/devices/system/node"


def _parse_cpu_list(text: str) -> set[int]:
    """CPUs in sysfs's list form, e.g. ``0-3,8,10-11``."""
    cpus: set[int] = set()
    for item in text.strip().split(","):
        if not item:
            continue
        first, _, last = item.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def _read_cpu_list(path: str) -> set[int] | None:
    try:
        with open(path) as fh:
            return _parse_cpu_list(fh.read())
    except (OSError, ValueError):
        return None


def _groups(level: str, usable: set[int]) -> list[set[int]]:
    """The cores or NUMA nodes with usable CPUs, each as its usable CPUs, in order."""
    groups: list[set[int]] = []
    if level == "core":
        for cpu in sorted(usable):
            if any(cpu in group for group in groups):
                continue
            siblings = _read_cpu_list(f"{_SYS_CPU}/cpu{cpu}/topology/thread_siblings_list")
            groups.append((siblings or {cpu}) & usable | {cpu})
    else:
        nodes = sorted(
            glob.glob(f"{_SYS_NODE}/node[0-9]*/cpulist"),
            key=lambda path: int(path.split("/node")[-1].split("/")[0]),
        )
        for path in nodes:
            cpus = (_read_cpu_list(path) or set()) & usable
            if cpus:
                groups.append(cpus)
    return groups or [set(usable)]


def cpus_for(level: str, local_rank: int, usable: set[int] | None = None) -> set[int]:
    """The CPUs local rank ``local_rank`` is bound to at ``level`` (``"core"`` or ``"numa"``).

    Args:
        level: ``"core"`` or ``"numa"``.
        local_rank: the rank among this host's ranks.
        usable: the CPUs to share out; this process's affinity mask by default.
    """
    if level not in BIND_LEVELS:
        raise UsageError(f"--bind level must be one of {', '.join(BIND_LEVELS)}, got {level!r}")
    if usable is None:
        usable = set(os.sched_getaffinity(0))
    groups = _groups(level, usable)
    return groups[local_rank % len(groups)]
