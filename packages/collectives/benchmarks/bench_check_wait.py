"""How late a checked call returns when its peer comes late: the call board's wait.

``python bench_check_wait.py`` starts itself under ``mpxrun -n 2``. In each
round rank 1 sleeps ``--delay`` seconds, then calls a 1 MiB allreduce
(``async_op=True``, then ``wait()``: the general path, ``shm``); rank 0 calls
at once and waits. The *lag* is rank 0's return minus rank 1's call (both read
CLOCK_MONOTONIC, one host): what rank 0's waiting adds. Three ways of waiting
take turns call by call:

- ``MPX_CHECK=0``: no check, rank 0 waits in the collective (MPI's wait);
- the check, the board's wait that sleeps (20 µs growing to 1 ms after
  0.5 ms of yielding): every board waited so before issue 30's fix, and a
  yielding communicator's (ranks outnumber cores) still does;
- the check, the board's wait that polls and yields without sleeping: a
  communicator with a core per rank, since that fix.

Prints the median and quartiles of each (µs). Run it on a quiet machine with
a core per rank; on a loaded one the scheduler's delays swamp the figures.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time


def measure(delay: float, rounds: int) -> None:
    """Runs inside the job: rank 0 prints one line per way of waiting."""
    import torch

    from mpx.collectives import allreduce, world
    from mpx.collectives.core import policy

    comm = world()
    board = comm.call_board
    if board is None or comm.size != 2:
        raise SystemExit("bench_check_wait: needs 2 ranks on one node (a call board)")
    rules = policy.current()
    t = torch.ones(1 << 18)
    ways = {
        "MPX_CHECK=0": ("0", False),
        "check, sleeping board wait": ("auto", True),
        "check, board wait without sleeps": ("auto", False),
    }
    lags: dict[str, list[float]] = {name: [] for name in ways}
    for round_ in range(rounds + 2):  # two rounds of warm-up
        for name, (check, sleeping) in ways.items():
            rules.check = check  # the policy in force, without a reload between calls
            board.yielding = sleeping
            comm.mpi.Barrier()
            if comm.rank == 1:
                time.sleep(delay)
                started = time.monotonic()
                allreduce(t, async_op=True).wait()
                comm.mpi.send(started, 0)
            else:
                allreduce(t, async_op=True).wait()
                done = time.monotonic()
                started = comm.mpi.recv(source=1)
                if round_ >= 2:
                    lags[name].append(done - started)
    if comm.rank == 0:
        for name, values in lags.items():
            q1, median, q3 = statistics.quantiles(values, n=4)
            print(
                f"{name:34s} lag median {median * 1e6:8.1f} us "
                f"(quartiles {q1 * 1e6:.1f}-{q3 * 1e6:.1f}; {len(values)} calls, "
                f"peer {delay * 1e3:g} ms late)",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay", type=float, default=0.003, help="seconds rank 1 comes late")
    parser.add_argument("--rounds", type=int, default=200, help="calls per way of waiting")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        measure(args.delay, args.rounds)
        return
    mpxrun = shutil.which("mpxrun", path=os.path.dirname(sys.executable)) or "mpxrun"
    command = [mpxrun, "-n", "2", "--timeout", "600", "--", sys.executable, __file__]
    command += ["--inside", "--delay", str(args.delay), "--rounds", str(args.rounds)]
    sys.exit(subprocess.run(command, check=False).returncode)


if __name__ == "__main__":
    main()
