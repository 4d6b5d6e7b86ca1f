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
2. ``LayerParallel`` (256 residual steps, width 128, batch 128, 3 levels, cfactor 4,
   1 forward and 1 adjoint V-cycle: issue 42's configuration) forward + backward,
   unbatched and batched, beside the serial network (``.serial()``, plain autograd)
   in the same job, timed on rank 0 alone; the performance model
   (:mod:`mpx.mgrit.model`) priced with costs measured in the same job, and its
   predictions at 16, 64 and 256 ranks.
3. With ``--gru``: ``ParallelGRU`` (batched and ``batched=False``) forward + backward
   beside ``torch.nn.GRU`` with the same weights at T = 1024 and 4096 (input 32, hidden
   64, batch 16, one thread), and the work of each (issue 42's item 3).
   ``--skip-lp`` leaves out section 2.

Nothing is written but the section on stdout, unless ``--residual-plot PATH`` asks for
the plot of the forward and adjoint residual histories (from the 1-rank layer-parallel
job; docs/choosing.md shows docs/figures/mgrit_residuals.png, redrawn by
``--skip-solvers --ranks 1 --residual-plot docs/figures/mgrit_residuals.png``).
Each inner ``mpxrun`` job is limited by ``--timeout`` (default: 600 s, times the
1-minute load per core when the machine is busier than one process a core).
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
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


STEPS, WIDTH, BATCH, LEVELS, CFACTOR, FWD_ITERS, BWD_ITERS = 256, 128, 128, 3, 4, 1, 1
BASE_TIMEOUT_S = 600  # an inner job's limit on an idle machine (--gru's takes ~2 min)
KINDS = ("forward", "adjoint", "linearize", "gradient")


def _contention(comm: Any, rows: int = 16) -> float:
    """How much slower a batched step runs with every rank computing than on rank 0
    alone (measured: other ranks and other jobs share the cores)."""
    import torch
    from torch import nn

    from mpx.mgrit.adjoint import StackedSteps

    torch.manual_seed(3)
    stacked = StackedSteps.of([nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())] * rows)
    assert stacked is not None
    stacked.refresh()
    x = torch.randn(rows, BATCH, WIDTH)

    def work() -> None:
        with torch.no_grad():
            stacked.step(x, 0, 1, 0.1)

    return float(_measures().contention(comm, work))


def _measures() -> Any:
    """lp_measures, from this script's folder (on the path: the script's own)."""
    return importlib.import_module("lp_measures")


def layer_parallel(residual_plot: str | None) -> None:
    """Inside ``mpxrun -n P``: LayerParallel fwd+bwd on all ranks, serial on rank 0 alone.

    Prints a table row, then (rank 0) a ``MODEL`` line (json) with the measured times
    and the model's measured costs; at one rank, draws the residual histories into
    ``residual_plot`` if given.
    """
    import torch
    from mpi4py import MPI
    from torch import nn

    from mpx.collectives import world
    from mpx.mgrit import LayerParallel, work

    comm = world()
    torch.set_num_threads(1)  # one core per rank; the serial network gets one core too

    def make(fwd_iters: int, bwd_iters: int, batched: bool = True) -> LayerParallel:
        torch.manual_seed(0)
        return LayerParallel(
            nn.Linear(64, WIDTH), nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()),
            nn.Linear(WIDTH, 10), num_steps=STEPS, Tf=2.0, levels=LEVELS, cfactor=CFACTOR,
            fwd_iters=fwd_iters, bwd_iters=bwd_iters, tol=0.0, batched=batched,
        )  # fmt: skip

    net = make(FWD_ITERS, BWD_ITERS)
    serial = net.serial()
    x = torch.randn(BATCH, 64, generator=torch.Generator().manual_seed(1))

    def step_of(model: nn.Module) -> Any:
        def step() -> None:
            model.zero_grad()
            torch.autograd.backward(model(x).square().sum())

        return step

    def timed(fn: Any, repeats: int = 7) -> float:
        fn()
        samples = []
        for _ in range(repeats):
            comm.mpi.Barrier()
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return float(comm.mpi.allreduce(statistics.median(samples), op=MPI.MAX))

    # The layer-parallel step (every rank) and the serial network (rank 0 alone) timed in
    # turn, sample by sample: on a loaded machine the load drifts between two separate
    # timing loops, so the ratio is the median of the samples' own ratios.
    run_lp, run_serial = step_of(net), step_of(serial)
    run_lp()
    if comm.rank == 0:
        run_serial()
    lp_samples, serial_samples, last = [], [], 0.0
    for _ in range(9):
        comm.mpi.Barrier()
        start = time.perf_counter()
        run_lp()
        last = time.perf_counter() - start
        lp_samples.append(float(comm.mpi.allreduce(last, op=MPI.MAX)))
        t_one = 0.0
        if comm.rank == 0:
            start = time.perf_counter()
            run_serial()
            t_one = time.perf_counter() - start
        _measures().wait_politely(comm)
        serial_samples.append(float(comm.mpi.bcast(t_one, root=0)))
    t_lp, t_serial = statistics.median(lp_samples), statistics.median(serial_samples)
    ratio = statistics.median(a / b for a, b in zip(lp_samples, serial_samples, strict=True))
    # The last run's time inside the stacked steps, and its own duration: the model's costs.
    seconds = dict(net.stepper.seconds)
    counted = comm.mpi.allgather(work(net))
    t_unbatched = timed(step_of(make(FWD_ITERS, BWD_ITERS, batched=False)), 3)
    # One activation message (batch x width float32) between neighbours, one way.
    message = float(_measures().message_seconds(comm, torch.zeros(BATCH, WIDTH), rounds=200))
    contention = _contention(comm)
    # Convergence factor: a forward solve run to 8 iterations, residual ratios.
    # (float64: in float32 the residual stalls near 1e-5, at rounding level.)
    deep = make(8, 8).double()
    deep.zero_grad()
    torch.autograd.backward(deep(x.double()).square().sum())
    fwd, bwd = deep.fwd_stats()["residuals"], deep.bwd_stats()["residuals"]
    ratios = [b / a for a, b in itertools.pairwise(fwd) if a > 0 and b > 1e-12]
    factor = statistics.geometric_mean(ratios) if ratios else float("nan")
    comm.mpi.Barrier()
    if comm.rank == 0:
        busiest = max(counted, key=lambda c: sum(c.values()))
        record = {
            "size": comm.size, "t_lp": t_lp, "t_unbatched": t_unbatched, "t_serial": t_serial,
            "ratio": ratio,
            "message": message, "seconds": seconds, "last": last, "work": busiest,
            "factor": factor, "load": os.getloadavg()[0], "contention": contention,
        }  # fmt: skip
        print("MODEL " + json.dumps(record), flush=True)
        if comm.size == 1 and residual_plot is not None:
            _plot_residuals(fwd, bwd, residual_plot)


