"""Pipeline throughput on p ranks: mpx's schedules beside a single process and torch's.

``python bench_pipeline.py [--stages p]`` starts itself under ``mpxrun -n p``
(p = 2 by default; 1, 2, 4 or 8) and prints one
markdown section (``nox -s bench`` writes it into BENCHMARKS.md). In one job,
for an MLP of 8 Linear(W, W) layers + ReLU split evenly over p stages (one
intra-op thread per rank), it times a training step (forward, backward, SGD
step) of: the whole model in one process (rank 0 alone), mpx ``sequential``,
``gpipe`` with m = 1, 4, 8, ``1f1b`` and ``async`` with m = 8, and
``torch.distributed.pipelining`` ScheduleGPipe / Schedule1F1B on gloo with
the same split. Time is the median over samples of 3 consecutive steps (no
barrier between them, which would drain the async pipeline; each sample
follows a barrier and one untimed step that refills it), taken round-robin
over the configurations so that load changes hit all alike; the slowest
rank's. The batch (``MPX_BENCH_BATCH``, default 2048) is cut into micro-batches
of 256 rows at m = 8: a table at the end measures what smaller micro-batches
cost the compute itself. ``MPX_BENCH_ONLY=gpipe,async`` times only the rows
whose label contains one of the words (and skips that table).
Measured bubble = 1 - (compute time / step time), averaged over stages
(mpx only: torch's schedules do not expose their compute time).
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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the functions that run under mpxrun import torch
    from torch import nn

WIDTH, DEPTH = 768, 8
# 2048 rows: 8 micro-batches of 256. Smaller micro-batches run the GEMMs of a
# 768-wide layer well below a core's speed; the efficiency table shows how much.
BATCH = int(os.environ.get("MPX_BENCH_BATCH", "2048"))
EFFICIENCY_BATCHES = (256, 1024, 2048)
REPEATS = 8
STEPS = 3  # consecutive steps per sample: a barrier between steps would flush async


def build() -> nn.Sequential:
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers)


def micro_batch_efficiency(
    rank: int, stages: int, polite_barrier: Callable[[], None]
) -> list[tuple[int, float, float]]:
    """What micro-batching costs before any communication, on rank 0 alone.

    For each batch B: the whole model's step on B rows, and the last stage's
    (1/p of the layers, input needing a gradient) step on 8 micro-batches of
    B/8 rows. Their ratio bounds the p-stage pipeline's speed-up with no
    bubble and free messages.
    """
    import torch
    from torch import nn

    out: list[tuple[int, float, float]] = []
    per_stage = 2 * DEPTH // stages
    whole, stage = build(), nn.Sequential(*list(build())[:per_stage])
    for batch in EFFICIENCY_BATCHES:
        polite_barrier()
        if rank != 0:
            continue
        gen = torch.Generator().manual_seed(2)
        x, y = torch.randn(batch, WIDTH, generator=gen), torch.randn(batch, WIDTH, generator=gen)
        times = []
        for model, chunks in ((whole, 1), (stage, 8)):
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            samples = []
            for repeat in range(6):
                start = time.perf_counter()
                opt.zero_grad()
                for xs, ys in zip(x.chunk(chunks), y.chunk(chunks), strict=True):
                    # The stage's input needs a gradient (the last stage's
                    # does: the slower of the two, which sets the pace).
                    feed = xs.requires_grad_(chunks > 1)
                    nn.functional.mse_loss(model(feed), ys).backward()
                opt.step()
                if repeat:
                    samples.append(time.perf_counter() - start)
            times.append(statistics.median(samples))
        out.append((batch, times[0], times[1]))
    polite_barrier()
    return out


def measure() -> None:
    """Runs inside the job on p ranks; rank 0 prints table rows."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI
    from torch import nn

    from mpx.collectives import world
    from mpx.launch import init_torch_env
    from mpx.pipeline import Pipeline

    torch.set_num_threads(1)
    comm = world()
    raw = MPI.COMM_WORLD
    rank, p = comm.rank, comm.size
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, WIDTH, generator=gen)
    y = torch.randn(BATCH, WIDTH, generator=gen)
    loss_fn = nn.functional.mse_loss
    half = [2 * DEPTH // p] * p

    def polite_barrier() -> None:
        # Sleeps instead of spinning: in the single-process row the idle rank
        # must not take a core from the computing one.
        request = raw.Ibarrier()
        while not request.Test():
            time.sleep(1e-4)

    only_some = bool(os.environ.get("MPX_BENCH_ONLY"))
    efficiency = [] if only_some else micro_batch_efficiency(rank, p, polite_barrier)

    # Every configuration first, then the repeats round-robin over them, so
    # that a change in the machine's load hits all of them alike.
    # Callable[..., ...]: the lambdas bind loop variables as defaults (pipe=pipe),
    # which mypy cannot fit to a Callable[[], ...].
    configs: list[tuple[str, int | None, Callable[..., object], Callable[..., float] | None]] = []

    serial = build()  # the whole model in one process; the other rank waits
    opt = torch.optim.SGD(serial.parameters(), lr=1e-3)

    def serial_step() -> None:
        if rank == 0:
            opt.zero_grad()
            loss_fn(serial(x), y).backward()
            opt.step()

    configs.append(("single process (whole model)", None, serial_step, None))
    pipes = []
    for schedule, chunks, every in [
        ("sequential", 1, 1),
        ("gpipe", 1, 1),
        ("gpipe", 4, 1),
        ("gpipe", 8, 1),
        ("1f1b", 8, 1),
        ("async", 8, 1),
        ("async", 8, 8),
    ]:
        opts: dict[str, Any] = {"step_every": every} if schedule == "async" else {}
        pipe = Pipeline(build(), half, chunks=chunks, schedule=schedule, **opts)
        popt = torch.optim.SGD(pipe.parameters(), lr=1e-3)
        pipes.append((pipe, popt))
        label = f"mpx {schedule}" + (f" step_every={every}" if schedule == "async" else "")
        configs.append(
            (
                label,
                chunks,
                lambda pipe=pipe, popt=popt: pipe.step(x, y, loss_fn, popt),
                lambda pipe=pipe: pipe.busy_seconds,
            )
        )

    init_torch_env()
    dist.init_process_group("gloo")
    torch_rows: dict[str, str] = {}
    try:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle

        for name, cls in [("ScheduleGPipe", ScheduleGPipe), ("Schedule1F1B", Schedule1F1B)]:
            full = build()
            start_layer = sum(half[:rank])
            sub = nn.Sequential(*list(full)[start_layer : start_layer + half[rank]])
            stage = PipelineStage(sub, rank, p, torch.device("cpu"))
            sched = cls(stage, n_microbatches=8, loss_fn=loss_fn)
            topt = torch.optim.SGD(sub.parameters(), lr=1e-3)

            def torch_step(
                sched: PipelineScheduleSingle = sched, topt: torch.optim.Optimizer = topt
            ) -> None:
                topt.zero_grad()
                if rank == 0:
                    sched.step(x)
                elif rank == p - 1:
                    sched.step(target=y)
                else:
                    sched.step()
                topt.step()

            torch_step()  # a first step: torch's stages exchange shapes here
            configs.append((f"torch.distributed.pipelining {name}", 8, torch_step, None))
    except Exception as error:
        torch_rows["error"] = f"{type(error).__name__}: {error}".replace("|", "/")[:200]

    samples: list[list[float]] = [[] for _ in configs]
    bubbles: list[list[float]] = [[] for _ in configs]
    only = [w for w in os.environ.get("MPX_BENCH_ONLY", "").split(",") if w]
    for repeat in range(REPEATS + 1):  # the first round warms up
        for i, (label, _, fn, busy) in enumerate(configs):
            if only and i and not any(w in label for w in only):
                continue
            polite_barrier()
            # One untimed step after the barrier: it refills the async
            # pipeline, which the barrier drained; what follows is the steady
            # state that training runs in (synchronous schedules drain every
            # step anyway, so for them this only adds a sample).
            fn()
            busy_total = 0.0
            start = time.perf_counter()
            for _ in range(STEPS):
                fn()
                busy_total += busy() if busy is not None else 0.0
            wall = (time.perf_counter() - start) / STEPS
            if repeat:
                samples[i].append(wall)
                if busy is not None:
                    bubbles[i].append(1 - busy_total / STEPS / wall)
    for pipe, popt in pipes:
        pipe.flush(popt)
    dist.destroy_process_group()

    rows: list[tuple[str, int | None, float, float | None]] = []
    for i, (label, m, _, busy) in enumerate(configs):
        if not samples[i]:
            continue  # left out by MPX_BENCH_ONLY
        # Every rank must agree on the figure: the slowest rank's median.
        t = float(raw.allreduce(statistics.median(samples[i]), op=MPI.MAX))
        bubble = None
        if busy is not None:
            bubble = float(raw.allreduce(statistics.median(bubbles[i]))) / p
        rows.append((label, m, t, bubble))
    t_serial = rows[0][2]

    if rank == 0:
        torch_time = {r[0].split()[-1]: r[2] for r in rows if r[0].startswith("torch")}
        peer_of = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}
        for label, m, t, bubble in rows:
            theory = (
                f"{(p - 1) / (m + p - 1):.2f}" if m is not None and "async" not in label else "-"
            )
            if "sequential" in label:
                theory = f"{(p - 1) / p:.2f}"
            if "async" in label:
                theory = "0 (steady state)"
            peer = peer_of.get(label.split()[-1]) if label.startswith("mpx") and m == 8 else None
            vs_torch = f"{torch_time[peer] / t:.2f}" if peer and peer in torch_time else "-"
            print(
                f"| {label} | {m if m is not None else '-'} | {BATCH / t:.0f} | "
                f"{t_serial / t:.2f} | {vs_torch} | "
                f"{'-' if bubble is None else f'{bubble:.2f}'} | {theory if m else '-'} |",
                flush=True,
            )
        by_label = {(r[0], r[1]): r[2] for r in rows}
        gpipe8 = by_label.get(("mpx gpipe", 8))
        for every in (1, 8):
            async8 = by_label.get((f"mpx async step_every={every}", 8))
            if gpipe8 is not None and async8 is not None:
                ratio = gpipe8 / async8
                print(f"\nasync (m=8, step_every={every}) ÷ gpipe m=8: {ratio:.2f}×", end="")
        print()
        single = by_label.get(("single process (whole model)", None))
        torch_gpipe = torch_time.get("ScheduleGPipe")
        async8 = by_label.get(("mpx async step_every=8", 8))
        if (
            single is not None
            and gpipe8 is not None
            and torch_gpipe is not None
            and async8 is not None
        ):
            print(
                f"\n| target ({p} stages; the issue's are for 2) | measured |\n|---|---|\n"
                f"| gpipe m=8 ≥ 1.5× the single process | {single / gpipe8:.2f}× |\n"
                f"| gpipe m=8 ≥ 1× torch ScheduleGPipe | {torch_gpipe / gpipe8:.2f}× |\n"
                f"| async (m=8, step_every=8) ≥ 1.1× gpipe m=8 | {gpipe8 / async8:.2f}× |"
            )
            print(
                "\nIn ideal schedules async's gain over gpipe is the flush it skips: "
                f"(m+p-1)/m = {(8 + p - 1) / 8:.3f} at m=8 with stages of equal cost. Here "
                "the first stage's backward skips its input's gradient, so the last stage "
                "sets the pace of both schedules and gpipe's flush costs only the first "
                "stage's (shorter) forward and backward of one micro-batch; gpipe's message "
                "waits at the flush count against it too."
            )
        if efficiency:
            print(
                "\nWhat micro-batching costs (rank 0 alone, before any message): the whole "
                "model's step on B rows beside one stage's step on 8 micro-batches of B/8 "
                f"rows; the ratio bounds the {p}-stage speed-up.\n"
            )
            print(
                "| batch B | micro-batch | whole model, ms | one stage (8 micro-batches), ms "
                "| bound, no bubble | bound with gpipe's bubble (m=8) |"
            )
            print("|---|---|---|---|---|---|")
            for batch, t_whole, t_stage in efficiency:
                bound = t_whole / t_stage
                print(
                    f"| {batch} | {batch // 8} | {t_whole * 1e3:.0f} | {t_stage * 1e3:.0f} | "
                    f"{bound:.2f} | {bound * 8 / (8 + p - 1):.2f} |"
                )
        if "error" in torch_rows:
            print(
                f"| torch.distributed.pipelining | 8 | failed: {torch_rows['error']} "
                "| - | - | - | - |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inner", action="store_true", help="run inside an mpxrun job")
    parser.add_argument(
        "--stages", type=int, default=2, choices=[1, 2, 4, 8], help="ranks (one stage each)"
    )
    args = parser.parse_args()
    if args.inner:
        measure()
        return
    mpxrun = shutil.which("mpxrun") or os.path.join(os.path.dirname(sys.executable), "mpxrun")
    params = DEPTH * (WIDTH * WIDTH + WIDTH) / 1e6
    p = args.stages
    title = "2 stages" if p == 2 else f"{p} stages (`--stages {p}`)"
    print(f"## mpx-pipeline: pipeline throughput, {title}\n")
    print(
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, {platform.system()}; "
        f"MLP {DEPTH}x Linear({WIDTH}, {WIDTH}) ({params:.1f} M params), batch {BATCH}, "
        f"1 thread per rank, split {'+'.join([str(DEPTH // p)] * p)} Linear layers; "
        f"`python {os.path.basename(__file__)}` (`mpxrun -n {p}`). "
        f"Step = forward + backward + SGD step; median of {REPEATS} "
        f"samples of {STEPS} steps, each sample after a barrier and one untimed step "
        "(steady state).\n"
    )
    print(
        "| config | micro-batches m | samples/s | × single process | mpx ÷ torch (same "
        "schedule, m=8) | measured bubble | theory (p-1)/(m+p-1) |"
    )
    print("|---|---|---|---|---|---|---|")
    start = time.perf_counter()
    subprocess.run(
        [
            mpxrun,
            "-n",
            str(p),
            "--timeout",
            "600",
            "--",
            sys.executable,
            os.path.abspath(__file__),
            "--inner",
        ],
        check=True,
    )
    print(f"\n(run took {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
