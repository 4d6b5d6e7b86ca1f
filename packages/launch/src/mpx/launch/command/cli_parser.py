"""``mpxrun``'s command line: its options, and the program it starts.

:func:`build_parser` is the parser of every option (``mpxrun --help``); the
values are checked as they are parsed (:mod:`mpx.launch.command.arguments`) and a bad
one exits with :data:`EXIT_USAGE` and one line saying what to fix.
:func:`resolve_program` finds the program to start. :mod:`mpx.launch.cli`
(``main``) puts them together with the job (:mod:`mpx.launch.supervision.job`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Sequence
from typing import NoReturn

from mpx.launch.command import arguments
from mpx.launch.command.virtual_cluster import MAX_NODES
from mpx.launch.errors import UsageError
from mpx.launch.launchers import BIND_CHOICES, LAUNCHER_KINDS
from mpx.launch.supervision import EXIT_USAGE

__all__ = ["EXIT_USAGE", "build_parser", "resolve_program"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, exit 2: what to fix, not a usage dump.
        self.exit(EXIT_USAGE, f"mpxrun: {message} (see mpxrun --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``mpxrun``."""
    parser = _Parser(
        prog="mpxrun",
        description="Start N ranks of a program through the installed MPI launcher; "
        "if one fails, stop them all and say which.",
    )
    parser.add_argument(
        "-n",
        "-np",
        "--nprocs",
        type=arguments.whole_number("-n", 1),
        default=1,
        dest="nprocs",
        metavar="N",
        help=f"number of ranks (default 1; more than {arguments.MAX_RANKS_PER_CORE} a core "
        "needs --oversubscribe)",
    )
    parser.add_argument(
        "--hostfile",
        metavar="F",
        help="file of hosts, one per line ('host', 'host:slots' or 'host slots=N')",
    )
    parser.add_argument(
        "--bind",
        choices=BIND_CHOICES,
        default="none",
        help="bind each rank to a core or a NUMA domain (default none)",
    )
    parser.add_argument(
        "--gpus",
        choices=("auto", "none"),
        default="auto",
        help="auto: one GPU per local rank, round robin; none: hide GPUs",
    )
    parser.add_argument(
        "--timeout",
        type=arguments.seconds("--timeout", zero=False),
        default=None,
        metavar="S",
        help="stop the job after this many seconds (exit 124); with --max-restarts, each attempt",
    )
    parser.add_argument(
        "--max-restarts",
        type=arguments.whole_number("--max-restarts", 0),
        default=0,
        metavar="N",
        help="when a rank fails or the job hangs past --timeout, stop the job and start it "
        "again, up to N times (ranks read the attempt in MPX_RESTART_COUNT; default 0)",
    )
    parser.add_argument(
        "--restart-delay",
        type=arguments.seconds("--restart-delay", zero=True),
        default=0.0,
        metavar="S",
        help="seconds to wait before each restart (default 0)",
    )
    parser.add_argument(
        "--replica-groups",
        type=arguments.whole_number("--replica-groups", 1),
        default=None,
        metavar="R",
        help="start R replica groups of -n ranks each, each its own MPI world that fails and "
        "restarts alone (--max-restarts per group), and a lighthouse that keeps their "
        "membership (mpx.dataparallel.FaultTolerantOptimizer; see docs/live-recovery.md); "
        "with --hostfile, --virtual-nodes or in a Slurm allocation each group gets nodes of "
        "its own",
    )
    parser.add_argument(
        "--tag-output", action="store_true", help="prefix output lines with the rank"
    )
    parser.add_argument(
        "--launcher",
        default="auto",
        metavar="KIND",
        help=f"auto, {', '.join(LAUNCHER_KINDS)}, or a path to mpiexec/mpirun",
    )
    parser.add_argument(
        "--virtual-nodes",
        type=arguments.whole_number("--virtual-nodes", 1, MAX_NODES),
        default=None,
        metavar="K",
        help="spread the ranks over K network namespaces of this machine, each a node to MPI "
        "(root, MPICH; for testing multi-node code; K <= -n)",
    )
    parser.add_argument(
        "--oversubscribe",
        action="store_true",
        help=f"start more than {arguments.MAX_RANKS_PER_CORE} ranks a core (refused without "
        "it, where mpxrun can count the hosts' cores); also lets Open MPI place more ranks "
        "than a hostfile's slots and makes MPICH's ranks yield their cores",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="report MPI, mpx packages, kernels and GPUs, run a 2-rank smoke test, and exit",
    )
    parser.add_argument(
        "--settings",
        action="store_true",
        help="print the table of MPX_* variables of the installed packages, check the values "
        "set in this environment, and exit (non-zero if one is malformed)",
    )
    parser.add_argument(
        "--tune",
        action="store_true",
        help="time every collective implementation on -n ranks of this machine and write the "
        "policy that impl='auto' reads (python -m mpx.collectives.tune; its options follow --)",
    )
    parser.add_argument("program", nargs=argparse.REMAINDER, help="the program and its arguments")
    return parser


def resolve_program(program: Sequence[str]) -> list[str]:
    """The command that starts ``program`` (after ``--``): a script through this Python,
    a path as is, a name from PATH.

    Raises:
        UsageError: no program, or one that is not found or not executable.
    """
    args = list(program)
    if args and args[0] == "--":
        args = args[1:]
    if not args:
        raise UsageError("no program given; usage: mpxrun -n N [options] [--] prog args...")
    prog = args[0]
    if prog.endswith(".py"):
        if not os.path.isfile(prog):
            raise UsageError(f"program {prog!r} not found (no such file)")
        return [sys.executable, os.path.abspath(prog), *args[1:]]
    if os.sep in prog:
        if not (os.path.isfile(prog) and os.access(prog, os.X_OK)):
            raise UsageError(f"program {prog!r} not found or not executable")
        return [os.path.abspath(prog), *args[1:]]
    found = shutil.which(prog)
    if found is None:
        raise UsageError(f"program {prog!r} not found on PATH")
    return [found, *args[1:]]
