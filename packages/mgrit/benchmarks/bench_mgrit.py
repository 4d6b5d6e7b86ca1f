"""MGRIT: mpx's solver beside PyMGRIT, and layer-parallel training beside the serial network.

``python bench_mgrit.py`` starts itself under ``mpxrun -n 1`` (the solvers) and
``-n 1/2/3`` (layer-parallel) and prints one markdown section (``nox -s bench``
writes it into BENCHMARKS.md).

1. Dahlquist's problem ``u' = -u`` on [0, 5], backward Euler, 2^14 steps, solved
   to a C-point residual below 1e-9 by PyMGRIT 1.0.6 and by mpx's ``MGRIT`` with
   the same settings (V-cycles, FCF, nested start): the iteration counts must be
   equal; time per V-cycle = time of the cycles (with the residual) / iterations.
   ``--cycles V,F`` (the default) adds F-cycle rows (``cycle_type="F"`` in both)
   for the grids where an F-cycle differs from a V-cycle (3 levels or more).
   mpx runs its scalar step (one call per point, like PyMGRIT) and its vectorized
   step (one call per relaxation sweep over all C-intervals), the latter also with
   ``float_times`` (Python floats for t, dt in the coarsest level's sequential solve).
2. ``LayerParallel`` (128 residual steps, width 64, batch 128, 3 levels, cfactor 2,
   2 forward and 1 adjoint V-cycle) forward + backward beside the serial network
   (``.serial()``, plain autograd) in the same job, timed on rank 0 alone.
"""

from __future__ import annotations

import argparse
import itertools
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


def solvers(cycles: list[str]) -> None:
    """Inside ``mpxrun -n 1``: one row per configuration, cycle type and solver."""
    import numpy as np
    import torch
    from mpi4py import MPI

    if not hasattr(np, "in1d"):
        np.in1d = np.isin  # type: ignore[attr-defined]  # PyMGRIT 1.0.6 on numpy >= 2.4
    from pymgrit.core.mgrit import Mgrit
    from pymgrit.core.simple_setup_problem import simple_setup_problem
    from pymgrit.dahlquist.dahlquist import Dahlquist

    from mpx.mgrit import MGRIT

    runs = [(lv, cf, cyc) for cyc in cycles for lv, cf in CONFIGS if cyc == "V" or lv >= 3]
    for levels, cfactor, cycle_type in runs:
        problem = simple_setup_problem(
            problem=Dahlquist(t_start=0, t_stop=5, nt=NT + 1), level=levels, coarsening=cfactor
        )
        start = time.perf_counter()
        ref = Mgrit(problem=problem, tol=TOL, max_iter=50, cycle_type=cycle_type,
                    comm_time=MPI.COMM_SELF, logging_lvl=30)  # fmt: skip
        info = ref.solve()
        total_ref = time.perf_counter() - start
        iters_ref = len(info["conv"])
        cycle_ref = info["time_solve"] / iters_ref
        name = f"{levels} levels, cfactor {cfactor}" + (", F-cycles" if cycle_type == "F" else "")
        print(f"| {name} | PyMGRIT | {iters_ref} | {cycle_ref * 1e3:.1f} | {total_ref:.2f} | 1 |")
        for kind, vectorized, floats in MPX_VARIANTS:
            best: tuple[float, float, int] | None = None
            for _ in range(2):
                solver = MGRIT(
                    dahlquist, 0.0, 5.0, NT, levels=levels, cfactor=cfactor, tol=TOL,
                    max_iters=50, vectorized=vectorized, float_times=floats,
                    cycle_type=cycle_type,
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


STEPS, WIDTH, BATCH, LEVELS, FWD_ITERS, BWD_ITERS = 128, 64, 128, 3, 2, 1
RESIDUAL_PLOT = "docs/figures/mgrit_residuals.png"


def layer_parallel() -> None:
    """Inside ``mpxrun -n P``: LayerParallel fwd+bwd on all ranks, serial on rank 0 alone.

    Prints a table row, then (rank 0) ``MODEL`` lines with the measured inputs of the
    speed-up model: the per-step cost, the work factor and one message's time.
    """
    import torch
    from mpi4py import MPI
    from torch import nn

    from mpx.collectives import recv, send, world
    from mpx.mgrit import LayerParallel

    comm = world()
    torch.set_num_threads(1)  # one core per rank; the serial network gets one core too

    def make(fwd_iters: int, bwd_iters: int) -> LayerParallel:
        torch.manual_seed(0)
        return LayerParallel(
            nn.Linear(64, WIDTH), nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()),
            nn.Linear(WIDTH, 10), num_steps=STEPS, Tf=2.0, levels=LEVELS, cfactor=2,
            fwd_iters=fwd_iters, bwd_iters=bwd_iters, tol=0.0,
        )  # fmt: skip

    net = make(FWD_ITERS, BWD_ITERS)
    serial = net.serial()
    x = torch.randn(BATCH, 64, generator=torch.Generator().manual_seed(1))

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
        return float(comm.mpi.allreduce(statistics.median(samples), op=MPI.MAX))

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
    # Convergence factor: a forward solve run to 8 iterations, residual ratios.
    # (float64: in float32 the residual stalls near 1e-5, at rounding level.)
    deep = make(8, 8).double()
    deep.zero_grad()
    torch.autograd.backward(deep(x.double()).square().sum())
    fwd, bwd = deep.fwd_stats()["residuals"], deep.bwd_stats()["residuals"]
    # Ratios above the rounding floor (~1e-13 in float64) only.
    ratios = [b / a for a, b in itertools.pairwise(fwd) if a > 0 and b > 1e-12]
    factor = statistics.geometric_mean(ratios) if ratios else float("nan")
    # One activation message (batch x width float32) between neighbours, one way.
    message = 0.0
    if comm.size > 1:
        buf = torch.zeros(BATCH, WIDTH)
        rounds = 200
        comm.mpi.Barrier()
        start = time.perf_counter()
        for _ in range(rounds):
            if comm.rank == 0:
                send(buf, 1, comm=comm)
                recv(buf, 1, comm=comm)
            elif comm.rank == 1:
                recv(buf, 0, comm=comm)
                send(buf, 0, comm=comm)
        message = (time.perf_counter() - start) / (2 * rounds)
        message = float(comm.mpi.bcast(message, root=0))
    comm.mpi.Barrier()
    if comm.rank == 0:
        print(
            f"| {comm.size} | {t_lp * 1e3:.1f} | {t_serial * 1e3:.1f} | {t_lp / t_serial:.2f} "
            f"| {factor:.3f} |",
            flush=True,
        )
        print(f"MODEL {comm.size} {t_lp} {t_serial} {message}", flush=True)
        if comm.size == 1:
            _plot_residuals(fwd, bwd)