GRU_INPUT, GRU_HIDDEN, GRU_BATCH, GRU_LENGTHS = 32, 64, 16, (1024, 4096)


def gru() -> None:
    """Inside ``mpxrun -n 1``: ParallelGRU (batched and not) forward + backward beside
    torch.nn.GRU with the same weights, one thread, float32; one table row per length."""
    import torch

    torch.set_num_threads(1)
    for length in GRU_LENGTHS:
        _gru_row(length)


def _gru_row(length: int) -> None:
    import torch
    from torch import nn

    from mpx.mgrit import ParallelGRU, work

    x = torch.randn(length, GRU_BATCH, GRU_INPUT, generator=torch.Generator().manual_seed(1))

    def timed(module: nn.Module, repeats: int) -> float:
        def run() -> None:
            module.zero_grad()
            out, h_n = module(x)
            torch.autograd.backward(out.square().sum() + h_n.sum())

        run()
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    times, counts = {}, {}
    for name, batched in (("batched", True), ("unbatched", False)):
        torch.manual_seed(0)
        par = ParallelGRU(GRU_INPUT, GRU_HIDDEN, levels=3, cfactor=4, fwd_iters=1, bwd_iters=1,
                          batched=batched)  # fmt: skip
        times[name] = timed(par, 3 if batched else 1)
        counts[name] = work(par)
    ref = nn.GRU(GRU_INPUT, GRU_HIDDEN)
    ref.load_state_dict(par.state_dict())
    t_ref = timed(ref, 3)
    c = counts["batched"]
    print(
        f"| {length} | {t_ref * 1e3:.0f} | {times['unbatched'] * 1e3:.0f} | "
        f"{times['batched'] * 1e3:.0f} | {times['unbatched'] / t_ref:.1f} | "
        f"**{times['batched'] / t_ref:.1f}** | {c['forward']}/{c['adjoint']}/{c['linearize']} | "
        f"{counts['unbatched']['linearize']} | {os.getloadavg()[0]:.1f} |",
        flush=True,
    )


