"""``mpxrun``: start N ranks through the installed MPI launcher, and stop them all.

::

    mpxrun -n N [--hostfile F] [--bind none|core|numa] [--gpus auto|none]
           [--timeout S] [--max-restarts N [--restart-delay S]] [--tag-output]
           [--launcher auto|mpich|openmpi|slurm|PATH] [--virtual-nodes K]
           [--oversubscribe] [--] prog args…
    mpxrun --check

The job runs as a process tree in its own session::

    mpxrun ─(watches stderr for status lines, the clock, Ctrl-C)
      └── launcher (mpiexec / mpiexec.gforker / mpirun / srun), new session
            └── per rank: python -m mpx.launch.rank -- prog args…

When a rank fails, its supervisor prints a status line, signed with the job's
key (:mod:`mpx.launch.rank.status`); ``mpxrun`` gives the launcher a moment to tear
the job down by itself, then signals the whole session (SIGTERM, then
SIGKILL). The exit code is the failed rank's (128+N for a signal), 124 for
``--timeout``, 2 for bad usage (checked before anything starts, see
:mod:`mpx.launch.command.arguments`: among others, more than 8 ranks a core needs
``--oversubscribe``).

At ``--timeout`` ``mpxrun`` first asks every rank still running for its
Python stack (SIGUSR1 to their supervisors, see :mod:`mpx.launch.hook.stacks`) and
prints them, then stops the job.

A job succeeds only if every rank exits 0 after the job's end. A Python rank
tells its supervisor when its program reaches its end (``ENDED``, see
:mod:`mpx.launch.excepthook`); then:

- a rank that exits 0 without reaching its end (``os._exit(0)`` mid-run,
  ``LEFT``) while another rank has not ended within ``LEFT_WINDOW_S`` fails
  the job, named as the cause (MPI launchers kill the others of such a job);
- a rank with no exit status at all (killed by the launcher) fails it, unless
  its program had already ended (killed while finalizing MPI);
- once a rank has ended (returned, ``sys.exit(0)``, ``os._exit(0)``), the
  ranks still running are watched: their Python stacks are sampled, and when
  every one of them has sat in the same communication call (a frame of
  torch.distributed, mpi4py or mpx, or a line such as ``comm.Barrier()``) for
  ``MPX_END_GRACE`` seconds, the job is stopped, naming the ranks that ended
  early (uneven step counts) and the stacks of those waiting for them. A rank
  whose program moves on, or that waits outside communication (``sleep``, a
  subprocess), is doing work of its own and is left alone.

With ``--max-restarts N`` a failed attempt (a rank's exit code or signal, or
``--timeout``, which then bounds each attempt) is torn down as above and the
job is started again, up to N times, after ``--restart-delay`` seconds. Each
rank sees the attempt's number in ``MPX_RESTART_COUNT`` and in torchrun's
``TORCHELASTIC_RESTART_COUNT`` (0 first), so a program can resume from its
last checkpoint. When the restarts run out, the exit code is the last
attempt's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Sequence
from typing import NoReturn

from mpx.launch import settings
from mpx.launch.command import (
    VirtualCluster,
    build_parser,
    check_combinations,
    check_rank_count,
    check_restart_flags,
    job_cores,
    read_hostfile,
    resolve_program,
    run_check,
)
from mpx.launch.environment import address_towards, free_port
from mpx.launch.errors import LaunchError, UsageError
from mpx.launch.launchers import Launcher, find_launcher
from mpx.launch.rank import new_key, usable_cores
from mpx.launch.recovery import (
    GROUP_VARIABLES,
    check_usage,
    place_groups,
    ranks_per_node,
    run_replica_groups,
)
from mpx.launch.supervision import EXIT_TIMEOUT, EXIT_USAGE, Job, RankFailure, run_attempts

__all__ = ["EXIT_TIMEOUT", "EXIT_USAGE", "Job", "RankFailure", "build_parser", "main"]


def _all_local(launcher: Launcher, hostfile: str | None, virtual: VirtualCluster | None) -> bool:
    return hostfile is None and launcher.kind != "slurm" and virtual is None


# What a launcher tells its ranks; inherited from an enclosing job (mpxrun
# inside a rank), they would describe that job to this one's ranks.
_ENCLOSING_JOB_VARIABLES = ("PMI_", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")


def _job_environment(
    launcher: Launcher,
    nprocs: int,
    hostfile: str | None,
    gpus: str,
    virtual: VirtualCluster | None = None,
    oversubscribe: bool = False,
) -> dict[str, str]:
    local = _all_local(launcher, hostfile, virtual)
    hosts = [host for host, _ in read_hostfile(hostfile)] if hostfile else []
    if virtual is not None:
        hosts = list(virtual.addresses)
    oversubscribed = oversubscribe or ((local or virtual is not None) and nprocs > usable_cores())
    env = dict(os.environ)
    # A rank supervisor's channels (inside another mpxrun job): this job sets its own.
    for setting in (settings.OUTPUT_FDS, settings.TAG_OUTPUT):
        env.pop(setting.name, None)
    if launcher.forker:
        # Hydra overwrites these for its ranks; gforker sets only PMI_RANK/SIZE/FD.
        for key in [k for k in env if k.startswith(_ENCLOSING_JOB_VARIABLES)]:
            del env[key]
    # Inside another mpxrun job, that job's torchrun variables (RANK, ...) are
    # its ranks', not the user's: this job's ranks get their own.
    for name in env.pop(settings.TORCH_ENV.name, "").split(","):
        env.pop(name, None)
    for key, value in launcher.environment(
        nprocs, oversubscribed=oversubscribed, local=local
    ).items():
        env.setdefault(key, value)
    if virtual is not None:
        env.setdefault("FI_PROVIDER", "tcp")
    # A rendezvous point for torch.distributed's env:// (see init_torch_env).
    master = "127.0.0.1" if local else (hosts[0] if hosts else os.uname().nodename)
    if launcher.kind != "slurm":
        env.setdefault("MPX_MASTER_ADDR", master)
    # else srun places the ranks (this host may be a login node, outside the
    # allocation): each rank's supervisor takes the step's first node, rank 0's.
    env.setdefault("MPX_MASTER_PORT", str(free_port(master if local else "")))
    env["MPX_JOB_ID"] = uuid.uuid4().hex[:12]
    env["MPX_STATUS_KEY"] = new_key()
    env["MPX_GPUS"] = gpus
    return env


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``mpxrun``; returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.check:
        return run_check(smoke=main)
    if args.settings:
        sys.stdout.write(settings.markdown_table())
        return settings.check_environment(sys.stderr)
    if args.tune:
        options = args.program[1:] if args.program[:1] == ["--"] else args.program
        args.program = ["--", sys.executable, "-m", "mpx.collectives.tune", *options]
    with contextlib.ExitStack() as stack:
        try:
            check_combinations(
                args.nprocs, args.virtual_nodes, args.hostfile, args.replica_groups or 1
            )
            check_restart_flags(args.max_restarts, args.restart_delay)
            program = resolve_program(args.program)
            launcher = find_launcher(args.launcher)
            cores = job_cores(launcher.kind, args.hostfile, args.virtual_nodes, os.environ)
            check_rank_count(
                args.nprocs,
                cores,
                oversubscribe=args.oversubscribe,
                groups=args.replica_groups or 1,
            )
            virtual = None
            if args.virtual_nodes is not None:
                _check_virtual(launcher)
                virtual = stack.enter_context(VirtualCluster(args.virtual_nodes))
            local = _all_local(launcher, args.hostfile, virtual)
            if args.replica_groups is not None:
                check_usage(launcher.forker, local)
            if local:
                launcher = launcher.on_this_host()
            env = _job_environment(
                launcher, args.nprocs, args.hostfile, args.gpus, virtual, args.oversubscribe
            )
            if launcher.forker:
                env[settings.BIND.name] = args.bind  # gforker cannot bind: the supervisors do
            if launcher.kind == "mpich":
                # MPICH's launchers do not tag output by whole lines: the supervisors do.
                env[settings.TAG_OUTPUT.name] = "1" if args.tag_output else "0"
            supervised = [sys.executable, "-m", "mpx.launch.rank", "--", *program]
            prefixes = ("MPX_", "MPIR_", "OMP_", "CUDA_")
            per_attempt = {"MPX_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"}
            if args.replica_groups is not None:
                per_attempt |= set(GROUP_VARIABLES)  # each group's, set per job
            exported = sorted({k for k in env if k.startswith(prefixes)} | per_attempt)
            command = launcher.command(
                args.nprocs,
                supervised,
                hostfile=args.hostfile,
                bind=args.bind,
                tag_output=args.tag_output,
                export=exported,
            )
            if virtual is not None and args.replica_groups is None:
                # As even as can be: 4 ranks on 3 nodes are 2, 1, 1 (not 2, 2, 0).
                command[1:1] = virtual.mpich_arguments(ranks_per_node(args.nprocs, virtual.nodes))
            if args.replica_groups is not None:
                placed = _place_groups(
                    args, launcher, command, (supervised, exported), virtual, local, stack
                )
        except LaunchError as exc:
            print(f"mpxrun: {exc}", file=sys.stderr)
            return EXIT_USAGE

        def new_job(attempt: int, base: dict[str, str] = env, command: list[str] = command) -> Job:
            # Both names: mpx programs read MPX_RESTART_COUNT, torchrun-style
            # ones TORCHELASTIC_RESTART_COUNT; launchers forward MPX_* only.
            count = str(attempt)
            attempt_env = dict(base, MPX_RESTART_COUNT=count, TORCHELASTIC_RESTART_COUNT=count)
            return Job(
                command,
                env=attempt_env,
                status_key=base["MPX_STATUS_KEY"],
                nprocs=args.nprocs,
                local=local,
                launcher_lingers=launcher.forker,
                end_when_ranks_exit=launcher.forker,
                own_output=launcher.forker,
                end_grace=settings.END_GRACE.get(),
            )

        if args.replica_groups is not None:
            commands, masters, listen, advertise = placed
            return run_replica_groups(
                env, args.replica_groups, new_job, args, commands, masters, listen, advertise
            )
        return run_attempts(new_job, args.timeout, args.max_restarts, args.restart_delay)


def _place_groups(
    args: argparse.Namespace,
    launcher: Launcher,
    command: list[str],
    ranks: tuple[list[str], list[str]],
    virtual: VirtualCluster | None,
    local: bool,
    stack: contextlib.ExitStack,
) -> tuple[list[list[str]], list[str], str, str | None]:
    """Each replica group's launcher command (its own nodes: see
    :mod:`mpx.launch.recovery.placement`), each group's first node, the address the
    lighthouse listens on and the one its members reach it at. ``command``: the
    job's on this host; ``ranks``: what each rank runs and the variables exported."""
    groups: int = args.replica_groups
    if local:
        return [command] * groups, ["127.0.0.1"] * groups, "127.0.0.1", None
    program, exported = ranks
    if virtual is not None:
        commands, masters = [], []
        for nodes in place_groups(groups, virtual.nodes):
            per_node = ranks_per_node(args.nprocs, len(nodes))
            cmd = list(command)
            cmd[1:1] = virtual.mpich_arguments(per_node, nodes)
            commands.append(cmd)
            masters.append(virtual.addresses[nodes[0]])
        # The nodes' network namespaces reach this one at the bridge's address only.
        return commands, masters, virtual.bridge_address, None
    if launcher.kind == "slurm" and not _allocated():
        # Each group's srun makes an allocation of its own: Slurm picks the nodes, and
        # each group's ranks take their step's first node as its rendezvous ("").
        return [command] * groups, [""] * groups, "0.0.0.0", _address_out()
    if launcher.kind == "slurm":
        hosts = _slurm_hosts()
    else:
        hosts = [host for host, _ in read_hostfile(args.hostfile)]
    directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="mpx-groups-"))
    commands, masters = [], []
    for g, nodes in enumerate(place_groups(groups, len(hosts))):
        names = [hosts[n] for n in nodes]
        per_node = ranks_per_node(args.nprocs, len(nodes))
        if launcher.kind == "slurm":
            cmd = launcher.command(args.nprocs, program, bind=args.bind, tag_output=args.tag_output)
            # --overlap: the groups are steps of one allocation running at once; by
            # default a step waits for the CPUs (and memory) another step holds.
            cmd[1:1] = [f"--nodes={len(names)}", f"--nodelist={','.join(names)}", "--overlap"]
        else:
            path = os.path.join(directory, f"group{g}")
            with open(path, "w") as f:
                for name, count in zip(names, per_node, strict=True):
                    f.write(f"{name} slots={count}\n" if launcher.kind == "openmpi" else
                            f"{name}:{count}\n")  # fmt: skip
            cmd = launcher.command(
                args.nprocs,
                program,
                hostfile=path,
                bind=args.bind,
                tag_output=args.tag_output,
                export=exported,
            )
        commands.append(cmd)
        masters.append(names[0])
    # Every interface (each connection proves the job's secret); the members reach it at
    # this host's address on the route to the first group's node.
    return commands, masters, "0.0.0.0", _address_towards(masters[0])


