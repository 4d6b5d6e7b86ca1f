"""A transformer on S pipeline stages: every mpx schedule beside torch's schedule of the same name.

``python bench_transformer.py [--stages S] [--variable] [--only ROWS]`` starts itself under
``mpxrun -n S`` (S = 2 by default; 3, 4 where the cores allow) and prints one
markdown section (``nox -s bench -- bench_transformer`` writes it into
BENCHMARKS.md). The model is a decoder-only transformer (token + position
embedding, ``DEPTH`` pre-norm blocks of causal attention and MLP, LayerNorm
and the vocabulary projection), one tensor between blocks (each block makes
its causal mask itself), cut into S stages (one per rank) or 2S (two chunks
per rank) by ``split_times`` over layer times measured on rank 0, so that each
rank's chunks together take about the same time (a V's rank 0 holds the first
and the last chunk; the same cut for torch's rows). In one job, with one intra-op thread
per rank, it times a training step (forward, backward, SGD step) of: the whole
model in one process (rank 0 alone); mpx ``gpipe``, ``1f1b``,
``interleaved_1f1b``, ``looped_bfs``, ``interleaved_zb``, ``zbv``,
``dualpipev`` (``interleaved_zb`` and ``zbv`` laid out by their measured
pass times, the default, and again by unit costs: ``pass_costs="unit"``) and
``async`` (step_every = m: one optimizer step per batch, as
the others; also with ``split_backward=True``, and both with two chunks per
rank, ``stages_per_rank=2``: each chunk an asynchronous stage of its own, W
deferred into the gaps); and torch.distributed.pipelining's
ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleLoopedBFS,
ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble and ScheduleDualPipeV on
gloo with the same cut and m.

Per schedule: tokens/s, × the single process, mpx ÷ torch (same schedule),
the measured bubble (mpx: from the executor's own trace of its actions, the
median over samples) beside ``bubble_fraction`` (F = I = W = 1, B = 2), the
compute bound (1 − the theoretical bubble: the most a perfectly balanced
pipeline of this schedule keeps busy), the peak activation memory (the most
bytes saved for backward alive at once on any rank, counted by
``torch.autograd.graph.saved_tensors_hooks``, parameters left out, plus for mpx
what the split backward keeps for its W passes outside the graph:
``Pipeline.deferred_bytes``, sampled at each save), and each rank's CPU time
over the wall time; and for mpx's synchronous rows the bound at the measured pass
costs: the step's lists, as the executor ran them, timed against the data
dependencies at that step's own per-pass times (``F``, ``B``, ``I``, ``W`` per
virtual stage, the median over micro-batches; messages free) of the fastest
sample (the one whose time the row reports), beside the step ÷ it (the
executor's and the messages' share); for ``async`` rows, which never flush, the
busiest rank's compute time of a step (``Pipeline.busy_seconds``). 1f1b's
bound over interleaved_zb's is the most the zero-bubble layout can gain over
1F1B at the costs this machine gave its passes, its split backward's own cost
included: the ceiling of the ZB target's line; the fastest synchronous row's
bound over the fastest async row's is the async line's.

``--variable``: every step draws its own sequence length (32, 64, 96 or 128
tokens, the same on every rank). mpx's schedules take each as it comes (a
border header is renegotiated only when the length changes); torch's stages
fix their shapes at the first step, so their user must pad every batch to the
longest length (what these rows do): tokens/s counts the real tokens only.

Time is the fastest of the samples of ``STEPS`` consecutive steps (each
sample after a barrier and one untimed step that refills the async pipeline;
each sample's slowest rank), taken round-robin over the configurations so that
load changes hit all alike. The fastest, not the median: on a shared machine
other jobs only add time. ``MPX_BENCH_REPEATS`` (default 4) sets the samples
per configuration, ``MPX_BENCH_BATCH`` the sequences per step (default 2m).
Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import importlib
import math
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
    import torch
    from torch import nn

VOCAB, WIDTH, HEADS, SEQUENCE = 96, 256, 4, 128
DEPTH = int(os.environ.get("MPX_BENCH_DEPTH", "8"))
LENGTHS = (32, 64, 96, 128)  # --variable: a sequence length drawn per step
REPEATS = int(os.environ.get("MPX_BENCH_REPEATS", "4"))
STEPS = 2  # consecutive steps per sample: a barrier between steps would flush async
STAGES = int(os.environ.get("MPX_BENCH_STAGES", "2"))
VARIABLE = os.environ.get("MPX_BENCH_VARIABLE", "0") == "1"
# --only: the rows to time (a window on the GPU machine's cores has time for a few
# at 4 and 8 stages); empty: every row.
ONLY = [name for name in os.environ.get("MPX_BENCH_ONLY", "").split(",") if name]
# m: 8 micro-batches, raised to a multiple of the stages (interleaving) and to at
# least 2 per stage (DualPipeV); two sequences each unless MPX_BENCH_BATCH says.
CHUNKS = max(2 * STAGES, math.ceil(8 / STAGES) * STAGES)
BATCH = int(os.environ.get("MPX_BENCH_BATCH", str(2 * CHUNKS)))
# mpx schedule -> (torch's class name, chunks per rank)
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", 1),
    "1f1b": ("Schedule1F1B", 1),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2),
    "looped_bfs": ("ScheduleLoopedBFS", 2),
    "interleaved_zb": ("ScheduleInterleavedZeroBubble", 2),
    "zbv": ("ScheduleZBVZeroBubble", 2),
    "dualpipev": ("ScheduleDualPipeV", 2),
}


def build() -> nn.Sequential:
    """The transformer as an nn.Sequential of one tensor in, one tensor out."""
    import torch
    from torch import nn

    class Embedding(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.token = nn.Embedding(VOCAB, WIDTH)
            # An nn.Embedding (a bare nn.Parameter sliced the same way would do
            # as well: the split backward leaves either's gradient to I).
            self.position = nn.Embedding(SEQUENCE, WIDTH)
            nn.init.normal_(self.position.weight, std=0.02)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            tokens: torch.Tensor = self.token(ids)
            return tokens + self.position.weight[: ids.shape[1]]

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
            self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
            self.mlp = nn.Sequential(
                nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, w = x.shape
            q, k, v = (
                z.view(b, t, HEADS, w // HEADS).transpose(1, 2)
                for z in self.qkv(self.norm1(x)).split(w, dim=2)
            )
            # The mask is made here (is_causal): only the residual stream crosses a border.
            att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(att.transpose(1, 2).reshape(b, t, w))
            out: torch.Tensor = x + self.mlp(self.norm2(x))
            return out

    torch.manual_seed(0)
    return nn.Sequential(
        Embedding(),
        *[Block() for _ in range(DEPTH)],
        nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)),
    )


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    from torch import nn

    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def polite_barrier(comm: Any) -> None:
    """A barrier of the mpi4py communicator ``comm`` that sleeps instead of spinning:
    in the single-process row the idle ranks must not take a core from the computing one."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(1e-4)


