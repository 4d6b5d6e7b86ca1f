"""What a finished job comes to: mpxrun's report and exit code, and the restarts.

:func:`run_attempts` runs the attempts ``--max-restarts`` allows, each a
:class:`~mpx.launch.supervision.job.Job` whose node-shared memory is cleaned after it
(:func:`run_and_clean`); :func:`report` says how the last one ended: the exit
code, and the lines on stderr. A program that refuses its arguments (exit code
2, :func:`usage_error`) is not a crash: no rank-failure report, no restart.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable, Sequence

from mpx.launch.supervision import shm_cleanup
from mpx.launch.supervision.job import EXIT_TIMEOUT, EXIT_USAGE, Job, ranks_phrase

__all__ = [
    "failure_of",
    "report",
    "run_and_clean",
    "run_attempts",
    "stop_on_signals",
    "usage_error",
]


def _last_line(tail: Sequence[str]) -> str:
    """The last non-blank line of a rank's stderr (its exception, for a traceback)."""
    return next((line.strip() for line in reversed(tail) if line.strip()), "")


def usage_error(job: Job) -> bool:
    """The first rank to fail exited with :data:`EXIT_USAGE`: the program refused its
    arguments (the ranks stopped after it do not count)."""
    return bool(job.failures) and job.failures[0].code == EXIT_USAGE and not job.failures[0].reason


def report(job: Job, code: int, timeout: float | None) -> int:
    """Prints how the finished ``job`` went (to stderr) and returns mpxrun's exit code."""
    if job.timed_out:
        print(f"mpxrun: the job ran past --timeout {timeout:g} s and was stopped", file=sys.stderr)
        return EXIT_TIMEOUT
    if usage_error(job):
        # Not a crash: the program said what to fix (once, or on every rank); a rank
        # failure's report around it would bury the message. (Whether a rank printed
        # it cannot be told here: the ranks stopped after the first are not heard.)
        return EXIT_USAGE
    if job.failures:
        first = job.failures[0]
        others = sorted({f.rank for f in job.failures[1:]} - {first.rank})
        lines = [f"mpxrun: {first.describe()}; all ranks were stopped."]
        if others:
            lines.append(f"mpxrun: also failed: rank(s) {', '.join(map(str, others))}")
        if first.ended_before:
            lines.append(
                f"mpxrun: {ranks_phrase(first.ended_before)} had already ended with exit code 0 "
                f"before rank {first.rank} failed (if it waited for them: uneven step counts?)"
            )
        ending = _last_line(first.tail)
        if ending:
            # The rank's stderr went to this terminal as it was written (the
            # supervisor tees it): point at it instead of printing it a second time
            # (a 20-line traceback per failed rank came out twice).
            lines.append(f"mpxrun: rank {first.rank}'s error is printed above; it ends: {ending}")
        lines.extend(first.details)
        print("\n".join(lines), file=sys.stderr)
        return first.exit_code
    if code != 0:
        print(f"mpxrun: the launcher exited with code {code}", file=sys.stderr)
        return code if code > 0 else 128 - code
    return 0


def failure_of(job: Job, code: int, timeout: float | None) -> str | None:
    """What went wrong in a finished attempt, in a few words; None if nothing did."""
    if job.timed_out:
        return f"the job ran past --timeout {timeout:g} s"
    if job.failures:
        return job.failures[0].describe()
    if code != 0:
        return f"the launcher exited with code {code}"
    return None


def stop_on_signals() -> list[int]:
    """Makes SIGTERM and SIGHUP raise KeyboardInterrupt, as Ctrl-C does.

    Returns a one-item list that holds the number of the signal last received
    (SIGINT until SIGTERM or SIGHUP comes), for the exit code 128 + N.
    """
    # SIGTERM/SIGHUP (a batch system, `timeout`, a closed terminal) stop the
    # job the way Ctrl-C does, instead of orphaning it in its own session; the
    # exit code then says which signal it was, as a shell's does (128 + N).
    received = [int(signal.SIGINT)]

    def stop(signum: int, frame: object) -> None:
        received[0] = signum
        raise KeyboardInterrupt

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop)
    return received


def run_and_clean(job: Job, timeout: float | None) -> int:
    """``job.run(timeout)``'s exit code, after removing the MPI shared memory of
    ranks that died (segments that appeared during the attempt and outlive it)."""
    before = shm_cleanup.segments()
    try:
        return job.run(timeout=timeout)
    finally:
        shm_cleanup.remove_orphans(before)


def run_attempts(
    new_job: Callable[[int], Job],
    timeout: float | None,
    max_restarts: int = 0,
    restart_delay: float = 0.0,
) -> int:
    """Runs attempts of ``new_job(attempt)`` until one succeeds or ``max_restarts`` are spent.

    Returns the exit code :func:`report` gives for the last attempt; SIGTERM,
    SIGHUP and Ctrl-C stop the job and return 128 + the signal's number.
    """
    received = stop_on_signals()
    attempt = 0
    try:
        while True:
            job = new_job(attempt)
            started = time.monotonic()
            code = run_and_clean(job, timeout)
            failure = failure_of(job, code, timeout)
            if failure is None or attempt >= max_restarts or usage_error(job):
                if failure is not None and max_restarts and not usage_error(job):
                    print(
                        f"mpxrun: giving up after {attempt} restart(s) (--max-restarts "
                        f"{max_restarts}); the last attempt failed: {failure}",
                        file=sys.stderr,
                    )
                return report(job, code, timeout)
            attempt += 1
            # "Lost": the failed attempt's run and teardown, plus the delay;
            # how much of the run the program redoes depends on its checkpoints.
            lost = time.monotonic() - started + restart_delay
            print(
                f"mpxrun: {failure}; all ranks were stopped. Restart {attempt} of "
                f"{max_restarts} in {restart_delay:g} s ({lost:.1f} s lost: the failed "
                "attempt's run, its teardown and the delay)",
                file=sys.stderr,
                flush=True,
            )
            time.sleep(restart_delay)
    except KeyboardInterrupt:
        name = signal.Signals(received[0]).name
        print(f"mpxrun: {name} received; all ranks were stopped", file=sys.stderr)
        return 128 + received[0]
