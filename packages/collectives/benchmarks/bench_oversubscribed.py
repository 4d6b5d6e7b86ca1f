"""Oversubscribed ranks: does a rank waiting in a collective slow a computing one?

``python bench_oversubscribed.py`` starts itself ``--runs`` times under
``mpxrun -n 4`` (more ranks than this machine's cores, on a 2-core machine)
and prints one markdown section (``nox -s bench`` writes it into
BENCHMARKS.md). In each round rank 0 runs a fixed single-threaded torch
workload (matrix products) while ranks 1..3 wait for it:

- *alone*: ranks 1..3 sleep (a 5 ms polling loop on a non-blocking
  barrier) -- the reference: rank 0 has a core to itself;
- in a blocking mpx ``allreduce`` of 4 KiB (the small-call fast path),
  of 1 MiB (``shm``), a ``barrier``, an ``allreduce`` with ``timeout=``;
- in mpi4py's own blocking ``Allreduce`` (MPI's wait, for comparison).

Rank 0 joins the collective when its work is done. A run's figure per
variant is the median over ``--rounds`` rounds (variants take turns within a
round) of rank 0's compute time, its ratio to *alone*, and the CPU time the
waiting ranks used (``resource.getrusage``, every thread) over their wait
time, averaged over ranks 1..3. The table gives the range over runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable


def measure(rounds: int, steps: int) -> None:
    """Runs inside the job: rank 0 prints one JSON line of medians per variant."""
    import resource

    import torch
    from mpi4py import MPI

    from mpx.collectives import allreduce, barrier, world

    torch.set_num_threads(1)
    comm = world()
    raw = MPI.COMM_WORLD.Dup()
    small = torch.ones(1024)  # 4 KiB
    large = torch.ones(1 << 18)  # 1 MiB: shm
    a = torch.rand(192, 192)

    def work() -> None:
        x = a
        for _ in range(steps):
            x = torch.tanh(x @ a)

    def sleep_until_all_arrive() -> None:
        request = raw.Ibarrier()
        while not request.Test():
            time.sleep(5e-3)

    variants: dict[str, Callable[[], object]] = {
        "alone (peers sleep)": sleep_until_all_arrive,
        "mpx allreduce 4 KiB": lambda: allreduce(small),
        "mpx allreduce 1 MiB (shm)": lambda: allreduce(large),
        "mpx barrier": barrier,
        "mpx allreduce 4 KiB, timeout=60": lambda: allreduce(small, timeout=60),
        "mpi4py Allreduce 4 KiB": lambda: raw.Allreduce(MPI.IN_PLACE, small.numpy()),
    }
    compute: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    for join in variants.values():
        join()  # warm-up: connections, the shm workspace
    work()
    for _ in range(rounds):
        for name, join in variants.items():
            raw.Barrier()
            wall, used = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            if comm.rank == 0:
                work()
            took = time.perf_counter() - wall
            join()
            waited = time.perf_counter() - wall
            now = resource.getrusage(resource.RUSAGE_SELF)
            busy = now.ru_utime - used.ru_utime + now.ru_stime - used.ru_stime
            figures = raw.gather((took, busy / waited), root=0)
            if comm.rank == 0:
                assert figures is not None
                compute[name].append(figures[0][0])
                cpu[name].append(statistics.mean(share for _, share in figures[1:]))
    if comm.rank == 0:
        result = {
            name: (statistics.median(compute[name]), statistics.median(cpu[name]))
            for name in variants
        }
        os.write(1, (json.dumps(result) + "\n").encode())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=3, help="jobs (the table gives ranges)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per job (median)")
    parser.add_argument("--steps", type=int, default=1500, help="matrix products per round")
    parser.add_argument("-n", type=int, default=4, help="ranks")
    args = parser.parse_args()
    if args.inside:
        measure(args.rounds, args.steps)
        return
    mpxrun = shutil.which("mpxrun", path=os.path.dirname(sys.executable)) or "mpxrun"
    runs: list[dict[str, list[float]]] = []
    loads: list[float] = []  # other jobs on the machine compete for its cores too
    for _ in range(args.runs):
        loads.append(os.getloadavg()[0])
        done = subprocess.run(
            [
                mpxrun,
                "-n",
                str(args.n),
                "--timeout",
                "900",
                "--",
                sys.executable,
                os.path.abspath(__file__),
                "--inside",
                "--rounds",
                str(args.rounds),
                "--steps",
                str(args.steps),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        runs.append(json.loads(lines[-1]))
    print("## mpx-collectives: waiting ranks on an oversubscribed node\n")
    print(
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, MPICH wheel; {args.n} ranks under mpxrun "
        "(`python packages/collectives/benchmarks/bench_oversubscribed.py`). Rank 0 runs "
        f"{args.steps} single-threaded 192×192 matrix products while ranks 1..{args.n - 1} "
        "wait in the collective it joins afterwards. Per job the median of "
        f"{args.rounds} rounds; ranges over {args.runs} jobs. Slowdown = rank 0's compute "
        "time ÷ its time alone (same job); CPU = the waiting ranks' CPU time ÷ their wait. "
        f"Load average when the jobs started: {min(loads):.1f}–{max(loads):.1f}.\n"
    )
    print("| ranks 1.. wait in | rank 0 compute (s) | slowdown | waiting ranks' CPU |")
    print("|---|---|---|---|")
    alone = next(iter(runs[0]))
    for name in runs[0]:
        times = [run[name][0] for run in runs]
        ratios = [run[name][0] / run[alone][0] for run in runs]
        shares = [run[name][1] * 100 for run in runs]
        print(
            f"| {name} | {min(times):.2f}–{max(times):.2f} | {min(ratios):.2f}–{max(ratios):.2f}× "
            f"| {min(shares):.0f}–{max(shares):.0f} % |"
        )


if __name__ == "__main__":
    main()
