"""A transformer on 2 pipeline stages: mpx's schedules beside one process and torch's pipelining.

``python bench_transformer.py`` starts itself under ``mpxrun -n 2`` and prints
one markdown section (``nox -s bench -- bench_transformer`` writes it into
BENCHMARKS.md). The model is a decoder-only transformer (token + position
embedding, ``DEPTH`` pre-norm blocks of causal attention and MLP, LayerNorm
and the vocabulary projection), one tensor between blocks (each block makes
its causal mask itself), split ``[1 + DEPTH/2, DEPTH/2 + 1]``: embedding and
half the blocks, the other half and the head. In one job, with one intra-op
thread per rank, it times a training step (forward, backward, SGD step) of:
the whole model in one process (rank 0 alone), mpx ``gpipe``,
``1f1b`` and ``async`` (step_every = 8: one optimizer step per batch, as
the others) with m = 8, and ``torch.distributed.pipelining`` ScheduleGPipe /
Schedule1F1B on gloo with the same split and m = 8.

Time is the fastest of the samples of ``STEPS`` consecutive steps (each
sample after a barrier and one untimed step that refills the async pipeline;
each sample's slowest rank), taken round-robin over the configurations so that
load changes hit all alike. The fastest, not the median: on a shared machine
other jobs only add time. Measured bubble = 1 - compute time / step time, averaged
over the stages (mpx only: torch's schedules do not expose their compute
time; the median over samples), beside the theory (S-1)/(m+S-1), and each
rank's CPU time over the wall time (a rank that spins while it waits uses
its core all along; one that blocks, as gloo's does, gives it back).
``MPX_BENCH_REPEATS`` (default 4)
sets the samples per configuration, ``MPX_BENCH_BATCH`` (default 16) the
sequences per step. Progress goes to stderr.
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
    import torch
    from torch import nn

VOCAB, WIDTH, HEADS, DEPTH, SEQUENCE = 96, 256, 4, 8, 128
# 16 sequences per step, m = 8 micro-batches of two: about 80 s a run on a quiet
# 2-core machine (MPX_BENCH_BATCH=8 where the machine is shared: 16 took 20 min there).
BATCH = int(os.environ.get("MPX_BENCH_BATCH", "16"))
CHUNKS = 8
REPEATS = int(os.environ.get("MPX_BENCH_REPEATS", "4"))
STEPS = 2  # consecutive steps per sample: a barrier between steps would flush async
STAGES = 2


def build() -> nn.Sequential:
    """The transformer as an nn.Sequential of one tensor in, one tensor out."""
    import torch
    from torch import nn

    class Embedding(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.token = nn.Embedding(VOCAB, WIDTH)
            self.position = nn.Parameter(torch.randn(SEQUENCE, WIDTH) * 0.02)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            tokens: torch.Tensor = self.token(ids)
            return tokens + self.position[: ids.shape[1]]

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


def split() -> list[int]:
    return [1 + DEPTH // 2, DEPTH // 2 + 1]


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    from torch import nn

    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def measure() -> None:
    """Runs inside the job on 2 ranks; rank 0 prints the table."""
    import numpy as np
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
    x = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=gen)
    y = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=gen)
    balance = split()

    def polite_barrier() -> None:
        # Sleeps instead of spinning: in the single-process row the idle rank
        # must not take a core from the computing one.
        request = raw.Ibarrier()
        while not request.Test():
            time.sleep(1e-4)

    # What micro-batching costs the compute alone (rank 0, before any message):
    # the whole model on the batch, and the last stage on 8 micro-batches.
    cost: tuple[float, float] | None = None
    polite_barrier()
    if rank == 0:
        whole = build()
        last = nn.Sequential(*list(build())[balance[0] :])
        feed = torch.randn(BATCH, SEQUENCE, WIDTH)
        times = []
        for model, inputs, chunks in ((whole, x, 1), (last, feed, CHUNKS)):
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            runs = []
            for repeat in range(REPEATS + 1):
                start = time.perf_counter()
                opt.zero_grad()
                for xs, ys in zip(inputs.chunk(chunks), y.chunk(chunks), strict=True):
                    # A stage's input needs its gradient (sent back to the stage before).
                    feed = xs.detach().requires_grad_(True) if xs.is_floating_point() else xs
                    loss_fn(model(feed), ys).backward()
                opt.step()
                if repeat:
                    runs.append(time.perf_counter() - start)
            times.append(min(runs))
        cost = (times[0], times[1])
    polite_barrier()

    configs: list[tuple[str, int | None, Callable[..., object], Callable[..., float] | None]] = []
    serial = build()
    sopt = torch.optim.SGD(serial.parameters(), lr=1e-3)

    def serial_step() -> None:
        if rank == 0:
            sopt.zero_grad()
            loss_fn(serial(x), y).backward()
            sopt.step()

    configs.append(("single process (whole model)", None, serial_step, None))
    pipes = []
    for schedule, chunks in [("gpipe", CHUNKS), ("1f1b", CHUNKS), ("async", CHUNKS)]:
        opts: dict[str, Any] = {"step_every": CHUNKS} if schedule == "async" else {}
        pipe = Pipeline(build(), balance, chunks=chunks, schedule=schedule, **opts)
        popt = torch.optim.SGD(pipe.parameters(), lr=1e-3)
        pipes.append((pipe, popt))
        label = f"mpx {schedule}" + (f" step_every={CHUNKS}" if schedule == "async" else "")
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
    torch_error = ""
    try:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle

        for name, cls in [("ScheduleGPipe", ScheduleGPipe), ("Schedule1F1B", Schedule1F1B)]:
            start_layer = sum(balance[:rank])
            sub = nn.Sequential(*list(build())[start_layer : start_layer + balance[rank]])
            stage = PipelineStage(sub, rank, p, torch.device("cpu"))
            sched = cls(stage, n_microbatches=CHUNKS, loss_fn=loss_fn)
            topt = torch.optim.SGD(sub.parameters(), lr=1e-3)

            def torch_step(
                sched: PipelineScheduleSingle = sched, topt: torch.optim.Optimizer = topt
            ) -> None:
                topt.zero_grad()
                if rank == 0:
                    sched.step(x)
                else:
                    sched.step(target=y)
                topt.step()

            torch_step()  # a first step: torch's stages exchange shapes here
            configs.append((f"torch.distributed.pipelining {name}", CHUNKS, torch_step, None))
    except Exception as error:
        torch_error = f"{type(error).__name__}: {error}".replace("|", "/")[:200]

    samples: list[list[float]] = [[] for _ in configs]
    bubbles: list[list[float]] = [[] for _ in configs]
    cpu_shares: list[list[float]] = [[] for _ in configs]
    for repeat in range(REPEATS + 1):  # the first round warms up
        for i, (label, _, fn, busy) in enumerate(configs):
            if rank == 0:
                print(f"round {repeat}/{REPEATS}: {label}", file=sys.stderr, flush=True)
            polite_barrier()
            fn()  # untimed: refills the async pipeline that the barrier drained
            busy_total = 0.0
            cpu_start, start = time.process_time(), time.perf_counter()
            for _ in range(STEPS):
                fn()
                busy_total += busy() if busy is not None else 0.0
            wall = (time.perf_counter() - start) / STEPS
            cpu = (time.process_time() - cpu_start) / STEPS
            if repeat:
                samples[i].append(wall)
                cpu_shares[i].append(cpu / wall)
                if busy is not None:
                    bubbles[i].append(1 - busy_total / STEPS / wall)
    for pipe, popt in pipes:
        pipe.flush(popt)
    dist.destroy_process_group()

    rows: list[tuple[str, int | None, float, float | None, float]] = []
    for i, (label, m, _, busy) in enumerate(configs):
        # Each sample's slowest rank, then the fastest sample: on a shared
        # machine the other jobs only ever add time, so the minimum is the
        # estimate they disturb least (the median moved by 1.5x between runs).
        slowest = np.array(samples[i])
        raw.Allreduce(MPI.IN_PLACE, slowest, op=MPI.MAX)
        t = float(slowest.min())
        bubble = None
        if busy is not None:
            bubble = float(raw.allreduce(statistics.median(bubbles[i]))) / p
        # CPU time over wall time, per rank: near 1 on a rank that spins
        # while it waits, below 1 on one that blocks (single process: rank 1 idles).
        cpu_share = float(raw.allreduce(statistics.median(cpu_shares[i]))) / p
        rows.append((label, m, t, bubble, cpu_share))
    if rank == 0:
        report(rows, cost, torch_error)


def report(
    rows: list[tuple[str, int | None, float, float | None, float]],
    cost: tuple[float, float] | None,
    torch_error: str,
) -> None:
    p = STAGES
    tokens = BATCH * SEQUENCE
    t_single = rows[0][2]
    torch_time = {r[0].split()[-1]: r[2] for r in rows if r[0].startswith("torch")}
    peer_of = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}
    for label, m, t, bubble, cpu_share in rows:
        theory = "-"
        if m is not None:
            theory = "0 (steady state)" if "async" in label else f"{(p - 1) / (m + p - 1):.2f}"
        kind = label.split()[1] if label.startswith("mpx") else ""
        peer = peer_of.get(kind) if m == CHUNKS else None
        vs_torch = f"{torch_time[peer] / t:.2f}" if peer and peer in torch_time else "-"
        print(
            f"| {label} | {m if m is not None else '-'} | {tokens / t:.0f} | "
            f"{t_single / t:.2f} | {vs_torch} | "
            f"{'-' if bubble is None else f'{bubble:.2f}'} | {theory} | {cpu_share:.2f} |",
            flush=True,
        )
    by_label = {r[0]: r[2] for r in rows}
    gpipe8 = next(r[2] for r in rows if r[0] == "mpx gpipe" and r[1] == CHUNKS)
    async8 = by_label[f"mpx async step_every={CHUNKS}"]
    torch_gpipe = torch_time.get("ScheduleGPipe")
    vs_torch = f"{torch_gpipe / gpipe8:.2f}×" if torch_gpipe else f"- ({torch_error})"
    print(
        f"\n| target (2 stages) | measured |\n|---|---|\n"
        f"| gpipe m=8 ≥ 1.5× the single process | {t_single / gpipe8:.2f}× |\n"
        f"| gpipe m=8 ≥ 1.2× torch ScheduleGPipe | {vs_torch} |\n"
        f"| async (m=8, step_every=8) ≥ 1.1× gpipe m=8 | {gpipe8 / async8:.2f}× |"
    )
    if cost is not None:
        whole, stage = cost
        bound = whole / stage
        print(
            f"\nWhat micro-batching costs the compute alone (rank 0, no messages): the whole "
            f"model's step on {BATCH} sequences takes {whole * 1e3:.0f} ms, the last stage's "
            f"step on {CHUNKS} micro-batches of {BATCH // CHUNKS} takes {stage * 1e3:.0f} ms: "
            f"a 2-stage pipeline can run at most {bound:.2f}× one process with no bubble, "
            f"{bound * CHUNKS / (CHUNKS + p - 1):.2f}× with gpipe's bubble at m={CHUNKS}."
        )
    if torch_error:
        print(f"\ntorch.distributed.pipelining failed: {torch_error}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inner", action="store_true", help="run inside an mpxrun job")
    args = parser.parse_args()
    if args.inner:
        measure()
        return
    mpxrun = shutil.which("mpxrun") or os.path.join(os.path.dirname(sys.executable), "mpxrun")
    block = 12 * WIDTH * WIDTH + 13 * WIDTH
    params = (DEPTH * block + (VOCAB + SEQUENCE) * WIDTH + (WIDTH + 1) * VOCAB) / 1e6
    print("## mpx-pipeline: a transformer on 2 stages, beside torch.distributed.pipelining\n")
    print(
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, {platform.system()}; "
        f"decoder-only transformer, {DEPTH} blocks, width {WIDTH}, {HEADS} heads, sequence "
        f"{SEQUENCE}, vocabulary {VOCAB} ({params:.1f} M params), batch {BATCH} sequences "
        f"({BATCH * SEQUENCE} tokens), 1 thread per rank, split {'+'.join(map(str, split()))} "
        f"layers (embedding + {DEPTH // 2} blocks | {DEPTH // 2} blocks + head); "
        f"`python {os.path.basename(__file__)}` (`mpxrun -n 2`). Step = forward + backward + "
        f"SGD step; the fastest of {REPEATS} samples of {STEPS} steps (each sample's slowest "
        "rank), each sample after a barrier and one untimed step.\n"
    )
    print(
        "| config | micro-batches m | tokens/s | × single process | mpx ÷ torch (same "
        "schedule, m=8) | measured bubble | theory (S-1)/(m+S-1) | CPU time ÷ wall, per rank |"
    )
    print("|---|---|---|---|---|---|---|---|")
    start = time.perf_counter()
    subprocess.run(
        [mpxrun, "-n", str(STAGES), "--timeout", "900", "--", sys.executable,
         os.path.abspath(__file__), "--inner"],
        check=True,
    )  # fmt: skip
    print(f"\n(run took {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