def _allocated() -> bool:
    return bool(os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST"))


def _address_out() -> str:
    """This host's address on its default route (the nodes Slurm picks reach it there)."""
    try:
        return _address_towards("192.0.2.1")  # TEST-NET-1: routed by default, never sent to
    except UsageError:
        return socket.gethostbyname(socket.gethostname())


def _slurm_hosts() -> list[str]:
    """The nodes of the Slurm allocation, one name each (``scontrol show hostnames``)."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST", "")
    if not nodelist:
        raise UsageError("--replica-groups under srun needs an allocation (SLURM_JOB_NODELIST)")
    scontrol = shutil.which("scontrol")
    if scontrol is None or ("[" not in nodelist):
        return nodelist.split(",")
    names = subprocess.run(
        [scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, check=False
    ).stdout.split()
    if not names:
        raise UsageError(f"scontrol show hostnames {nodelist!r} named no node")
    return names


def _address_towards(host: str) -> str:
    """:func:`address_towards`, a missing route said as a usage error."""
    try:
        return address_towards(host)
    except OSError as exc:
        raise UsageError(f"no route to {host!r}, a node of the job: {exc}") from None


def _check_virtual(launcher: Launcher) -> None:
    if launcher.kind != "mpich":
        raise UsageError(
            f"--virtual-nodes works with MPICH's mpiexec (Hydra), not {launcher.kind} "
            f"({launcher.path}); pass --launcher mpich"
        )


def run() -> NoReturn:
    """Console-script entry point."""
    sys.exit(main())
