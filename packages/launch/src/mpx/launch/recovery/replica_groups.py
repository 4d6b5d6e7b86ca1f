"""``mpxrun --replica-groups R``: R MPI worlds that fail and restart alone, and their lighthouse.

Each replica group is a job of its own (its own launcher, its own
``MPX_STATUS_KEY``, its own ``--max-restarts`` budget): when a rank of group
``g`` dies, ``mpxrun`` stops and restarts group ``g`` only, while the others
keep training (``mpx.dataparallel.FaultTolerantOptimizer`` averages the
gradients over the live groups and hands a restarted group the live state).
``mpxrun`` also runs the :class:`~mpx.launch.recovery.lighthouse.Lighthouse` that keeps
the membership, and tells every rank where it is.

The exit code is 0 if every group's last attempt succeeded, else the first
failing group's (as :func:`mpx.launch.supervision.outcome.report` gives it).
Once a group has finished training (exited 0), the job's training is done: a
group that is then killed or found hung is not restarted, and its end is
reported in one line without failing the job (a restarted group that comes
back after the others finished is told so by the lighthouse and exits 0); a
group whose program exits with an error still fails it. When no group can
train on (the lighthouse found the state lost: :meth:`Lighthouse.cannot_go_on`),
no group is restarted and the job fails, saying why. When the groups cannot
average together (the lighthouse refused a group whose gradients differ from
another's: :meth:`Lighthouse.misconfigured`), the failed group is not restarted (it
would build the same model again) and the other groups are stopped: the job fails
at once, saying why, rather than training on without it.
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
    HANG_TIMEOUT,
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


def _died(job: Job, hung: bool) -> bool:
    """Whether a failed group was killed (by a signal, or stopped as hung) rather than
    ended by its program's own error."""
    return hung or job.timed_out or bool(job.failures and job.failures[0].code < 0)


def run_groups(
    new_job: Callable[[int, int], Job],
    groups: int,
    timeout: float | None,
    max_restarts: int = 0,
    restart_delay: float = 0.0,
    hung: Callable[[], list[int]] | None = None,
    cannot_go_on: Callable[[], str | None] | None = None,
    misconfigured: Callable[[], str | None] | None = None,
) -> int:
    """Runs ``groups`` groups, ``new_job(group, attempt)`` each, restarting a failed one alone.

    ``hung()``, polled, names groups to stop and restart although no rank failed
    (the lighthouse's: silent for its hang timeout). ``cannot_go_on()``, asked
    before a restart, says why no group can train on (then none is restarted).
    ``misconfigured()``, asked when a group fails, says why the groups cannot train
    together at all: then none is restarted and the others are stopped.

    Returns 0 if every group ended well, else the first failing group's exit
    code; SIGTERM, SIGHUP and Ctrl-C stop every group and return 128 + the signal.
    """
    received = stop_on_signals()
    stopping = threading.Event()
    running: dict[int, Job] = {}
    codes: dict[int, int] = {}
    stopped: set[int] = set()
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
                was_hung = group in stopped
                stopped.discard(group)
            if was_hung:
                failure = "silent past its hang timeout (MPX_FT_HANG_TIMEOUT): stopped"
            if failure is not None and 0 in codes.values():
                # Another group finished training: the job's training is done and
                # there is no live state to rejoin.
                finished = min(g for g, c in codes.items() if c == 0)
                died = _died(job, was_hung)
                _say(
                    f"replica group {group}: {failure}; not restarted: group {finished} has "
                    "finished training" + (" (the job's training is complete)" if died else "")
                )
                with lock:
                    codes[group] = 0 if died else report(job, code, timeout)
                return
            wrong = misconfigured() if failure is not None and misconfigured else None
            if wrong is not None:
                with lock:
                    first = not stopping.is_set()
                    stopping.set()
                    others = [job for g, job in running.items() if g != group]
                if first:
                    # Stopped, not left to train alone: the job has failed already.
                    _say(
                        f"replica group {group}: {failure}; no group is restarted and the "
                        f"others are stopped: {wrong}"
                    )
                    for other in others:
                        other.cancel.set()
                with lock:
                    codes[group] = (report(job, code, timeout) or 1) if first else 1
                return
            why_not = cannot_go_on() if failure is not None and cannot_go_on else None
            if why_not is not None:
                _say(f"replica group {group}: {failure}; not restarted: {why_not}")
                with lock:
                    codes[group] = report(job, code, timeout) or 1
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
            for group in hung() if hung is not None else []:
                with lock:
                    if group in running and group not in codes:
                        stopped.add(group)
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


def check_usage(forker: bool, local: bool) -> None:
    """Raises :class:`UsageError` where ``--replica-groups`` cannot run: a launcher that
    starts ranks on this host only (MPICH's gforker) asked for other hosts."""
    if forker and not local:
        raise UsageError(
            "--replica-groups on several nodes needs a launcher that reaches them (Hydra's "
            "mpiexec, Open MPI's mpirun or srun): pass --launcher mpich"
        )


def group_environment(
    env: dict[str, str],
    group: int,
    groups: int,
    lighthouse: str,
    secret: str,
    master: str = "127.0.0.1",
) -> dict[str, str]:
    """The job environment ``env`` made group ``group``'s: its own job id, status key and
    rendezvous point on ``master`` (its first node: each group is an MPI world of its
    own; "": srun picks the nodes, and the ranks take their step's first), where the
    lighthouse is, and the job's secret its connections prove
    (:mod:`mpx.launch.handshake`)."""
    here = master == "127.0.0.1"
    out = dict(
        env,
        MPX_JOB_ID=uuid.uuid4().hex[:12],
        MPX_STATUS_KEY=new_key(),
        MPX_MASTER_ADDR=master,
        # Free here; on another node likely free too (as mpxrun's own rendezvous port).
        MPX_MASTER_PORT=str(free_port("127.0.0.1" if here else "")),
        MPX_REPLICA_GROUP=str(group),
        MPX_REPLICA_GROUPS=str(groups),
        MPX_LIGHTHOUSE=lighthouse,
        MPX_JOB_SECRET=secret,
    )
    if not master:  # none, not an enclosing job's: the ranks find their step's first node
        del out["MPX_MASTER_ADDR"]
    return out


def run_replica_groups(
    env: dict[str, str],
    groups: int,
    new_job: Callable[[int, dict[str, str], list[str]], Job],
    args: argparse.Namespace,
    commands: list[list[str]],
    masters: list[str],
    listen: str = "127.0.0.1",
    advertise: str | None = None,
) -> int:
    """``mpxrun --replica-groups``: the lighthouse (listening on ``listen``, reached at
    ``advertise``), then :func:`run_groups` over ``new_job(attempt, group's environment,
    group's launcher command)``; ``masters``: each group's first node."""
    with Lighthouse(
        expected=groups,
        heartbeat_timeout=HEARTBEAT_TIMEOUT.get(),
        hang_timeout=HANG_TIMEOUT.get(),
        host=listen,
        advertise=advertise,
        log=print_event,
    ) as lighthouse:
        envs = [
            group_environment(env, g, groups, lighthouse.address, lighthouse.key.hex, masters[g])
            for g in range(groups)
        ]
        return run_groups(
            lambda group, attempt: new_job(attempt, envs[group], commands[group]),
            groups,
            args.timeout,
            args.max_restarts,
            args.restart_delay,
            lighthouse.hung,
            lighthouse.cannot_go_on,
            lighthouse.misconfigured,
        )
