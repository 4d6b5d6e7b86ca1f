"""Per-call overhead of a small blocking collective: mpx beside mpi4py's own call.

``python bench_overhead.py`` starts itself under ``mpxrun -n 2`` and prints
one markdown section (``nox -s bench`` writes it into BENCHMARKS.md). A
4 KiB float32 tensor (1024 values) is reduced or broadcast in a tight loop by:

- mpi4py, non-blocking and waited for, on a prepared message
  (``Iallreduce(IN_PLACE, [buffer, FLOAT]).Wait()``): the MPI call mpx's
  fast path makes, with none of its work -- the reference of the ratio;
- mpi4py's blocking ``Allreduce(IN_PLACE, numpy_array)`` (``Bcast``);
- mpx's public ``allreduce(t)`` (``broadcast(t, 0)``) with the fast path
  compiled (``mpx.collectives.core.fast_path.COMPILED``), and with the same
  source run as Python (loaded from ``fast_path.py`` under another name and
  put in its place for those rounds).

The variants take turns within each round (``--rounds`` rounds of ``--calls``
calls, after a barrier); a round's figure is the slower rank's mean per call.
The table gives the minimum and median over rounds, and the ratio to the
reference per round (median, and the range).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType


def _source_module(compiled: ModuleType) -> ModuleType:
    """``fast_path.py`` beside the compiled module, imported as Python under another name."""
    source = Path(str(compiled.__file__)).with_name("fast_path.py")
    spec = importlib.util.spec_from_file_location("mpx.collectives._fast_path_source", source)
    assert spec is not None, source
    assert spec.loader is not None, source
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(rounds: int, calls: int) -> None:
    """Runs inside the job: every rank times, rank 0 prints table rows."""
    import numpy as np
    import torch
    from mpi4py import MPI

    from mpx.collectives import allreduce, broadcast, world
    from mpx.collectives.core import fast_path, ops
    from mpx.launch.settings import reload as reload_settings

    comm = world()
    raw = MPI.COMM_WORLD.Dup()
    t = torch.ones(1024)
    a = np.ones(1024, dtype=np.float32)
    message = [MPI.buffer.fromaddress(t.data_ptr(), t.nbytes), MPI.FLOAT]
    source = _source_module(fast_path) if fast_path.COMPILED else None

    def loop(fn: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(calls):
                fn()

        return run

    def swapped(module: ModuleType, run: Callable[[], None]) -> Callable[[], None]:
        def with_module() -> None:
            # ops.allreduce calls ops' global fast_path; the two forms cache
            # their calls apart (each its own class of entry).
            namespace = vars(ops)
            saved = namespace["fast_path"]
            namespace["fast_path"] = module
            comm.choices.fast.clear()
            try:
                run()
            finally:
                namespace["fast_path"] = saved
                comm.choices.fast.clear()

        return with_module

    def unchecked(run: Callable[[], None]) -> Callable[[], None]:
        """``run`` with the default cross-rank check (MPX_CHECK=auto) off."""

        def without_check() -> None:
            os.environ["MPX_CHECK"] = "0"
            reload_settings()
            try:
                run()
            finally:
                del os.environ["MPX_CHECK"]
                reload_settings()

        return without_check

    check_costs: list[str] = []
    for op in ("allreduce", "broadcast"):
        variants: dict[str, Callable[[], None]] = {}
        if op == "allreduce":
            variants["mpi4py Iallreduce + Wait, prepared"] = loop(
                lambda: raw.Iallreduce(MPI.IN_PLACE, message).Wait()
            )
            variants["mpi4py Allreduce, numpy"] = loop(lambda: raw.Allreduce(MPI.IN_PLACE, a))
            mpx_call = loop(lambda: allreduce(t))
        else:
            variants["mpi4py Ibcast + Wait, prepared"] = loop(lambda: raw.Ibcast(message, 0).Wait())
            variants["mpi4py Bcast, numpy"] = loop(lambda: raw.Bcast(a, 0))
            mpx_call = loop(lambda: broadcast(t, 0))
        mine = "compiled" if fast_path.COMPILED else "Python (not compiled)"
        variants[f"mpx {op}, fast path {mine}"] = mpx_call
        variants[f"mpx {op}, fast path {mine}, MPX_CHECK=0"] = unchecked(mpx_call)
        if source is not None:
            variants[f"mpx {op}, fast path as Python"] = swapped(source, mpx_call)
        times: dict[str, list[float]] = {name: [] for name in variants}
        for run in variants.values():
            run()  # warm-up: caches, connections
        for _ in range(rounds):
            for name, run in variants.items():
                raw.Barrier()
                start = time.perf_counter()
                run()
                mean = (time.perf_counter() - start) / calls
                times[name].append(float(raw.allreduce(mean, op=MPI.MAX)))
        if comm.rank == 0:
            on, off = (times[f"mpx {op}, fast path {mine}{x}"] for x in ("", ", MPX_CHECK=0"))
            cost = sorted(x / y - 1 for x, y in zip(on, off, strict=True))
            check_costs.append(
                f"{op}: the default check (MPX_CHECK=auto) adds {statistics.median(cost):+.1%} "
                f"per call over MPX_CHECK=0 (median of rounds; range {cost[0]:+.1%} to "
                f"{cost[-1]:+.1%})"
            )
            reference = times[next(iter(variants))]
            for name, samples in times.items():
                ratios = [s / r for s, r in zip(samples, reference, strict=True)]
                print(
                    f"| {name} | {min(samples) * 1e6:.2f} | {statistics.median(samples) * 1e6:.2f} "
                    f"| {statistics.median(ratios):.2f} | {min(ratios):.2f}–{max(ratios):.2f} |"
                )

    if comm.rank == 0:
        print()
        for line in check_costs:
            print(f"- {line}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("-n", type=int, default=2, help="ranks")
    args = parser.parse_args()
    if args.inside:
        measure(args.rounds, args.calls)
        return
    mpxrun = shutil.which("mpxrun", path=os.path.dirname(sys.executable)) or "mpxrun"
    print("## mpx-collectives: per-call overhead of a 4 KiB collective\n")
    print(
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, MPICH wheel; {args.n} ranks, float32 × 1024 in place "
        "(`python packages/collectives/benchmarks/bench_overhead.py`). "
        f"{args.rounds} rounds of {args.calls} calls, the variants in turn within each round; "
        "µs per call (the slower rank's mean over a round), min and median over rounds; "
        "ratio = ÷ the first row of the op, per round (median, range).\n"
    )
    print("| call | min (µs) | median (µs) | ratio | ratio range |")
    print("|---|---|---|---|---|")
    sys.stdout.flush()
    subprocess.run(
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
            "--calls",
            str(args.calls),
        ],
        check=True,
    )


if __name__ == "__main__":
    main()