def torch_schedule(
    name: str,
    whole: list[nn.Module],
    balance: list[int],
    owner: list[int],
    rank: int,
    chunks: int,
    loss: Callable[..., torch.Tensor],
) -> tuple[Any, list[torch.Tensor]]:
    """torch.distributed.pipelining's schedule class ``name`` over ``rank``'s stages
    of the layers ``whole`` cut into ``balance`` (stage s on rank ``owner[s]``), and
    those stages' parameters, each once: a V's rank 0 may hold a tied weight twice
    (GPT-2's embedding and output layer)."""
    import torch
    from torch import nn
    from torch.distributed import pipelining

    n = len(balance)
    stages: list[Any] = []
    params: list[torch.Tensor] = []
    for s in (s for s in range(n) if owner[s] == rank):
        lo = sum(balance[:s])
        sub = nn.Sequential(*whole[lo : lo + balance[s]])
        params += [q for q in sub.parameters() if all(q is not r for r in params)]
        stages.append(pipelining.PipelineStage(sub, s, n, torch.device("cpu")))
    cls = getattr(pipelining.schedules, name)
    # One stage a rank: the single-stage classes take the stage itself.
    sched = cls(stages[0] if len(stages) == 1 else stages, n_microbatches=chunks, loss_fn=loss)
    return sched, params


def _wanted(row: str) -> bool:
    """Whether ``--only`` (``MPX_BENCH_ONLY``) keeps a row: a schedule's name, ``async``
    (its four rows), ``single``, ``NAME:unit`` (a zero-bubble list laid out by unit
    costs) or ``torch:NAME``; no ``--only``: every row."""
    return not ONLY or row in ONLY


