"""MGRIT: mpx's solver beside PyMGRIT, and layer-parallel training beside the serial network.

``python bench_mgrit.py`` starts itself under ``mpxrun -n 1`` (the solvers) and
``-n 1/2/3`` (layer-parallel) and prints one markdown section (``nox -s bench``
writes it into BENCHMARKS.md).

1. Dahlquist's problem ``u' = -u`` on [0, 5], backward Euler, 2^14 steps, solved
   to a C-point residual below 1e-9 by PyMGRIT 1.0.6 and by mpx's ``MGRIT`` with
   the same settings (V-cycles, FCF, nested start): the iteration counts must be
   equal; time per V-cycle = time of the cycles (with the residual) / iterations.
   mpx runs its scalar step (one call per point, like PyMGRIT) and its vectorized
   step (one call per relaxation sweep over all C-intervals), the latter also with
   ``float_times`` (Python floats for t, dt in the coarsest level's sequential solve).
2. ``LayerParallel`` (32 residual steps, width 64, batch 128, 3 levels, cfactor 2,
   2 forward and 1 adjoint V-cycle) forward + backward beside the serial network
   (``.serial()``, plain autograd) in the same job, timed on rank 0 alone.
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
from typing import Any

NT = 2**14
CONFIGS = [(2, 2), (4, 4), (6, 4)]  # (levels, cfactor)
TOL = 1e-9
MPX_VARIANTS = [  # (label, vectorized, float_times)
    ("mpx scalar", False, False),
    ("mpx vectorized", True, False),
    ("mpx vectorized, float times", True, True),
]


def dahlquist(u: Any, t: Any, dt: Any) -> Any:
    z = dt * -1
    return 1 / (1 - z) * u


def solvers() -> None:
    """Inside ``mpxrun -n 1``: one row per configuration and solver."""
    import numpy as np
    import torch
    from mpi4py import MPI

    if not hasattr(np, "in1d"):
        np.in1d = np.isin  # type: ignore[attr-defined]  # PyMGRIT 1.0.6 on numpy >= 2.4
    from pymgrit.core.mgrit import Mgrit
    from pymgrit.core.simple_setup_problem import simple_setup_problem
    from pymgrit.dahlquist.dahlquist import Dahlquist

    from mpx.mgrit import MGRIT

    for levels, cfactor in CONFIGS:
        problem = simple_setup_problem(
            problem=Dahlquist(t_start=0, t_stop=5, nt=NT + 1), level=levels, coarsening=cfactor
        )
        start = time.perf_counter()
        ref = Mgrit(problem=problem, tol=TOL, max_iter=50, comm_time=MPI.COMM_SELF, logging_lvl=30)
        info = ref.solve()
        total_ref = time.perf_counter() - start
        iters_ref = len(info["conv"])
        cycle_ref = info["time_solve"] / iters_ref
        name = f"{levels} levels, cfactor {cfactor}"
        print(f"| {name} | PyMGRIT | {iters_ref} | {cycle_ref * 1e3:.1f} | {total_ref:.2f} | 1 |")
        for kind, vectorized, floats in MPX_VARIANTS:
            best: tuple[float, float, int] | None = None
            for _ in range(2):
                solver = MGRIT(
                    dahlquist, 0.0, 5.0, NT, levels=levels, cfactor=cfactor, tol=TOL,
                    max_iters=50, vectorized=vectorized, float_times=floats,
                )  # fmt: skip
                start = time.perf_counter()
                solver.solve(torch.ones((), dtype=torch.float64))
                total = time.perf_counter() - start
                cycle = solver.timings["cycles"] / solver.iterations
                if best is None or cycle < best[0]:
                    best = (cycle, total, solver.iterations)
            assert best is not None
            cycle, total, iters = best
            same = "" if iters == iters_ref else " (differs!)"
            print(
                f"| {name} | {kind} | {iters}{same} | {cycle * 1e3:.1f} | {total:.2f} | "
                f"{cycle / cycle_ref:.3f} |",
                flush=True,
            )


def layer_parallel() -> None:
    """Inside ``mpxrun -n P``: LayerParallel fwd+bwd on all ranks, serial on rank 0 alone."""
    import torch
    from torch import nn

    from mpx.collectives import world
    from mpx.mgrit import LayerParallel

    comm = world()
    torch.set_num_threads(1)  # one core per rank; the serial network gets one core too
    torch.manual_seed(0)
    width, steps, batch = 64, 32, 128
    net = LayerParallel(
        nn.Linear(64, width), nn.Sequential(nn.Linear(width, width), nn.Tanh()),
        nn.Linear(width, 10), num_steps=steps, Tf=2.0, levels=3, cfactor=2, fwd_iters=2,
        bwd_iters=1,
    )  # fmt: skip
    serial = net.serial()
    x = torch.randn(batch, 64, generator=torch.Generator().manual_seed(1))

    def lp_step() -> None:
        net.zero_grad()
        torch.autograd.backward(net(x).square().sum())

    def serial_step() -> None:
        serial.zero_grad()
        torch.autograd.backward(serial(x).square().sum())

    def timed(fn: Any, repeats: int = 7) -> float:
        fn()
        samples = []
        for _ in range(repeats):
            comm.mpi.Barrier()
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return float(comm.mpi.allreduce(statistics.median(samples), op=max_op()))

    def max_op() -> Any:
        from mpi4py import MPI

        return MPI.MAX

    t_lp = timed(lp_step)
    comm.mpi.Barrier()
    t_serial = 0.0
    if comm.rank == 0:
        serial_step()
        samples = []
        for _ in range(7):
            start = time.perf_counter()
            serial_step()
            samples.append(time.perf_counter() - start)
        t_serial = statistics.median(samples)
    comm.mpi.Barrier()
    if comm.rank == 0:
        print(
            f"| {comm.size} | {t_lp * 1e3:.1f} | {t_serial * 1e3:.1f} | {t_lp / t_serial:.2f} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--inside", choices=["solvers", "lp"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside == "solvers":
        solvers()
        return
    if args.inside == "lp":
        layer_parallel()
        return
    mpxrun = shutil.which("mpxrun", path=os.path.dirname(sys.executable)) or "mpxrun"

    def job(nprocs: int, what: str) -> None:
        cmd = [mpxrun, "-n", str(nprocs), "--timeout", "600", "--", sys.executable]
        subprocess.run([*cmd, os.path.abspath(__file__), "--inside", what], check=True)

    print("## mpx-mgrit: MGRIT solver vs PyMGRIT, layer-parallel vs serial\n")
    print(
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, MPICH wheel "
        "(`python packages/mgrit/benchmarks/bench_mgrit.py`).\n"
    )
    print(
        f"Dahlquist u' = -u on [0, 5], backward Euler, {NT} steps, one rank, tol {TOL:g}, "
        "V-cycles with FCF relaxation and nested start in both. A V-cycle's time includes "
        "its residual; total = set-up + initial guess + cycles. Ratio = mpx ÷ PyMGRIT time "
        "per V-cycle (lower is better).\n"
    )
    print("| grid | solver | iterations | ms per V-cycle | total (s) | ÷ PyMGRIT |")
    print("|---|---|---|---|---|---|")
    sys.stdout.flush()
    job(1, "solvers")
    print(
        "\nLayer-parallel forward + backward (32 steps of width 64, batch 128, float32, "
        "3 levels, cfactor 2, 2 forward / 1 adjoint V-cycles) beside the serial network "
        "in the same job (rank 0 alone), one torch thread per rank. Time: median of 7, "
        "slowest rank. Ratio = mpx ÷ serial (lower is better); 3 ranks on 2 cores are "
        "oversubscribed.\n"
    )
    print("| ranks | layer-parallel (ms) | serial (ms) | ÷ serial |")
    print("|---|---|---|---|")
    sys.stdout.flush()
    for nprocs in (1, 2, 3):
        job(nprocs, "lp")


if __name__ == "__main__":
    main()
