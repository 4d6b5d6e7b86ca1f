"""mpxrun against the bare launcher: start-up cost and time to stop a failed job.

Prints a markdown section (``nox -s bench`` writes it into BENCHMARKS.md):

* start-up: wall time of a job whose ranks run ``python -c pass``, through
  ``mpxrun`` and through the same ``mpiexec`` directly; the difference is the
  cost of mpxrun and its per-rank supervisors.
* failure: rank 1 raises while the other ranks wait in ``MPI_Barrier``; how long
  until the whole job has ended. The bare launcher is given ``HANG_LIMIT_S``
  and then killed: with mpi4py's finalize-at-exit it never ends by itself.

Usage: ``python bench_startup.py [--repeats N]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from mpx.launch import find_launcher

HANG_LIMIT_S = 20.0
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
    try:
        proc.wait(timeout=limit)
        return time.perf_counter() - start, False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        return time.perf_counter() - start, True


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
    for nprocs in (1, 2, 3):
        bare = [launcher.path, "-n", str(nprocs), sys.executable, "-c", "pass"]
        ours = [mpxrun, "-n", str(nprocs), "--", sys.executable, "-c", "pass"]
        t_bare = statistics.median(_time(bare, env, 60)[0] for _ in range(args.repeats))
        t_ours = statistics.median(_time(ours, env, 60)[0] for _ in range(args.repeats))
        rows.append(
            f"| start-up, {nprocs} rank(s) | {t_ours:.3f} s | {t_bare:.3f} s "
            f"| {t_ours / t_bare:.2f} |"
        )
    for nprocs in (2, 3):
        bare_f = [launcher.path, "-n", str(nprocs), sys.executable, failing]
        ours_f = [mpxrun, "-n", str(nprocs), "--", sys.executable, failing]
        t_bare, hung = _time(bare_f, env, HANG_LIMIT_S)
        t_ours = statistics.median(_time(ours_f, env, 60)[0] for _ in range(args.repeats))
        bare_text = f"hung, killed at {t_bare:.0f} s" if hung else f"{t_bare:.3f} s"
        ratio = f"< {t_ours / t_bare:.2f}" if hung else f"{t_ours / t_bare:.2f}"
        rows.append(
            f"| rank 1 raises, {nprocs} ranks: job ended | {t_ours:.3f} s | {bare_text} | {ratio} |"
        )
    os.unlink(failing)

    print("## mpx-launch: mpxrun vs the bare launcher\n")
    print(
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; launcher: {launcher.kind} (`{launcher.path}`). "
        f"Median of {args.repeats} runs (`python packages/launch/benchmarks/bench_startup.py`).\n"
    )
    print("| what | mpxrun | bare launcher | ratio (mpxrun ÷ bare) |")
    print("|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