def measure() -> None:
    """Runs inside the job on STAGES ranks; rank 0 prints the table."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from mpx.collectives import world
    from mpx.launch import init_torch_env
    from mpx.pipeline import Pipeline, bubble_fraction, split_times
    from mpx.pipeline.model.partition import layer_times
    from mpx.pipeline.runtime.executor import measured_bubble
    from mpx.pipeline.schedules.table import TIMED, placement, rank_of

    # This folder is on the path (the script's own): what bench_conv1d counts the same way.
    measures = importlib.import_module("step_measures")
    torch.set_num_threads(1)
    comm = world()
    raw = MPI.COMM_WORLD
    rank, p = comm.rank, comm.size
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=gen)
    y = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=gen)
    step_lengths = iter(
        [LENGTHS[int(k)] for k in torch.randint(0, len(LENGTHS), (10**5,), generator=gen)]
    )
    current = [SEQUENCE]  # the sequence length of the step under way

    def batch(pad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's batch: cut to its length, or (torch, --variable) padded back to SEQUENCE."""
        n = current[0]
        if not pad or n == SEQUENCE:
            return x[:, :n], y[:, :n]
        xs = torch.zeros_like(x)
        xs[:, :n] = x[:, :n]
        ys = torch.full_like(y, -100)  # no loss on padding
        ys[:, :n] = y[:, :n]
        return xs, ys

    # Layers per virtual stage, for mpx's rows and torch's alike: balanced by
    # layer times measured on rank 0 (one micro-batch), over each rank's chunks
    # where a rank runs two (a V puts the first and the last chunk on rank 0).
    # The other ranks wait politely while rank 0 times the layers: one spinning in
    # the broadcast made the blocks' times spread 17-21 ms instead of 17-18. The
    # fastest of 7 (not layer_times' default 3): the blocks are equal, and a
    # cut by noise (looped 4 3 1 2 instead of 3 2 2 3) cost a run of its rows.
    times = layer_times(build(), x[: BATCH // CHUNKS], repeats=7) if rank == 0 else None
    polite_barrier(raw)
    times = raw.bcast(times, 0)
    cuts: dict[tuple[int, str], list[int]] = {}

    def owners(v: int, style: str) -> list[int]:
        return [rank_of(s, p, style) for s in range(p * v)]

    def cut(v: int, style: str) -> list[int]:
        if (v, style) not in cuts:
            cuts[(v, style)] = split_times(times, p * v, owners(v, style), CHUNKS)
        return cuts[(v, style)]

    # name, m, step, busy (mpx), trace rows (mpx), theoretical bubble, saved-bytes counter
    configs: list[tuple[str, int | None, Callable[..., object], Any, Any, float | None, Any]] = []
    serial = build()
    sopt = torch.optim.SGD(serial.parameters(), lr=1e-3)

    def serial_step() -> None:
        if rank == 0:
            sopt.zero_grad()
            xs, ys = batch()
            loss_fn(serial(xs), ys).backward()
            sopt.step()

    def counter(params: Any, deferred: Callable[[], int] = lambda: 0) -> Any:
        return measures.SavedBytes({q.untyped_storage().data_ptr() for q in params}, deferred)

    def deferred_of(pipe: Pipeline) -> Callable[[], int]:
        return lambda: pipe.deferred_bytes

    if _wanted("single"):
        configs.append(("single process (whole model)", None, serial_step, None, None, None, None))
    pipes = []
    runs = [(k, v, False, "measured") for k, (_, v) in SCHEDULES.items() if _wanted(k)]
    # The zero-bubble lists as laid out with unit costs too (pass_costs="unit"),
    # beside the default layout by the measured times.
    runs += [(k, 2, False, "unit") for k in TIMED if _wanted(f"{k}:unit")]
    asyncs = [
        ("async", v, split, "measured")
        for v in (1, 2)
        for split in (False, True)
        if _wanted("async")
    ]
    for schedule, v, split_backward, pass_costs in [*runs, *asyncs]:
        opts: dict[str, Any] = {"step_every": CHUNKS} if schedule == "async" else {}
        if v > 1:
            opts["stages_per_rank"] = v
        if split_backward:
            opts["split_backward"] = True
        opts["pass_costs"] = pass_costs
        balance = cut(v, placement(schedule))
        pipe = Pipeline(build(), balance, chunks=CHUNKS, schedule=schedule, **opts)
        popt = torch.optim.SGD(pipe.parameters(), lr=1e-3)
        pipes.append((pipe, popt))
        label = f"mpx {schedule}" + (f" step_every={CHUNKS}" if schedule == "async" else "")
        label += " split_backward" if split_backward else ""
        label += f" stages_per_rank={v}" if schedule == "async" and v > 1 else ""
        label += " pass_costs=unit" if pass_costs == "unit" else ""
        theory = None if schedule == "async" else bubble_fraction(schedule, p, CHUNKS, v)

        def mpx_step(pipe: Pipeline = pipe, popt: torch.optim.Optimizer = popt) -> None:
            xs, ys = batch()
            pipe.step(xs, ys, loss_fn, popt)

        configs.append(
            (
                label,
                CHUNKS,
                mpx_step,
                lambda pipe=pipe: pipe.busy_seconds,
                lambda pipe=pipe: [(a.kind, a.mb, a.stage, s, e) for a, s, e in pipe.trace],
                theory,
                counter(pipe.parameters(), deferred_of(pipe)),
            )
        )

    init_torch_env()
    dist.init_process_group("gloo")
    torch_error = ""

    for schedule, (name, v) in SCHEDULES.items():
        if not _wanted(f"torch:{schedule}"):
            continue
        try:
            owner = owners(v, placement(schedule))
            sched, params = torch_schedule(
                name, list(build()), cut(v, placement(schedule)), owner, rank, CHUNKS, loss_fn
            )
            topt = torch.optim.SGD(params, lr=1e-3)
            first, last = owner[0] == rank, owner[-1] == rank

            def torch_step(
                sched: Any = sched, topt: Any = topt, f: bool = first, la: bool = last
            ) -> None:
                xs, ys = batch(pad=True)  # torch's stages keep the shapes of their first step
                topt.zero_grad()
                sched.step(*([xs] if f else []), **({"target": ys} if la else {}))
                topt.step()

            torch_step()  # a first step: torch's stages exchange shapes here
            configs.append((f"torch {name}", CHUNKS, torch_step, None, None, None, counter(params)))
        except Exception as error:
            torch_error += f" {name}: {type(error).__name__}: {error}".replace("|", "/")[:200]

    samples: list[list[float]] = [[] for _ in configs]
    bubbles: list[list[float]] = [[] for _ in configs]
    bounds: list[list[float]] = [[] for _ in configs]  # the lists timed at the step's costs
    cpu_shares: list[list[float]] = [[] for _ in configs]
    for repeat in range(REPEATS + 1):  # the first round warms up
        for i, (label, _, fn, busy, trace, _, saved) in enumerate(configs):
            if rank == 0:
                print(f"round {repeat}/{REPEATS}: {label}", file=sys.stderr, flush=True)
            polite_barrier(raw)
            current[0] = next(step_lengths) if VARIABLE else SEQUENCE
            fn()  # untimed: refills the async pipeline that the barrier drained
            measured = []
            cpu_start, start = time.process_time(), time.perf_counter()
            for _ in range(STEPS):
                current[0] = next(step_lengths) if VARIABLE else SEQUENCE
                if saved is not None:
                    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                        fn()
                else:
                    fn()
                if trace is not None and "async" not in label:
                    measured.append(trace())
            wall = (time.perf_counter() - start) / STEPS
            cpu = (time.process_time() - cpu_start) / STEPS
            if repeat:
                samples[i].append(wall)
                cpu_shares[i].append(cpu / wall)
                if busy is not None and "async" in label:
                    bubbles[i].append(1 - busy() / wall)
                    # A stream never flushes: at best a step takes its rank's compute.
                    bounds[i].append(busy())
                steps_bound = []
                for mine in measured:  # the executor's own trace, every rank's
                    traces = raw.allgather(mine)
                    bubbles[i].append(
                        measured_bubble([[(k, s, e) for k, _, _, s, e in row] for row in traces])
                    )
                    steps_bound.append(measures.pass_cost_bound(traces))
                if steps_bound:  # per sample, as its time: the row reports its fastest's
                    bounds[i].append(statistics.mean(steps_bound))
    for pipe, popt in pipes:
        pipe.flush(popt)
    dist.destroy_process_group()

    rows: list[
        tuple[str, int | None, float, float | None, float | None, float, int, float | None]
    ] = []
    for i, (label, m, _, _, _, theory, saved) in enumerate(configs):
        # Each sample's slowest rank, then the fastest sample: on a shared
        # machine the other jobs only ever add time, so the minimum is the
        # estimate they disturb least (the median moved by 1.5x between runs).
        slowest = np.array(samples[i])
        raw.Allreduce(MPI.IN_PLACE, slowest, op=MPI.MAX)
        t = float(slowest.min())
        fastest = int(slowest.argmin())
        bubble = None
        if bubbles[i]:
            mine = statistics.median(bubbles[i])
            bubble = float(raw.allreduce(mine)) / p if "async" in label else mine
        cpu_share = float(raw.allreduce(statistics.median(cpu_shares[i]))) / p
        peak = int(raw.allreduce(0 if saved is None else saved.peak, op=MPI.MAX))
        # The fastest sample's own bound: the VM's speed drifts between samples
        # (the bound's median against the fastest time read 0.85-0.96 in loaded runs).
        bound = bounds[i][fastest] if bounds[i] else None
        if "async" in label and bound is not None:  # per rank: the busiest one bounds
            bound = float(raw.allreduce(bound, op=MPI.MAX))
        rows.append((label, m, t, bubble, theory, cpu_share, peak, bound))
    if rank == 0:
        report(rows, torch_error, cuts)


def report(
    rows: list[tuple[str, int | None, float, float | None, float | None, float, int, float | None]],
    torch_error: str,
    cuts: dict[tuple[int, str], list[int]],
) -> None:
    tokens = BATCH * (statistics.mean(LENGTHS) if VARIABLE else SEQUENCE)
    times = {r[0]: r[2] for r in rows}
    t_single = times.get("single process (whole model)")
    bounds = {r[0]: r[7] for r in rows}
    for label, m, t, bubble, theory, cpu_share, peak, at_costs in rows:
        kind = label.split()[1] if label.startswith("mpx") else ""
        peer = f"torch {SCHEDULES[kind][0]}" if kind in SCHEDULES else None
        vs_torch = f"{times[peer] / t:.2f}" if peer in times else "-"
        bound = "-" if theory is None else f"{1 - theory:.2f}"
        print(
            f"| {label} | {m if m is not None else '-'} | {tokens / t:.0f} | "
            f"{'-' if t_single is None else f'{t_single / t:.2f}'} | {vs_torch} | "
            f"{'-' if bubble is None else f'{bubble:.2f}'} | "
            f"{'-' if theory is None else f'{theory:.2f}'} | {bound} | "
            f"{peak / 2**20:.1f} | {cpu_share:.2f} | "
            f"{'-' if at_costs is None else f'{at_costs * 1e3:.0f} ({t / at_costs:.2f}×)'} |",
            flush=True,
        )
    best_sync = min((times[f"mpx {k}"] for k in SCHEDULES if f"mpx {k}" in times), default=None)
    one_f = times.get("mpx 1f1b")
    zb = times.get("mpx interleaved_zb")
    asy = min((t for label, t in times.items() if label.startswith("mpx async")), default=None)
    print("\n| target | measured |\n|---|---|")
    for kind in SCHEDULES:
        peer = f"torch {SCHEDULES[kind][0]}"
        if peer in times and f"mpx {kind}" in times:
            print(f"| mpx {kind} ≥ 1.0× torch's | {times[peer] / times[f'mpx {kind}']:.2f}× |")
    if one_f and zb:
        print(f"| interleaved_zb ≥ 1.1× mpx 1f1b (m={CHUNKS}) | {one_f / zb:.2f}× |")
        one_f_bound, zb_bound = bounds.get("mpx 1f1b"), bounds.get("mpx interleaved_zb")
        if one_f_bound and zb_bound:
            print(
                "| the most its layout gains at the measured pass costs (1f1b's bound ÷ "
                f"interleaved_zb's) | {one_f_bound / zb_bound:.2f}× |"
            )
    if asy and best_sync:
        among = " (of those timed)" if ONLY else ""
        print(f"| async ≥ 1.1× the best synchronous schedule{among} | {best_sync / asy:.2f}× |")
        best = next(label for label, t in times.items() if t == best_sync)
        fastest = next(label for label, t in times.items() if t == asy)
        sync_bound, async_bound = bounds.get(best), bounds.get(fastest)
        if sync_bound and async_bound:
            print(
                f"| the most async gains at the measured pass costs ({best}'s bound ÷ "
                f"{fastest.removeprefix('mpx ')}'s compute) | {sync_bound / async_bound:.2f}× |"
            )
    shapes = {(1, "loop"): "one chunk a rank", (2, "loop"): "two, looped", (2, "v"): "two, a V"}
    print(
        "\nLayers per virtual stage (`split_times` over layer times measured on rank 0, "
        "the shortest estimated step over each rank's chunks): "
        + "; ".join(f"{shapes.get(key, key)} {balance}" for key, balance in sorted(cuts.items()))
        + "."
    )
    if torch_error:
        print(f"\ntorch.distributed.pipelining failed:{torch_error}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inner", action="store_true", help="run inside an mpxrun job")
    parser.add_argument("--stages", type=int, default=STAGES, help="pipeline ranks (2)")
    parser.add_argument("--variable", action="store_true", help="a sequence length drawn per step")
    parser.add_argument(
        "--only",
        default=os.environ.get("MPX_BENCH_ONLY", ""),
        metavar="ROWS",
        help="comma-separated rows to time (default all): schedule names, async, single, "
        "NAME:unit, torch:NAME; e.g. 1f1b,interleaved_zb,zbv,async",
    )
    args = parser.parse_args()
    if args.inner:
        measure()
        return
    unknown = sorted(
        set(filter(None, args.only.split(",")))
        - {*SCHEDULES, "async", "single"}
        - {f"{k}:unit" for k in SCHEDULES}  # the timed ones among them have such a row
        - {f"torch:{k}" for k in SCHEDULES}
    )
    if unknown:
        parser.error(f"--only: unknown rows {unknown}; see --help")
    os.environ["MPX_BENCH_ONLY"] = args.only
    os.environ["MPX_BENCH_STAGES"] = str(args.stages)
    os.environ["MPX_BENCH_VARIABLE"] = "1" if args.variable else "0"
    mpxrun = shutil.which("mpxrun") or os.path.join(os.path.dirname(sys.executable), "mpxrun")
    block = 12 * WIDTH * WIDTH + 13 * WIDTH
    params = (DEPTH * block + (VOCAB + SEQUENCE) * WIDTH + (WIDTH + 1) * VOCAB) / 1e6
    m = max(2 * args.stages, math.ceil(8 / args.stages) * args.stages)
    batch = int(os.environ.get("MPX_BENCH_BATCH", str(2 * m)))
    lengths = f"a length drawn per step from {LENGTHS}" if args.variable else f"{SEQUENCE}"
    rows = (
        f"the rows {args.only}"
        if args.only
        else "every schedule beside torch.distributed.pipelining"
    )
    print(
        f"## mpx-pipeline: a transformer on {args.stages} stages, {rows}"
        f"{' (variable sequence lengths)' if args.variable else ''}\n"
    )
    print(
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, {platform.system()}; "
        f"decoder-only transformer, {DEPTH} blocks, width {WIDTH}, {HEADS} heads, sequence "
        f"{lengths}, vocabulary {VOCAB} ({params:.1f} M params), batch {batch} sequences, "
        f"m = {m}, 1 thread per rank, layers per virtual stage below the table; "
        f"`python {os.path.basename(__file__)} --stages {args.stages}"
        f"{' --variable' if args.variable else ''}{f' --only {args.only}' * bool(args.only)}`. "
        "Step = forward + backward + SGD step; "
        f"the fastest of {REPEATS} samples of {STEPS} steps (each sample's slowest rank), "
        "each after a barrier and one untimed step."
        + (
            " torch's rows pad every batch to the longest length (its stages keep the "
            "shapes of their first step); tokens/s counts real tokens."
            if args.variable
            else ""
        )
        + "\n"
    )
    print(
        "| config | m | tokens/s | × single process | mpx ÷ torch (same schedule) | "
        "measured bubble | theory | compute bound | peak activations (MiB, a rank) | "
        "CPU time ÷ wall, per rank | bound at the measured pass costs (ms; step ÷ it) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    start = time.perf_counter()
    subprocess.run(
        [mpxrun, "-n", str(args.stages), "--timeout", "1800", "--", sys.executable,
         os.path.abspath(__file__), "--inner"],
        check=True,
    )  # fmt: skip
    print(f"\n(run took {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
