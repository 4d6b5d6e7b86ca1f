"""mpxrun against the bare launcher: start-up cost and time to stop a failed job.

Prints a markdown section (``nox -s bench`` writes it into BENCHMARKS.md):

* start-up: wall time of a job whose ranks run ``python -c pass``, and of a
  trivial MPI job (mpi4py's ``MPI_Init``, one ``Barrier``, ``MPI_Finalize``),
  through ``mpxrun`` and through the same ``mpiexec`` directly, the two
  alternating run by run (a load that comes and goes hits both); the
  difference is the cost of mpxrun and its per-rank supervisors.
* failure: rank 1 raises while the other ranks wait in ``MPI_Barrier``; how long
  until the whole job has ended. The bare launcher is given ``HANG_LIMIT_S``
  and then killed: with mpi4py's finalize-at-exit it never ends by itself.

Usage: ``python bench_startup.py [--repeats N]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from mpx.launch import find_launcher

HANG_LIMIT_S = 20.0
TRIVIAL_MPI = "from mpi4py import MPI; MPI.COMM_WORLD.Barrier()"
FAILING_RANK = """
from mpi4py import MPI
comm = MPI.COMM_WORLD
comm.Barrier()
if comm.Get_rank() == 1:
    raise RuntimeError("deliberate failure")
comm.Barrier()
"""


def _time(cmd: list[str], env: dict[str, str], limit: float) -> tuple[float, bool]:
    """Wall time of ``cmd``; True if it had to be killed at ``limit``."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    # A timer kills it at the limit and wait() blocks: wait(timeout=...) polls, its
    # sleeps growing to 50 ms, which rounded every time up to the next poll.
    killed = threading.Event()

    def kill() -> None:
        killed.set()
        with contextlib.suppress(ProcessLookupError):  # it ended at the limit
            os.killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(limit, kill)
    timer.start()
    try:
        proc.wait()
    finally:
        timer.cancel()
    return time.perf_counter() - start, killed.is_set()


def _alternated(
    bare: list[str], ours: list[str], env: dict[str, str], repeats: int
) -> tuple[list[float], list[float]]:
    """Wall times of ``bare`` and ``ours``, run in turns (which goes first swaps each round)."""
    times: tuple[list[float], list[float]] = ([], [])
    for repeat in range(repeats):
        order = (0, 1) if repeat % 2 == 0 else (1, 0)
        for which in order:
            times[which].append(_time((bare, ours)[which], env, 60)[0])
    return times


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} s ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    launcher = find_launcher()
    mpxrun = shutil.which("mpxrun", path=os.path.dirname(sys.executable)) or "mpxrun"
    env = dict(os.environ)
    env.update(launcher.environment(3, oversubscribed=True))
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as fh:
        fh.write(FAILING_RANK)
        failing = fh.name

    rows = []
    loads = [os.getloadavg()[0]]
    jobs = [("`python -c pass`", ["-c", "pass"]), ("mpi4py `Barrier`", ["-c", TRIVIAL_MPI])]
    for what, program in jobs:
        for nprocs in (1, 2, 3):
            bare = [launcher.path, "-n", str(nprocs), sys.executable, *program]
            ours = [mpxrun, "-n", str(nprocs), "--", sys.executable, *program]
            runs_bare, runs_ours = _alternated(bare, ours, env, args.repeats)
            loads.append(os.getloadavg()[0])
            over = statistics.median(o - b for o, b in zip(runs_ours, runs_bare, strict=True))
            times = statistics.median(runs_ours) / statistics.median(runs_bare)
            rows.append(
                f"| start-up, {what}, {nprocs} rank(s) | {_spread(runs_ours)} "
                f"| {_spread(runs_bare)} | {over:.3f} s | {times:.2f} |"
            )
    for nprocs in (2, 3):
        bare_f = [launcher.path, "-n", str(nprocs), sys.executable, failing]
        ours_f = [mpxrun, "-n", str(nprocs), "--", sys.executable, failing]
        t_bare, hung = _time(bare_f, env, HANG_LIMIT_S)
        t_ours = statistics.median(_time(ours_f, env, 60)[0] for _ in range(args.repeats))
        bare_text = f"hung, killed at {t_bare:.0f} s" if hung else f"{t_bare:.3f} s"
        ratio = f"< {t_ours / t_bare:.2f}" if hung else f"{t_ours / t_bare:.2f}"
        rows.append(
            f"| rank 1 raises, {nprocs} ranks: job ended | {t_ours:.3f} s | {bare_text} "
            f"| | {ratio} |"
        )
    loads.append(os.getloadavg()[0])
    os.unlink(failing)

    print("## mpx-launch: mpxrun vs the bare launcher\n")
    print(
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; launcher: {launcher.kind} (`{launcher.path}`). "
        f"Median (range) of {args.repeats} runs each, mpxrun's and the bare launcher's "
        "alternating; the overhead is the median of the differences of the pairs "
        f"(`python packages/launch/benchmarks/bench_startup.py`). 1-minute load during "
        f"the runs: {min(loads):.1f}-{max(loads):.1f}.\n"
    )
    print("| what | mpxrun | bare launcher | overhead (mpxrun − bare) | ratio (mpxrun ÷ bare) |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