def _plot_residuals(fwd: list[float], bwd: list[float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.semilogy(range(1, len(fwd) + 1), fwd, marker="o", label="forward (MGRIT)")
    ax.semilogy(range(1, len(bwd) + 1), bwd, marker="x", label="adjoint (backward)")
    ax.set(xlabel="iteration", ylabel="residual at C-points",
           title=f"LayerParallel, {STEPS} steps, {LEVELS} levels, float64")  # fmt: skip
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(RESIDUAL_PLOT), exist_ok=True)
    fig.savefig(RESIDUAL_PLOT, dpi=100)


def _speedup_model(rows: dict[int, tuple[float, float, float]]) -> None:
    """Speed-up over the serial network vs ranks, from the measured costs.

    T(P) = (w - s)·T_serial/P + s·T_serial + m·t_msg, with w = T_lp(1) / T_serial (all
    the work MGRIT does: iterations, nested start, coarse levels), s the part that
    stays serial (the coarsest grid, solved on one rank after another: STEPS /
    2^(LEVELS-1) steps per solve, FWD_ITERS + BWD_ITERS + 1 solves), t_msg one measured
    neighbour message, and m = 2·LEVELS·(FWD_ITERS + BWD_ITERS + 1) messages on the
    critical path of a forward + backward.
    """
    if 1 not in rows or 2 not in rows:
        return
    t_lp1, t_serial, _ = rows[1]
    t_msg = rows[2][2]
    work = t_lp1 / t_serial
    solves = FWD_ITERS + BWD_ITERS + 1
    serial_part: float = min(work, solves * (STEPS / 2 ** (LEVELS - 1)) / STEPS)
    messages = 2 * LEVELS * solves
    print(
        f"\nSpeed-up model (not measured beyond 3 ranks): T(P) = (w - s)·T_serial/P + "
        f"s·T_serial + m·t_msg with w = {work:.1f} (measured T_lp(1) ÷ T_serial), s = "
        f"{serial_part:.1f} (the coarsest grid, {STEPS // 2 ** (LEVELS - 1)} steps solved "
        f"serially in each of {solves} solves), t_msg = {t_msg * 1e6:.0f} µs (one "
        f"{BATCH}×{WIDTH} float32 activation, measured), m = {messages} messages per "
        "forward + backward.\n"
    )
    print("| ranks P | model T(P) (ms) | model speed-up over serial |")
    print("|---|---|---|")

    def model(p: int) -> float:
        return (
            (work - serial_part) * t_serial / p
            + serial_part * t_serial
            + (messages * t_msg if p > 1 else 0.0)
        )

    for p in (1, 2, 4, 8, 16, 32, 64):
        print(f"| {p} | {model(p) * 1e3:.1f} | {t_serial / model(p):.2f} |")
    bound = 1.0 / serial_part if serial_part else float("inf")
    print(
        f"\nWith {LEVELS} levels and cfactor 2 the serial coarsest grid bounds the speed-up "
        f"by 1/s = {bound:.1f}×, whatever the rank count: this configuration (torchbraid's "
        "training default of few iterations) cannot beat the serial network on a CPU. "
        "torchbraid reports up to 6.5× for a parallel-in-time GRU (ICLR 2022) and about 10× "
        "with data parallelism added, on GPUs with deeper hierarchies (cfactor 4, more "
        "levels), where s is small and a step is expensive; mpx has the same algorithm and "
        "knobs (`levels`, `cfactor`), but we have not measured such a configuration beyond "
        "3 CPU ranks.\n"
    )
    print(f"![residual histories]({RESIDUAL_PLOT})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--inside", choices=["solvers", "lp"], help=argparse.SUPPRESS)
    parser.add_argument(
        "--ranks",
        default="1,2,3",
        help="rank counts of the layer-parallel rows, comma-separated (default 1,2,3)",
    )
    parser.add_argument("--skip-solvers", action="store_true", help="no MGRIT vs PyMGRIT table")
    parser.add_argument(
        "--cycles", default="V,F", help="cycle types of the solver rows: V, F or V,F (default)"
    )
    args = parser.parse_args()
    cycles = [c.strip() for c in args.cycles.split(",") if c.strip()]
    if not cycles or any(c not in ("V", "F") for c in cycles):
        parser.error(f"--cycles must list V and/or F, got {args.cycles!r}")
    if args.inside == "solvers":
        solvers(cycles)
        return
    if args.inside == "lp":
        layer_parallel()
        return
    mpxrun = shutil.which("mpxrun", path=os.path.dirname(sys.executable)) or "mpxrun"

    def job(nprocs: int, what: str) -> None:
        cmd = [mpxrun, "-n", str(nprocs), "--timeout", "600", "--", sys.executable]
        inner = [os.path.abspath(__file__), "--inside", what, "--cycles", ",".join(cycles)]
        subprocess.run([*cmd, *inner], check=True)

    print("## mpx-mgrit: MGRIT solver vs PyMGRIT, layer-parallel vs serial\n")
    print(
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, MPICH wheel "
        "(`python packages/mgrit/benchmarks/bench_mgrit.py`).\n"
    )
    if not args.skip_solvers:
        print(
            f"Dahlquist u' = -u on [0, 5], backward Euler, {NT} steps, one rank, tol {TOL:g}, "
            "V-cycles (and F-cycles where marked) with FCF relaxation and nested start in both. "
            "A cycle's time includes its residual; total = set-up + initial guess + cycles. "
            "Ratio = mpx ÷ PyMGRIT time per cycle (lower is better).\n"
        )
        print("| grid | solver | iterations | ms per cycle | total (s) | ÷ PyMGRIT |")
        print("|---|---|---|---|---|---|")
        sys.stdout.flush()
        job(1, "solvers")
    print(
        f"\nLayer-parallel forward + backward ({STEPS} steps of width {WIDTH}, batch {BATCH}, "
        f"float32, {LEVELS} levels, cfactor 2, {FWD_ITERS} forward / {BWD_ITERS} adjoint "
        "V-cycles) beside the serial network in the same job (rank 0 alone), one torch thread "
        "per rank. Time: median of 7, slowest rank. Ratio = mpx ÷ serial (lower is better); "
        "convergence factor = geometric mean of successive forward residual ratios over 8 "
        "iterations in float64; 3 ranks on 2 cores are oversubscribed.\n"
    )
    print("| ranks | layer-parallel (ms) | serial (ms) | ÷ serial | convergence factor |")
    print("|---|---|---|---|---|")
    sys.stdout.flush()
    rows: dict[int, tuple[float, float, float]] = {}
    for nprocs in (int(n) for n in args.ranks.split(",")):
        cmd = [mpxrun, "-n", str(nprocs), "--timeout", "600", "--", sys.executable]
        done = subprocess.run(
            [*cmd, os.path.abspath(__file__), "--inside", "lp"],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        for line in done.stdout.splitlines():
            if line.startswith("MODEL "):
                _, p, t_lp, t_serial, t_msg = line.split()
                rows[int(p)] = (float(t_lp), float(t_serial), float(t_msg))
            else:
                print(line, flush=True)
    _speedup_model(rows)


if __name__ == "__main__":
    main()
