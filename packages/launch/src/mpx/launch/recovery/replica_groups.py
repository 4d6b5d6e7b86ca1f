"""``mpxrun --replica-groups R``: R MPI worlds that fail and restart alone, and their lighthouse.

Each replica group is a job of its own (its own launcher, its own
``MPX_STATUS_KEY``, its own ``--max-restarts`` budget): when a rank of group
``g`` dies, ``mpxrun`` stops and restarts group ``g`` only, while the others
keep training (``mpx.dataparallel.FaultTolerantOptimizer`` averages the
gradients over the live groups and hands a restarted group the live state).
``mpxrun`` also runs the :class:`~mpx.launch.recovery.lighthouse.Lighthouse` that keeps
the membership, and tells every rank where it is.

The exit code is 0 if every group's last attempt succeeded, else the first
failing group's (as :func:`mpx.launch.supervision.outcome.report` gives it). A group that
fails after another has finished training is not restarted (there is no
live state left to rejoin); its failure is the job's exit code.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable

from mpx.launch.environment import free_port
from mpx.launch.errors import UsageError
from mpx.launch.rank import new_key
from mpx.launch.recovery.lighthouse import Lighthouse, print_event
from mpx.launch.settings import (
    HEARTBEAT_TIMEOUT,
    JOB_SECRET,
    LIGHTHOUSE,
    REPLICA_GROUP,
    REPLICA_GROUPS,
)
from mpx.launch.supervision import Job, failure_of, report, run_and_clean, stop_on_signals

__all__ = [
    "GROUP_VARIABLES",
    "HEARTBEAT_TIMEOUT",
    "LIGHTHOUSE",
    "REPLICA_GROUP",
    "REPLICA_GROUPS",
    "check_usage",
    "group_environment",
    "run_groups",
    "run_replica_groups",
]

# What group_environment adds to a group's job, for launchers that forward only
# the variables they are told (by name: the secret's value is never on a command line).
GROUP_VARIABLES = (REPLICA_GROUP.name, REPLICA_GROUPS.name, LIGHTHOUSE.name, JOB_SECRET.name)


def _say(text: str) -> None:
    print(f"mpxrun: {text}", file=sys.stderr, flush=True)


def run_groups(
    new_job: Callable[[int, int], Job],
    groups: int,
    timeout: float | None,
    max_restarts: int = 0,
    restart_delay: float = 0.0,
    counted_out: Callable[[], list[int]] | None = None,
) -> int:
    """Runs ``groups`` groups, ``new_job(group, attempt)`` each, restarting a failed one alone.

    ``counted_out()``, polled, names groups to stop and restart although no rank
    failed (the lighthouse's: hung, they missed their heartbeats).

    Returns 0 if every group ended well, else the first failing group's exit
    code; SIGTERM, SIGHUP and Ctrl-C stop every group and return 128 + the signal.
    """
    received = stop_on_signals()
    stopping = threading.Event()
    running: dict[int, Job] = {}
    codes: dict[int, int] = {}
    hung: set[int] = set()
    lock = threading.Lock()

    def supervise(group: int) -> None:
        attempt = 0
        while not stopping.is_set():
            job = new_job(group, attempt)
            with lock:
                running[group] = job
            if stopping.is_set():
                return
            code = run_and_clean(job, timeout)
            failure = failure_of(job, code, timeout)
            with lock:
                if group in hung:
                    hung.discard(group)
                    failure = "it missed its heartbeats (hung?) and was stopped"
            if failure is not None and 0 in codes.values():
                # Another group finished training: there is no live state to rejoin.
                _say(
                    f"replica group {group}: {failure}; not restarted: "
                    f"group {min(g for g, c in codes.items() if c == 0)} has finished training"
                )
                with lock:
                    codes[group] = report(job, code, timeout)
                return
            if failure is None or attempt >= max_restarts or stopping.is_set():
                if failure is not None:
                    _say(f"replica group {group} failed for good: {failure}")
                with lock:
                    codes[group] = report(job, code, timeout) if failure is not None else 0
                return
            attempt += 1
            _say(
                f"replica group {group}: {failure}; its ranks were stopped, the other groups "
                f"go on. Restart {attempt} of {max_restarts} in {restart_delay:g} s"
            )
            stopping.wait(restart_delay)

    threads = [
        threading.Thread(target=supervise, args=(g,), name=f"mpx-group-{g}", daemon=True)
        for g in range(groups)
    ]
    try:
        for thread in threads:
            thread.start()
        while any(t.is_alive() for t in threads):
            time.sleep(0.05)
            for group in counted_out() if counted_out is not None else []:
                with lock:
                    if group in running and group not in codes:
                        hung.add(group)
                        running[group].cancel.set()
    except KeyboardInterrupt:
        stopping.set()
        with lock:
            for job in running.values():
                job.cancel.set()
        for thread in threads:
            thread.join(timeout=30.0)
        _say(f"{signal.Signals(received[0]).name} received; all groups were stopped")
        return 128 + received[0]
    failed = [codes[g] for g in range(groups) if codes.get(g, 1) != 0]
    return failed[0] if failed else 0


def check_usage(local: bool) -> None:
    """Raises :class:`UsageError` where ``--replica-groups`` cannot run yet: off this host
    (``--hostfile``, ``--virtual-nodes``, Slurm), where its TCP links are untested."""
    if not local:
        raise UsageError(
            "--replica-groups runs every group on this host in this version: drop --hostfile "
            "and --virtual-nodes, and run outside Slurm's launcher (--launcher mpich)"
        )


def group_environment(
    env: dict[str, str], group: int, groups: int, lighthouse: str, secret: str
) -> dict[str, str]:
    """The job environment ``env`` made group ``group``'s: its own job id, status key and
    rendezvous port (each group is an MPI world of its own), where the lighthouse is, and
    the job's secret its connections prove (:mod:`mpx.launch.handshake`)."""
    return dict(
        env,
        MPX_JOB_ID=uuid.uuid4().hex[:12],
        MPX_STATUS_KEY=new_key(),
        MPX_MASTER_PORT=str(free_port("127.0.0.1")),
        MPX_REPLICA_GROUP=str(group),
        MPX_REPLICA_GROUPS=str(groups),
        MPX_LIGHTHOUSE=lighthouse,
        MPX_JOB_SECRET=secret,
    )


def run_replica_groups(
    env: dict[str, str],
    groups: int,
    new_job: Callable[[int, dict[str, str]], Job],
    args: argparse.Namespace,
) -> int:
    """``mpxrun --replica-groups``: the lighthouse, then :func:`run_groups` over
    ``new_job(attempt, group's environment)``."""
    with Lighthouse(
        expected=groups, heartbeat_timeout=HEARTBEAT_TIMEOUT.get(), log=print_event
    ) as lighthouse:
        envs = [
            group_environment(env, g, groups, lighthouse.address, lighthouse.key.hex)
            for g in range(groups)
        ]
        return run_groups(
            lambda group, attempt: new_job(attempt, envs[group]),
            groups,
            args.timeout,
            args.max_restarts,
            args.restart_delay,
            lighthouse.counted_out,
        )
