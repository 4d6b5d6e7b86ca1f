"""float32 allreduce and broadcast: every mpx implementation beside MPI's own and gloo.

``python bench_allreduce.py`` starts itself under ``mpxrun -n 2`` and ``-n 3``
and prints one markdown section (``nox -s bench`` writes it into
BENCHMARKS.md). In each run, for every size, the peers run in the same job one
after another: mpi4py's ``Allreduce`` (MPI's own), torch ``gloo``, and mpx's
``mpi``, ``ring``, ``shm`` and ``auto``, and ``shm`` on a tensor from
``empty_shared`` (zero copy). Time is the median over samples, a sample
being the mean of a burst of calls after a barrier (up to 64 calls for
small sizes, where one call is shorter than the ranks' skew at the barrier);
algorithm bandwidth = bytes / time, bus bandwidth = algbw * 2(n-1)/n
(nccl-tests' definition).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

SIZES = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]
IMPLS = ["mpi", "ring", "shm", "auto"]


def _label(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def _repeats(nbytes: int) -> int:
    return max(3, min(200, (64 << 20) // max(nbytes, 1) * 3 // 16))


def _burst(nbytes: int) -> int:
    """Calls per timed sample: enough to make 256 KiB, at most 64."""
    return max(1, min(64, (256 << 10) // nbytes))


def measure() -> None:
    """Runs inside the job: every rank times, rank 0 prints table rows."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from mpx.collectives import allreduce, broadcast, empty_shared, world
    from mpx.launch import init_torch_env

    comm = world()
    init_torch_env()
    dist.init_process_group("gloo")
    n = comm.size
    raw = MPI.COMM_WORLD

    # Callable[..., object]: the lambdas bind loop variables as defaults (x=x),
    # which mypy cannot fit to a Callable[[], object].
    def timed(fn: Callable[..., object], repeats: int) -> float:
        # A sample is a burst of calls after a barrier: one 4 KiB call is
        # shorter than the ranks' skew leaving the barrier, which would
        # otherwise be most of what is measured.
        burst = _burst(nbytes)
        for _ in range(max(3, burst)):
            fn()  # warm-up: workspaces, page faults, connections
        samples = []
        for _ in range(max(5, repeats // burst)):
            raw.Barrier()
            start = time.perf_counter()
            for _ in range(burst):
                fn()
            samples.append((time.perf_counter() - start) / burst)
        # Every rank must agree on the figure: take the slowest rank's median.
        return float(raw.allreduce(statistics.median(samples), op=MPI.MAX))

    for nbytes in SIZES:
        x = torch.ones(nbytes // 4)
        reps = _repeats(nbytes)
        times = {
            "MPI Allreduce": timed(lambda x=x: raw.Allreduce(MPI.IN_PLACE, x.numpy()), reps),
            "gloo": timed(lambda x=x: dist.all_reduce(x), reps),
        }
        for impl in IMPLS:
            times[f"mpx {impl}"] = timed(lambda impl=impl, x=x: allreduce(x, impl=impl), reps)
        shared = empty_shared(nbytes // 4)
        shared.fill_(1.0)
        times["mpx shm, empty_shared tensor"] = timed(
            lambda s=shared: allreduce(s, impl="shm"), reps
        )
        base, gloo = times["MPI Allreduce"], times["gloo"]
        for name, seconds in times.items():
            algbw = nbytes / seconds / 1e9
            busbw = algbw * 2 * (n - 1) / n
            if comm.rank == 0:
                print(
                    f"| allreduce | {n} | {_label(nbytes)} | {name} | {seconds * 1e3:.3f} | "
                    f"{algbw:.2f} | {busbw:.2f} | {seconds / base:.2f} | {seconds / gloo:.2f} |",
                    flush=True,
                )
        if nbytes in (4 << 10, 64 << 20):
            btimes = {
                "MPI Bcast": timed(lambda x=x: raw.Bcast(x.numpy(), root=0), reps),
                "gloo": timed(lambda x=x: dist.broadcast(x, 0), reps),
            }
            for impl in IMPLS:
                btimes[f"mpx {impl}"] = timed(
                    lambda impl=impl, x=x: broadcast(x, 0, impl=impl), reps
                )
            btimes["mpx shm, empty_shared tensor"] = timed(
                lambda s=shared: broadcast(s, 0, impl="shm"), reps
            )
            for name, seconds in btimes.items():
                if comm.rank == 0:
                    print(
                        f"| broadcast | {n} | {_label(nbytes)} | {name} | {seconds * 1e3:.3f} | "
                        f"{nbytes / seconds / 1e9:.2f} | | {seconds / btimes['MPI Bcast']:.2f} | "
                        f"{seconds / btimes['gloo']:.2f} |",
                        flush=True,
                    )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        measure()
        return
    mpxrun = shutil.which("mpxrun", path=os.path.dirname(sys.executable)) or "mpxrun"
    print("## mpx-collectives: float32 allreduce and broadcast\n")
    print(
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, MPICH wheel; one job per rank count, all peers in the "
        "same job (`python packages/collectives/benchmarks/bench_allreduce.py`). "
        "Time is the slowest rank's median over samples, each the mean of a burst of calls "
        "after a barrier (64 calls at 4 KiB, 4 at 64 KiB, 1 from 256 KiB); "
        "ratio = time ÷ MPI's own (lower is better). "
        "3 ranks on 2 cores are oversubscribed.\n"
    )
    print(
        "| op | ranks | size | implementation | time (ms) | algbw (GB/s) | busbw (GB/s) "
        "| ÷ MPI | ÷ gloo |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for nprocs in (2, 3):
        subprocess.run(
            [
                mpxrun,
                "-n",
                str(nprocs),
                "--timeout",
                "1200",
                "--",
                sys.executable,
                os.path.abspath(__file__),
                "--inside",
            ],
            check=True,
        )


if __name__ == "__main__":
    main()
