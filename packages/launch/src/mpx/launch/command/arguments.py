"""``mpxrun``'s arguments: each flag's parser, the checks across flags, and the rank-count check.

Every error names the flag it is about, the value given and what would be
accepted, and comes before anything is started (no launcher, no rank, no
network namespace). A flag's own value is checked by its ``type=`` function
while ``argparse`` parses it (``argparse`` then exits 2); the checks that need
several flags, the hostfile or the launcher raise :class:`UsageError`, which
``mpxrun`` reports the same way, exit code 2.

The rank-count check refuses more than :data:`MAX_RANKS_PER_CORE` ranks a
core, counted as :func:`job_cores` counts the cores of the job's hosts, unless
``--oversubscribe``: ``mpxrun -n 100000`` by mistake would otherwise fork
until the machine gives out. 3 ranks on 2 cores, as the tests run, pass.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from mpx.launch.errors import UsageError
from mpx.launch.rank import usable_cores

__all__ = [
    "MAX_RANKS_PER_CORE",
    "MAX_SECONDS",
    "Cores",
    "check_combinations",
    "check_rank_count",
    "check_restart_flags",
    "job_cores",
    "read_hostfile",
    "seconds",
    "whole_number",
]

# Ranks a core beyond which mpxrun asks for --oversubscribe. Oversubscribed
# ranks yield their core (launchers.py), so a few a core only slow a job down;
# tens of them a core is a typo (-n 100000) or a hostfile that lost its slots.
MAX_RANKS_PER_CORE = 8
# The longest --timeout or --restart-delay: time.sleep() and the launcher's
# clock overflow somewhere past 9e9 s (time.sleep(inf) raises OverflowError
# after the first failed attempt); 1e9 s is 31 years.
_MAX_SECONDS_TEXT = "1e9"
MAX_SECONDS = float(_MAX_SECONDS_TEXT)


def whole_number(flag: str, minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """The ``type=`` of an integer flag: ``minimum <= value <= maximum``, named in its errors.

    Example::

        parser.add_argument("--virtual-nodes", type=whole_number("--virtual-nodes", 1, 200))
    """
    if maximum is not None:
        wanted = f"a whole number from {minimum} to {maximum}"
    elif minimum == 1:
        wanted = "a positive integer"
    else:
        wanted = f"a whole number >= {minimum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"{flag} must be {wanted}, got {text!r}")
        return value

    parse.__name__ = flag  # argparse's name for it, should an error ever get past
    return parse


def seconds(flag: str, *, zero: bool) -> Callable[[str], float]:
    """The ``type=`` of a duration flag: a finite number of seconds, > 0 (or >= 0 with ``zero``).

    Example::

        parser.add_argument("--timeout", type=seconds("--timeout", zero=False))
    """
    wanted = "a number of seconds >= 0" if zero else "a positive number of seconds"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (value >= 0 if zero else value > 0) or value > MAX_SECONDS:
            # NaN fails both comparisons; inf is caught by the upper bound.
            raise argparse.ArgumentTypeError(
                f"{flag} must be {wanted} (at most {_MAX_SECONDS_TEXT}), got {text!r}"
            )
        return value

    parse.__name__ = flag
    return parse


def check_combinations(
    nprocs: int, virtual_nodes: int | None, hostfile: str | None, groups: int = 1
) -> None:
    """Refuses flags that each parse but contradict each other.

    ``groups``: ``--replica-groups`` (the job's ranks are ``groups * nprocs``).

    Raises:
        UsageError: ``--virtual-nodes`` with ``--hostfile``, or more virtual
            nodes than ranks (a node without a rank tests nothing and hides a
            mistyped ``-n``).
    """
    if virtual_nodes is None:
        return
    if hostfile is not None:
        raise UsageError("--virtual-nodes and --hostfile exclude each other: pick one")
    total = nprocs * groups
    if virtual_nodes > total:
        what = f"-n {nprocs}" if groups == 1 else f"--replica-groups {groups} x -n {nprocs}"
        raise UsageError(
            f"--virtual-nodes {virtual_nodes} is more nodes than the {total} rank(s) of "
            f"{what}: every node needs a rank; pass --virtual-nodes {total} or fewer, "
            + (f"or -n {virtual_nodes} or more" if groups == 1 else "or more ranks")
        )


def check_restart_flags(max_restarts: int, restart_delay: float) -> None:
    """Refuses ``--restart-delay`` without restarts: it would be ignored without a word.

    Raises:
        UsageError: a delay given with ``--max-restarts 0`` (the default).
    """
    if restart_delay and not max_restarts:
        raise UsageError(
            f"--restart-delay {restart_delay:g} waits before a restart, but --max-restarts is 0: "
            "no restart will happen; add --max-restarts N (N >= 1) or drop --restart-delay"
        )


def read_hostfile(path: str) -> list[tuple[str, int | None]]:
    """The hosts of a hostfile and their slots (None where a line gives none).

    Reads MPICH's ``host`` and ``host:slots`` and Open MPI's ``host slots=N``
    lines; ``#`` starts a comment.

    Raises:
        UsageError: the file cannot be read or names no host.
    """
    try:
        with open(path) as fh:
            lines = [ln.split("#")[0].split() for ln in fh]
    except OSError as exc:
        raise UsageError(f"cannot read --hostfile {path!r}: {exc.strerror}") from None
    hosts: list[tuple[str, int | None]] = []
    for words in filter(None, lines):
        host, _, slots = words[0].partition(":")
        for word in words[1:]:
            if word.startswith("slots="):
                slots = word.removeprefix("slots=")
        hosts.append((host, int(slots) if slots.isdigit() else None))
    if not hosts:
        raise UsageError(f"--hostfile {path!r} names no hosts")
    return hosts


@dataclass(frozen=True)
class Cores:
    """The cores a job's hosts offer, as far as ``mpxrun`` can tell.

    Attributes:
        count: the number of cores (or slots); None where it cannot be known.
        source: where ``count`` comes from (for the error message), or why it
            is unknown (then the rank count is not checked).
    """

    count: int | None
    source: str


# SLURM_JOB_CPUS_PER_NODE: "72(x2),36" is two nodes of 72 CPUs and one of 36.
_SLURM_CPUS = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def job_cores(
    launcher_kind: str,
    hostfile: str | None,
    virtual_nodes: int | None,
    env: Mapping[str, str],
) -> Cores:
    """Counts the cores the job's ranks will share.

    On this host (no hostfile, not Slurm, or virtual nodes, which are all on
    this host): the cores this process may run on (``os.sched_getaffinity``),
    which the ranks inherit. With a hostfile: the sum of its slots, when every
    line gives them. Under Slurm: the allocation's CPUs
    (``SLURM_JOB_CPUS_PER_NODE``).
    """
    if virtual_nodes is not None or (hostfile is None and launcher_kind != "slurm"):
        count = usable_cores()
        return Cores(count, f"the {count} core(s) this process may use (os.sched_getaffinity)")
    if hostfile is not None:
        hosts = read_hostfile(hostfile)
        unknown = [host for host, slots in hosts if slots is None]
        if unknown:
            return Cores(
                None,
                f"--hostfile {hostfile!r} gives no slots for {unknown[0]} (host:N or host slots=N)",
            )
        total = sum(slots or 0 for _, slots in hosts)
        return Cores(total, f"the {total} slot(s) of --hostfile {hostfile!r}")
    cpus = env.get("SLURM_JOB_CPUS_PER_NODE", "")
    if not cpus or not all(_SLURM_CPUS.fullmatch(part) for part in cpus.split(",")):
        return Cores(None, "srun outside an allocation (no SLURM_JOB_CPUS_PER_NODE)")
    total = 0
    for part in cpus.split(","):
        match = _SLURM_CPUS.fullmatch(part)
        assert match is not None  # checked above
        total += int(match[1]) * int(match[2] or 1)
    return Cores(total, f"the {total} CPU(s) of the Slurm allocation (SLURM_JOB_CPUS_PER_NODE)")


def check_rank_count(nprocs: int, cores: Cores, *, oversubscribe: bool, groups: int = 1) -> None:
    """Refuses more than :data:`MAX_RANKS_PER_CORE` ranks a core unless ``--oversubscribe``.

    ``groups``: ``--replica-groups`` (each group starts ``nprocs`` ranks on the same
    cores: the job's ranks are ``groups * nprocs``). Where the cores are unknown
    (``cores.count`` is None) nothing is refused.

    Raises:
        UsageError: naming ``-n`` (and ``--replica-groups``), the cores counted and the
            two ways out.
    """
    if oversubscribe or cores.count is None:
        return
    limit = MAX_RANKS_PER_CORE * max(cores.count, 1)
    total = nprocs * groups
    if total > limit:
        what = f"-n {nprocs}" if groups == 1 else f"--replica-groups {groups} x -n {nprocs}"
        smaller = "-n" if groups == 1 else "-n or --replica-groups"
        raise UsageError(
            f"{what} is {total / max(cores.count, 1):g} ranks a core on {cores.source}; "
            f"mpxrun starts at most {MAX_RANKS_PER_CORE} a core ({limit} here): pass a smaller "
            f"{smaller}, or --oversubscribe to start them anyway"
        )