def _plot_residuals(fwd: list[float], bwd: list[float], path: str) -> None:
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
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)


def _table(rows: dict[int, dict[str, Any]]) -> None:
    """The measured rows beside the model's, and its predictions at 16, 64 and 256 ranks.

    The model's costs come from the 1-rank job alone (its last run: time inside the
    stacked steps per row and per single-row call, the rest per owned step); the
    2- and 3-rank rows are predictions from them, with the message time measured in
    their own job and ranks beyond the cores sharing them.
    """
    from mpx.mgrit.model import costs_of, count, predict

    cores = os.cpu_count() or 1
    one = rows.get(1)
    costs = None
    if one is not None:
        work1 = count(STEPS, LEVELS, CFACTOR, FWD_ITERS, BWD_ITERS, 1)
        costs = costs_of(one["seconds"], work1, one["last"], cores=cores)
    for p, r in sorted(rows.items()):
        model, error = "", ""
        if costs is not None:
            costs.message = r["message"]
            # The compute of this job shares the cores as measured in it (1 rank: none).
            costs.cores = p / r["contention"] if p > 1 else 1.0
            work = count(STEPS, LEVELS, CFACTOR, FWD_ITERS, BWD_ITERS, p, costs=costs)
            t = predict(work, costs, p)
            model, error = f"{t * 1e3:.1f}", f"{(t - r['t_lp']) / r['t_lp']:+.0%}"
        w = r["work"]
        print(
            f"| {p} | {r['t_unbatched'] * 1e3:.1f} | {r['t_lp'] * 1e3:.1f} | "
            f"{r['t_serial'] * 1e3:.1f} | {r['t_unbatched'] / r['t_serial']:.2f} | "
            f"**{r['ratio']:.2f}** | {model} | {error} | {w['forward']}/"
            f"{w['adjoint']}/{w['linearize']}/{w['gradient']} | {r['factor']:.3f} | "
            f"{r['contention']:.2f} | {r['load']:.1f} |"
        )
    if costs is None or one is None or 2 not in rows:
        return
    costs.message = rows[2]["message"]
    costs.cores = float(1 << 30)  # a large machine: one core a rank
    per_step_serial = one["t_serial"] / STEPS
    print(
        f"\nModel (`mpx.mgrit.model`): the training step replayed on every rank's clock "
        f"(ghost rows waited for, intervals relaxed as chains across ranks, the coarsest "
        f"level passed rank after rank, residual gathers); its critical path priced as "
        f"Σ_kind (batched rows · row cost + single-row calls · call cost) + owned steps · "
        f"rest + messages · t_msg. Costs from the 1-rank job: a batched row "
        f"{costs.row['forward'] * 1e6:.0f} µs forward, "
        f"{costs.row['adjoint'] * 1e6:.0f} µs adjoint, {costs.row['linearize'] * 1e6:.0f} µs "
        f"linearise, {costs.row['gradient'] * 1e6:.0f} µs gradient; a single-row call "
        f"{costs.single['forward'] * 1e6:.0f} / {costs.single['adjoint'] * 1e6:.0f} µs; the "
        f"rest {costs.per_step * 1e6:.0f} µs per owned step; t_msg = "
        f"{rows[2]['message'] * 1e6:.0f} µs (2-rank job). Serial network: "
        f"{per_step_serial * 1e6:.0f} µs a step (forward + backward). Predictions assume one "
        "core a rank. *fine*: the fine grid split in whole fine C-intervals (MGRIT's, "
        "LayerParallel's and ParallelGRU's: every rank works at every depth); *coarsest*: "
        "whole coarsest intervals (every network's before issue 56). Best: "
        "the fastest of 2-6 levels, cfactor 4 (2 where 4 does not divide).\n"
    )
    print(
        "| config | ranks P | layout | best levels | model T(P) (ms) | serial (ms) "
        "| model speed-up | torchbraid (published) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    ref = "~10× (layer- and data-parallel, GPUs); 6.5× (parallel-in-time GRU)"
    for n, fi, bi in ((STEPS, 1, 1), (1024, 2, 1), (1024, 1, 1)):
        for p in (16, 64, 256, 1024):
            for layout in ("coarsest", "fine"):
                t, levels = _best(n, fi, bi, p, layout, costs)
                print(f"| {n} steps, {fi}+{bi} V-cycles | {p} | {layout} | {levels} | "
                      f"{t * 1e3:.1f} | {n * per_step_serial * 1e3:.1f} | "
                      f"{n * per_step_serial / t:.2f} | "
                      f"{ref if p == 16 and layout == 'fine' else ''} |")  # fmt: skip
    print(
        "\nOn the coarsest layout ranks beyond the coarsest intervals hold nothing, so more "
        "ranks stop helping once they outnumber them; on the fine layout every rank holds "
        "N / P fine steps and the coarsest level can be a handful of points.\n"
    )


def _best(n: int, fi: int, bi: int, p: int, layout: str, costs: Any) -> tuple[float, int]:
    """The model's fastest time over 2-6 levels (cfactor 4) and that level count."""
    from mpx.mgrit.model import count, predict

    best: tuple[float, int] | None = None
    for levels in range(2, 7):
        if n % CFACTOR ** (levels - 1):
            continue
        t = predict(count(n, levels, CFACTOR, fi, bi, p, layout=layout, costs=costs), costs, p)
        if best is None or t < best[0]:
            best = (t, levels)
    assert best is not None
    return best


def _default_timeout() -> int:
    """BASE_TIMEOUT_S, scaled by how oversubscribed the machine is now (the jobs run at the
    speed they get: a fixed 600 s failed ``--gru`` on a loaded 2-core machine)."""
    busy = os.getloadavg()[0] / (os.cpu_count() or 1)
    return int(BASE_TIMEOUT_S * max(1.0, busy))


def main() -> None:
    parser = argparse.ArgumentParser(
        description="MGRIT beside PyMGRIT, layer-parallel training beside the serial network: "
        "prints one markdown section; writes no file unless --residual-plot is given."
    )
    parser.add_argument("--inside", choices=["solvers", "lp", "gru"], help=argparse.SUPPRESS)
    parser.add_argument(
        "--ranks",
        default="1,2,3",
        help="rank counts of the layer-parallel rows, comma-separated (default 1,2,3)",
    )
    parser.add_argument("--skip-solvers", action="store_true", help="no MGRIT vs PyMGRIT table")
    parser.add_argument(
        "--gru",
        action="store_true",
        help="add ParallelGRU vs torch.nn.GRU at T = 1024 and 4096 (about 2 minutes)",
    )
    parser.add_argument("--skip-lp", action="store_true", help="no layer-parallel table")
    parser.add_argument(
        "--timeout", type=int, default=None, metavar="S",
        help=f"each inner mpxrun job's limit in seconds (default {BASE_TIMEOUT_S}, times the "
        "1-minute load per core where it is above 1: now "
        f"{_default_timeout()} s)",
    )  # fmt: skip
    parser.add_argument(
        "--residual-plot", metavar="PATH",
        help="draw the layer-parallel residual histories (the 1-rank job's, float64) into "
        "PATH, a PNG, and link it from the section (nothing is drawn by default; "
        "docs/figures/mgrit_residuals.png is the repository's copy)",
    )  # fmt: skip
    parser.add_argument(
        "--cycles", default="V,F", help="cycle types of the solver rows: V, F or V,F (default)"
    )
    args = parser.parse_args()
    if args.timeout is None:
        args.timeout = _default_timeout()
    if args.timeout <= 0:
        parser.error(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if args.residual_plot is not None and (args.skip_lp or "1" not in args.ranks.split(",")):
        parser.error(
            "--residual-plot draws the 1-rank layer-parallel job's residuals: "
            f"it needs 1 in --ranks (got {args.ranks!r}) and no --skip-lp"
        )
    cycles = [c.strip() for c in args.cycles.split(",") if c.strip()]
    if not cycles or any(c not in ("V", "F") for c in cycles):
        parser.error(f"--cycles must list V and/or F, got {args.cycles!r}")
    if args.inside == "solvers":
        solvers(cycles)
        return
    if args.inside == "lp":
        layer_parallel(args.residual_plot)
        return
    if args.inside == "gru":
        gru()
        return
    mpxrun = shutil.which("mpxrun", path=os.path.dirname(sys.executable)) or "mpxrun"

    def job(nprocs: int, what: str) -> None:
        cmd = [mpxrun, "-n", str(nprocs), "--timeout", str(args.timeout), "--", sys.executable]
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
    if not args.skip_lp:
        plot = None if args.residual_plot is None else os.path.abspath(args.residual_plot)
        _layer_parallel_section(mpxrun, args.ranks, args.timeout, plot, args.residual_plot)
    if args.gru:
        print(
            f"\nParallelGRU beside torch.nn.GRU (same weights; input {GRU_INPUT}, hidden "
            f"{GRU_HIDDEN}, batch {GRU_BATCH}, float32, one layer; ParallelGRU's defaults but "
            "3 levels, cfactor 4, 1 forward and 1 adjoint V-cycle), forward + backward, one "
            "thread, one rank; median of 3 (unbatched: 1). Work: the batched module's "
            "forward/adjoint/linearise rows, `mpx.mgrit.work`; unbatched, every adjoint "
            "product replays its forward (linearise = adjoint). Load: 1-minute load average.\n"
        )
        print(
            "| T | nn.GRU (ms) | unbatched (ms) | batched (ms) | unbatched ÷ nn.GRU | "
            "batched ÷ nn.GRU | work (batched) | linearise (unbatched) | load |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        sys.stdout.flush()
        job(1, "gru")


def _layer_parallel_section(
    mpxrun: str, ranks: str, timeout: int, plot: str | None, plot_link: str | None
) -> None:
    print(
        f"\nLayer-parallel forward + backward ({STEPS} residual steps x + h·tanh(Wx + b) of width "
        f"{WIDTH}, batch {BATCH}, float32, {LEVELS} levels, cfactor {CFACTOR}, {FWD_ITERS} "
        f"forward / {BWD_ITERS} adjoint V-cycle) beside the serial network in the same job "
        "(rank 0 alone), one torch thread per rank. Time: median of 9 (3 unbatched), slowest "
        "rank; batched ÷ serial: the median of the samples' own ratios (the serial network "
        "timed on rank 0 after each layer-parallel sample, so both see the same load). "
        "Unbatched = one module call per step (`batched=False`, the code before issue 42); "
        "batched = stacked weights (the default). ÷ serial: lower is better. Model: "
        "`mpx.mgrit.model` with the costs measured in the same job. Work: layer evaluations "
        "(forward/adjoint/linearise/gradient rows) of the busiest rank, `mpx.mgrit.work(net)`. "
        "Convergence factor: geometric mean of forward residual ratios over 8 iterations in "
        "float64. Contention: a batched step's time with every rank computing ÷ rank 0 alone, "
        "measured in the job (the model's compute at 2 and 3 ranks is scaled by it). Load: "
        "1-minute load average at the end; 3 ranks on 2 cores are oversubscribed.\n"
    )
    print(
        "| ranks | unbatched (ms) | batched (ms) | serial (ms) | unbatched ÷ serial | "
        "batched ÷ serial | model (ms) | model error | work | convergence factor | "
        "contention | load |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    sys.stdout.flush()
    rows: dict[int, dict[str, Any]] = {}
    for nprocs in (int(n) for n in ranks.split(",")):
        cmd = [mpxrun, "-n", str(nprocs), "--timeout", str(timeout), "--", sys.executable]
        inner = [os.path.abspath(__file__), "--inside", "lp"]
        if plot is not None and nprocs == 1:
            inner += ["--residual-plot", plot]
        done = subprocess.run(
            [*cmd, *inner],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        for line in done.stdout.splitlines():
            if line.startswith("MODEL "):
                record = json.loads(line[len("MODEL ") :])
                rows[int(record["size"])] = record
            else:
                print(line, flush=True)
    _table(rows)
    if plot_link is not None:
        print(f"\n![residual histories]({plot_link})")


if __name__ == "__main__":
    main()
