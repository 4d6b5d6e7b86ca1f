"""mpxrun's command line: what it accepts, and what it checks before it starts anything.

What lives here: ``cli_parser`` (:func:`build_parser`, every option of
``mpxrun --help``, and :func:`resolve_program`, the program to start),
``arguments`` (the checks of the values and of their combinations: counts,
seconds, the hostfile, ranks a core), ``virtual_cluster``
(:class:`VirtualCluster`, ``--virtual-nodes``: network namespaces on one
machine) and ``check`` (:func:`run_check`, ``mpxrun --check``: what is
installed, and the smoke tests). ``mpx.launch.cli`` puts these together with
the job's supervision and the replica groups.

What it may import: the job's supervision (``mpx.launch.supervision``, for
the usage exit code) and the rank supervisor (``mpx.launch.rank``, for the
cores this process may use), each through its ``__init__``; the launchers,
``errors`` and ``settings``. Not the replica groups (``mpx.launch.recovery``)
nor ``mpx.launch.cli``, which build on this one.
"""

from mpx.launch.command.arguments import (
    MAX_RANKS_PER_CORE,
    check_combinations,
    check_rank_count,
    check_restart_flags,
    job_cores,
    read_hostfile,
)
from mpx.launch.command.check import run_check
from mpx.launch.command.cli_parser import build_parser, resolve_program
from mpx.launch.command.virtual_cluster import MAX_NODES, VirtualCluster

__all__ = [
    "MAX_NODES",
    "MAX_RANKS_PER_CORE",
    "VirtualCluster",
    "build_parser",
    "check_combinations",
    "check_rank_count",
    "check_restart_flags",
    "job_cores",
    "read_hostfile",
    "resolve_program",
    "run_check",
]
