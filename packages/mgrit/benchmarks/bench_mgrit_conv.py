"""MGRIT layer-parallel training with a convolutional ResNet step, beside the serial network.

``bench_mgrit.py`` measures a width-128 MLP step, which ``LayerParallel`` stacks into
batched products. torchbraid's MNIST example trains a convolutional ResNet instead::

    open: Conv2d(1, C, 3, padding=1)      (images 1 x 28 x 28)
    N steps: x + h * ReLU(Conv2d(C, C, 3, padding=1)(x)),  h = Tf / N,  no BatchNorm
    close: MaxPool2d(3), Flatten, Linear(C * 9 * 9, 10)

A convolution cannot be stacked (:meth:`mpx.mgrit.adjoint.stacked.StackedSteps.of` takes only
``Linear`` steps and returns None for these), so every step is one module call, each
one costing a millisecond or more at C = 32, batch 8, one thread: the regime where the
solver's own bookkeeping matters least and layer-parallelism should pay off first.

``python bench_mgrit_conv.py`` starts itself under ``mpxrun -n 1`` and ``-n 2`` and
prints one markdown section. Each job times ``LayerParallel`` (3 levels, cfactor 4, 2
forward and 1 adjoint V-cycle: torchbraid's usual settings) forward + backward on
every rank, and the serial network (``net.serial()``, plain autograd) on rank 0 alone,
sample by sample, at 64 and 256 steps; it checks once per step count that the layer-
parallel output and gradients agree with the serial ones (inexact on purpose: 2 + 1
V-cycles, so a loose tolerance), and measures directly, on rank 0 beside every timed
sample (the same load), the per-layer costs that :mod:`mpx.mgrit.model` prices the work with:

* forward: one step ``x + h f(x)`` without autograd (a forward relaxation step);
* adjoint: one step with a graph and its vector-Jacobian product in x (an unbatched
  adjoint step linearises again each time, so the model's adjoint calls carry it);
* linearize: one step with a graph (the final sweep's forward);
* gradient: the vector-Jacobian product in x and the parameters on that graph;

one state message between neighbours (2-rank job), and the contention of the 2 cores.
For unbatched steps a batched row and a single-row call cost the same (one module call
each), so the model gets the same cost for both. Its predicted time and speed-up over
serial at 16 to 1024 ranks for 1024 steps (3 levels, and the best of 2 to 6 levels), on
the split LayerParallel used before issue 56 (whole coarsest intervals a rank) and on
its fine split (whole fine C-intervals),
follow the measured table, with its error at 1 and 2 ranks. ``--smoke`` runs a tiny
configuration (16 steps, 4 channels, 8 x 8 images, 1 rank) in seconds, for the tests.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

LEVELS, CFACTOR, FWD_ITERS, BWD_ITERS, TF = 3, 4, 2, 1, 1.0
KINDS = ("forward", "adjoint", "linearize", "gradient")
PREDICT_STEPS, PREDICT_RANKS, LEVEL_CHOICES = 1024, (16, 64, 256, 1024), (2, 3, 4, 5, 6)
#: fine: LayerParallel's split (whole fine C-intervals); coarsest: its split before issue 56
LAYOUTS = ("coarsest", "fine")
#: LayerParallel vs serial, relative: 2 forward / 1 adjoint V-cycle do not converge fully
OUTPUT_TOL, GRADIENT_TOL = 1e-2, 1e-1


@dataclass(frozen=True)
class Config:
    """One benchmark configuration: the network's sizes, and the samples per step count."""

    channels: int
    size: int  # image side
    batch: int
    steps: tuple[int, ...]
    repeats: tuple[int, ...]  # timed samples, one entry per step count
    ranks: tuple[int, ...]

    def close_features(self) -> int:
        return self.channels * (self.size // 3) ** 2


def config(smoke: bool, channels: int, batch: int) -> Config:
    if smoke:
        return Config(channels=4, size=8, batch=2, steps=(16,), repeats=(1,), ranks=(1,))
    return Config(channels, 28, batch, steps=(64, 256), repeats=(5, 3), ranks=(1, 2))


# -- inside mpxrun -----------------------------------------------------------------------


def _measures() -> Any:
    """lp_measures, from this script's folder (on the path: the script's own)."""
    return importlib.import_module("lp_measures")


def _median_time(fn: Any, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def build(cfg: Config, steps: int, comm: Any) -> Any:
    """The LayerParallel network (the same weights on any number of ranks)."""
    import torch
    from torch import nn

    from mpx.mgrit import LayerParallel

    c = cfg.channels
    torch.manual_seed(0)
    return LayerParallel(
        nn.Conv2d(1, c, 3, padding=1),
        lambda: nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.ReLU()),
        nn.Sequential(nn.MaxPool2d(3), nn.Flatten(), nn.Linear(cfg.close_features(), 10)),
        num_steps=steps, Tf=TF, comm=comm, levels=LEVELS, cfactor=CFACTOR,
        fwd_iters=FWD_ITERS, bwd_iters=BWD_ITERS, tol=0.0,
    )  # fmt: skip


def layer_costs(step: Any, x: Any, h: float, repeats: int = 15) -> dict[str, float]:
    """Seconds of one step layer's work, by the model's kinds (see the module doc)."""
    import torch

    lam = torch.randn_like(x)
    params = [p for p in step.parameters() if p.requires_grad]

    def phi(state: Any) -> Any:
        return state + h * step(state)

    def forward() -> None:
        with torch.no_grad():
            phi(x)

    def adjoint() -> None:
        xg = x.detach().requires_grad_(True)
        torch.autograd.grad(phi(xg), xg, lam)

    def linearize() -> Any:
        xg = x.detach().requires_grad_(True)
        return xg, phi(xg)

    def sweep() -> None:
        xg, out = linearize()
        torch.autograd.grad(out, [xg, *params], lam)

    costs = {k: _median_time(fn, repeats) for k, fn in
             (("forward", forward), ("adjoint", adjoint), ("linearize", linearize))}  # fmt: skip
    costs["gradient"] = max(_median_time(sweep, repeats) - costs["linearize"], 0.0)
    return costs


def _agreement(net: Any, serial: Any, x: Any, y: Any, comm: Any) -> tuple[float, float]:
    """Relative output error and the largest relative gradient error, LayerParallel vs serial."""
    import torch
    from mpi4py import MPI

    outs = []
    for model in (net, serial):
        model.zero_grad()
        out = model(x)
        torch.nn.functional.cross_entropy(out, y).backward()
        outs.append(out.detach())
    out_err = float((outs[0] - outs[1]).abs().max() / outs[1].abs().max())
    ref = dict(serial.named_parameters())
    grad_err = 0.0
    for name, p in net.named_parameters():
        key = name
        if name.startswith("local_steps."):  # local step k is the serial network's step first + k
            _, k, rest = name.split(".", 2)
            key = f"steps.{int(k) + net.first_step}.{rest}"
        g, g_ref = p.grad, ref[key].grad
        assert g is not None, name
        assert g_ref is not None, key
        grad_err = max(grad_err, float((g - g_ref).norm() / g_ref.norm().clamp_min(1e-30)))
    return out_err, float(comm.mpi.allreduce(grad_err, op=MPI.MAX))


def _row(cfg: Config, steps: int, repeats: int, comm: Any) -> dict[str, Any]:
    """LayerParallel on every rank and the serial network on rank 0 alone, in turn."""
    import torch
    from mpi4py import MPI

    from mpx.mgrit import work

    net = build(cfg, steps, comm)
    serial = net.serial()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(cfg.batch, 1, cfg.size, cfg.size, generator=gen)
    y = torch.randint(0, 10, (cfg.batch,), generator=gen)
    out_err, grad_err = _agreement(net, serial, x, y, comm)  # also the warm-up

    def run(model: Any) -> None:
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()

    # The per-layer costs are measured beside every sample, under the same load (rank 0
    # alone, the others asleep: one core's costs, as the model prices them).
    step, state = net.local_steps[0], net.open_layer(x).detach()
    lp_samples, serial_samples, cost_samples = [], [], []
    for _ in range(repeats):
        comm.mpi.Barrier()
        start = time.perf_counter()
        run(net)
        lp_samples.append(float(comm.mpi.allreduce(time.perf_counter() - start, op=MPI.MAX)))
        t_one = 0.0
        if comm.rank == 0:
            start = time.perf_counter()
            run(serial)
            t_one = time.perf_counter() - start
            cost_samples.append(layer_costs(step, state, TF / steps, repeats=5))
        _measures().wait_politely(comm)
        serial_samples.append(float(comm.mpi.bcast(t_one, root=0)))
    counted = comm.mpi.allgather(work(net))
    record = {
        "size": comm.size, "steps": steps, "t_lp": statistics.median(lp_samples),
        "t_serial": statistics.median(serial_samples),
        "ratio": statistics.median(a / b for a, b in zip(lp_samples, serial_samples, strict=True)),
        "out_err": out_err, "grad_err": grad_err, "stacked": net.stepper.stacked is not None,
        "work": max(counted, key=lambda c: sum(c.values())), "load": os.getloadavg()[0],
        "costs": {k: statistics.median(c[k] for c in cost_samples) for k in KINDS}
        if cost_samples else {},
    }  # fmt: skip
    net.close()
    return record


def _message(cfg: Config, comm: Any) -> float:
    """One state (batch x C x size x size float32) between ranks 0 and 1, one way."""
    import torch

    buf = torch.zeros(cfg.batch, cfg.channels, cfg.size, cfg.size)
    return float(_measures().message_seconds(comm, buf))


def _contention(step: Any, x: Any, comm: Any) -> float:
    """A step's forward with every rank computing ÷ rank 0 alone (the cores are shared)."""
    import torch

    def work() -> None:
        with torch.no_grad():
            for _ in range(3):
                x + step(x)

    return float(_measures().contention(comm, work))


def inside(cfg: Config) -> None:
    """Inside ``mpxrun -n P``: prints ``ROW`` json lines (one per step count, with the
    per-layer costs) and one ``JOB`` line (the message time, the contention) on rank 0."""
    import torch

    from mpx.collectives import world

    comm = world()
    torch.set_num_threads(1)  # one core a rank; the serial network gets one core too
    for steps, repeats in zip(cfg.steps, cfg.repeats, strict=True):
        record = _row(cfg, steps, repeats, comm)
        if comm.rank == 0:
            print("ROW " + json.dumps(record), flush=True)
    net = build(cfg, cfg.steps[0], comm)
    step = net.local_steps[0]
    x = net.open_layer(torch.randn(cfg.batch, 1, cfg.size, cfg.size)).detach()
    record = {"size": comm.size, "message": _message(cfg, comm),
              "contention": _contention(step, x, comm)}  # fmt: skip
    net.close()
    if comm.rank == 0:
        print("JOB " + json.dumps(record), flush=True)


# -- the report ----------------------------------------------------------------------------


def model_costs(layer: dict[str, float], message: float, cores: float) -> Any:
    """The model's costs of unbatched steps: a row and a single-row call cost the same."""
    from mpx.mgrit.model import Costs

    return Costs(row=dict(layer), single=dict(layer), message=message, cores=cores)


def predicted(steps: int, levels: int, size: int, costs: Any, layout: str) -> float | None:
    """The model's seconds of one forward + backward on ``layout`` (its critical path under
    ``costs``), or None where the grid does not fit."""
    from mpx.mgrit import MGRITConfigError
    from mpx.mgrit.model import count, predict

    try:
        work = count(steps, levels, CFACTOR, FWD_ITERS, BWD_ITERS, size, layout=layout,
                     costs=costs)  # fmt: skip
    except MGRITConfigError:
        return None
    return predict(work, costs, size)


def prediction_rows(layer: dict[str, float], message: float, serial_step: float) -> list[str]:
    """The predictions table's rows: 1024 steps at 16 to 1024 ranks on each layout, one
    core a rank."""
    costs = model_costs(layer, message, cores=float(1 << 30))
    serial = PREDICT_STEPS * serial_step
    rows = []
    for p in PREDICT_RANKS:
        for layout in LAYOUTS:
            t = predicted(PREDICT_STEPS, LEVELS, p, costs, layout)
            assert t is not None
            tried = [(lv, predicted(PREDICT_STEPS, lv, p, costs, layout)) for lv in LEVEL_CHOICES]
            best_lv, best = min(((lv, s) for lv, s in tried if s is not None), key=lambda c: c[1])
            rows.append(
                f"| {p} | {layout} | {t * 1e3:.1f} | {serial * 1e3:.1f} | **{serial / t:.2f}** "
                f"| {best_lv} | {best * 1e3:.1f} | {serial / best:.2f} |"
            )
    return rows


MEASURED_HEADER = (
    "| steps | ranks | layer-parallel (ms) | serial (ms) | LP ÷ serial | model (ms) | "
    "model error | layer costs (µs) | work | output error | gradient error | load |"
)
PREDICTED_HEADER = (
    "| ranks P | layout | model T(P), 3 levels (ms) | serial (ms) | speed-up | best levels | "
    "T at best (ms) | speed-up at best |"
)


def report(cfg: Config, rows: list[dict[str, Any]], jobs: dict[int, dict[str, Any]]) -> bool:
    """Prints the measured table and the model's; returns whether LP agreed with serial."""
    from mpx.mgrit.model import count, predict

    message = jobs[2]["message"] if 2 in jobs else 0.0
    print(MEASURED_HEADER)
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    agreed, rest = True, None
    for r in sorted(rows, key=lambda r: (r["steps"], r["size"])):
        p, n, job = r["size"], r["steps"], jobs[r["size"]]
        cores = p / job["contention"] if p > 1 else 1.0
        costs = model_costs(r["costs"], job["message"], cores)  # the row's own costs
        work = count(n, LEVELS, CFACTOR, FWD_ITERS, BWD_ITERS, p, layout="fine", costs=costs)
        t = predict(work, costs, p)
        if p == 1 and n == max(cfg.steps):
            rest = (r["t_lp"] - t) / n
        ok = r["out_err"] <= OUTPUT_TOL and r["grad_err"] <= GRADIENT_TOL
        agreed = agreed and ok
        w = r["work"]
        print(
            f"| {n} | {p} | {r['t_lp'] * 1e3:.0f} | {r['t_serial'] * 1e3:.0f} | "
            f"**{r['ratio']:.2f}** | {t * 1e3:.0f} | {(t - r['t_lp']) / r['t_lp']:+.0%} | "
            + "/".join(f"{r['costs'][k] * 1e6:.0f}" for k in KINDS)
            + f" | {w['forward']}/{w['adjoint']}/{w['linearize']}/{w['gradient']} | "
            f"{r['out_err']:.1e} | {r['grad_err']:.1e}{'' if ok else ' **FAILED**'} | "
            f"{r['load']:.1f} |"
        )
    # The predictions: the costs of the smallest job's longest row (one core a rank).
    top = next(r for r in rows if r["size"] == min(jobs) and r["steps"] == max(cfg.steps))
    layer: dict[str, float] = top["costs"]
    serial_step = top["t_serial"] / top["steps"]
    us = {k: f"{v * 1e6:.0f}" for k, v in layer.items()}
    print(
        "\nLayer costs (µs, forward/adjoint/linearise/gradient) measured directly on one step "
        "layer, rank 0 alone and the other ranks asleep, 5 calls after each layer-parallel "
        "sample, the median: each row's model prices its work with the row's own costs, so "
        "that a load drifting between rows does not show as model error. "
        f"The {top['steps']}-step {top['size']}-rank row's (for the predictions): forward "
        f"{us['forward']} µs, adjoint (a linearisation and its product in x) {us['adjoint']} "
        f"µs, linearise {us['linearize']} µs, gradient (products in x and the parameters) "
        f"{us['gradient']} µs; t_msg = {message * 1e6:.0f} µs (one state between two ranks, "
        f"{'2-rank job' if 2 in jobs else 'no 2-rank job: 0'}); contention "
        + (", ".join(f"{j['contention']:.2f} at {p}" for p, j in sorted(jobs.items()) if p > 1)
           or "not measured (1 rank)")
        + f". Serial network: {serial_step * 1e6:.0f} µs a step (forward + backward). "
        "Not priced: the solver's own work (restriction, correction, copies, Python), "
        + (f"{rest * 1e6:.0f} µs per step at 1 rank (measured − model). " if rest is not None
           else "")
        + f"Model at P ranks: `mpx.mgrit.model.count({PREDICT_STEPS}, levels, {CFACTOR}, "
        f"{FWD_ITERS}, {BWD_ITERS}, P, layout=..., costs=...)` (the step replayed on every "
        "rank's clock, its critical path) priced with these costs, one core a rank; "
        "*fine*: the fine grid split in whole fine C-intervals (LayerParallel's split, and the "
        "measured rows' model: every rank works at any P up to N / cfactor); *coarsest*: "
        "whole coarsest intervals a rank (every network's split before issue 56). "
        f"Best levels: the fastest of {LEVEL_CHOICES[0]}-{LEVEL_CHOICES[-1]}.\n"
    )  # fmt: skip
    print(PREDICTED_HEADER)
    print("|---|---|---|---|---|---|---|---|")
    for line in prediction_rows(layer, message, serial_step):
        print(line)
    stacked = any(r["stacked"] for r in rows)
    print(
        "\nSteps stacked into batched products: "
        + ("**yes** (unexpected for Conv2d steps)." if stacked else "no, as expected: ")
        + ("" if stacked else "`StackedSteps.of` takes only Linear steps, so every step of "
           "every solve was one module call (`net.stepper.stacked` is None in every job).")
    )  # fmt: skip
    print(
        f"\nCorrectness: LayerParallel vs serial, relative output error <= {OUTPUT_TOL:g} and "
        f"gradient error <= {GRADIENT_TOL:g} at every row: "
        + ("**ok**." if agreed else "**FAILED**.")
    )
    return agreed


def _job(cfg: Config, args: argparse.Namespace, nprocs: int) -> list[str]:
    mpxrun = shutil.which("mpxrun", path=os.path.dirname(sys.executable)) or "mpxrun"
    inner = [os.path.abspath(__file__), "--inside", "--channels", str(args.channels),
             "--batch", str(args.batch)] + (["--smoke"] if args.smoke else [])  # fmt: skip
    timeout = "120" if args.smoke else "600"
    done = subprocess.run(
        [mpxrun, "-n", str(nprocs), "--timeout", timeout, "--", sys.executable, *inner],
        check=False, capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:  # the job's own words, then stop
        sys.stderr.write(done.stdout + done.stderr)
        sys.exit(f"bench_mgrit_conv: the {nprocs}-rank job exited with {done.returncode}")
    return done.stdout.splitlines()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--channels", type=int, default=32, choices=(32, 64))
    parser.add_argument("--batch", type=int, default=8, help="images a batch (default 8)")
    parser.add_argument(
        "--smoke", action="store_true", help="16 steps, 4 channels, 8 x 8 images, 1 rank (tests)"
    )
    args = parser.parse_args()
    cfg = config(args.smoke, args.channels, args.batch)
    if args.inside:
        inside(cfg)
        return
    script = "python packages/mgrit/benchmarks/bench_mgrit_conv.py" + (
        " --smoke" if args.smoke else ""
    )
    print("## mpx-mgrit: a convolutional ResNet step, layer-parallel vs serial (issue 56)\n")
    print(
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, MPICH wheel (`{script}`).\n"
    )
    print(
        f"Network: Conv2d(1, {cfg.channels}, 3) open, N steps x + h·ReLU(Conv2d({cfg.channels}, "
        f"{cfg.channels}, 3)(x)) (h = {TF:g}/N, no BatchNorm: torchbraid's MNIST step), "
        f"MaxPool2d(3) + Linear({cfg.close_features()}, 10) close; images 1 x {cfg.size} x "
        f"{cfg.size}, batch {cfg.batch}, float32, cross-entropy, one torch thread a rank. "
        f"LayerParallel: {LEVELS} levels, cfactor {CFACTOR}, {FWD_ITERS} forward / {BWD_ITERS} "
        "adjoint V-cycles, F-relaxation, steps unbatched (one module call each: a convolution "
        "does not stack). Time: forward + backward, median of "
        + "/".join(str(r) for r in cfg.repeats)
        + " samples, slowest rank; serial = `net.serial()` (plain autograd) on rank 0 alone, "
        "timed after each layer-parallel sample; LP ÷ serial: the median of the samples' own "
        "ratios (lower is better). Model: `mpx.mgrit.model` (fine layout: LayerParallel's "
        "split) priced with each row's own per-layer costs (below), at 2 ranks with that "
        "job's message time and contention. "
        "Work: forward/adjoint/linearise/gradient layer evaluations of the busiest rank "
        "(`mpx.mgrit.work`). Errors: LayerParallel vs serial, max |Δoutput| / max |output| "
        "and the largest ‖Δgrad‖ / ‖grad‖ of a parameter. Load: 1-minute load average.\n"
    )
    sys.stdout.flush()
    rows: list[dict[str, Any]] = []
    jobs: dict[int, dict[str, Any]] = {}
    for nprocs in cfg.ranks:
        for line in _job(cfg, args, nprocs):
            if line.startswith("ROW "):
                rows.append(json.loads(line[4:]))
            elif line.startswith("JOB "):
                record = json.loads(line[4:])
                jobs[int(record["size"])] = record
            elif line.strip():
                print(line, flush=True)
    if not report(cfg, rows, jobs):
        sys.exit(1)


if __name__ == "__main__":
    main()
