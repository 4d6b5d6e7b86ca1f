"""A GPT-2-like model built from Conv1D layers (not nn.Linear): mpx's schedules beside torch's.

``python bench_conv1d.py [--stages S] [--runs R]`` starts itself under
``mpxrun -n S`` (S = 2) R times (3 by default), printing the load (``uptime``)
before each run and one markdown table per run. The model is GPT-2's
architecture written here as transformers writes it: a token and a position
embedding, ``DEPTH`` blocks whose four projections are transformers'
``Conv1D`` (``torch.addmm(bias, x, weight)``, the weight stored transposed)
with causal attention between them, and a final LayerNorm with the output
layer tied to the token embedding (``F.linear(h, wte.weight)``). Before mpx
found the weight calls of any module (:mod:`mpx.pipeline.split_backward.capture`), a chunk
of such blocks kept its whole graph from ``I`` to ``W``.

Per schedule (``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``interleaved_zb``,
``zbv``), mpx and torch.distributed.pipelining's class of the same schedule
on gloo, with the same cut (``split_times`` over layer times measured on rank
0) and m: the median over ``ROUNDS`` rounds of a training step's time (each
round: a barrier, one untimed step, then ``STEPS`` steps timed; the slowest
rank), taken round-robin over the configurations so that load changes hit
all alike; tokens/s, the time over mpx's 1f1b, mpx ÷ torch, the peak of
the bytes saved for backward alive at once on a rank plus (mpx) what the
split backward keeps for ``W`` (``Pipeline.deferred_bytes``), and for mpx's
rows the bound at the measured pass costs (``step_measures.pass_cost_bound``
of each round's last step, the median over rounds) with the step ÷ it and the
bound ÷ mpx 1f1b's: what the schedule's layout allows at the costs its passes
took, the ceiling of the ``÷ mpx 1f1b`` column. One intra-op
thread per rank. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import shutil
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the functions that run under mpxrun import torch
    import torch
    from torch import nn

VOCAB, WIDTH, HEADS, SEQUENCE = 512, 128, 4, 128
DEPTH = int(os.environ.get("MPX_BENCH_DEPTH", "4"))
ROUNDS = int(os.environ.get("MPX_BENCH_ROUNDS", "5"))
STEPS = 2
CHUNKS = 8
BATCH = int(os.environ.get("MPX_BENCH_BATCH", str(2 * CHUNKS)))
# mpx schedule -> (torch's class name, chunks per rank)
SCHEDULES = {
    "1f1b": ("Schedule1F1B", 1),
    "gpipe": ("ScheduleGPipe", 1),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2),
    "interleaved_zb": ("ScheduleInterleavedZeroBubble", 2),
    "zbv": ("ScheduleZBVZeroBubble", 2),
}


def build() -> nn.Sequential:
    """GPT-2 as an nn.Sequential of one tensor in, one tensor out (Conv1D projections)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Conv1D(nn.Module):
        """transformers.pytorch_utils.Conv1D, as it is written there."""

        def __init__(self, nf: int, nx: int) -> None:
            super().__init__()
            self.nf = nf
            self.weight = nn.Parameter(torch.empty(nx, nf))
            self.bias = nn.Parameter(torch.zeros(nf))
            nn.init.normal_(self.weight, std=0.02)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            size_out = (*x.size()[:-1], self.nf)
            x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
            return x.view(size_out)

    class Embedding(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQUENCE, WIDTH)
            # GPT-2's initializer_range. With nn.Embedding's N(0, 1) the tied output
            # layer's logits are so large that softmax's gradient is mostly denormal
            # numbers, and a CPU's products over them take 50x their time.
            nn.init.normal_(self.wte.weight, std=0.02)
            nn.init.normal_(self.wpe.weight, std=0.02)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.wte(ids) + self.wpe.weight[: ids.shape[1]]
            return out

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
            self.c_attn, self.c_proj = Conv1D(3 * WIDTH, WIDTH), Conv1D(WIDTH, WIDTH)
            self.c_fc, self.mlp_proj = Conv1D(4 * WIDTH, WIDTH), Conv1D(WIDTH, 4 * WIDTH)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, w = x.shape
            q, k, v = (
                z.view(b, t, HEADS, w // HEADS).transpose(1, 2)
                for z in self.c_attn(self.ln_1(x)).split(w, dim=2)
            )
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.c_proj(att.transpose(1, 2).reshape(b, t, w))
            out: torch.Tensor = x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))
            return out

    class Head(nn.Module):
        def __init__(self, embedding: Embedding) -> None:
            super().__init__()
            self.ln_f = nn.LayerNorm(WIDTH)
            self.weight = embedding.wte.weight  # tied, as GPT2LMHeadModel's lm_head

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.linear(self.ln_f(x), self.weight)

    torch.manual_seed(0)
    embedding = Embedding()
    return nn.Sequential(embedding, *[Block() for _ in range(DEPTH)], Head(embedding))


def _inputs(before_bcast: Any) -> tuple[Any, Any, torch.Tensor, torch.Tensor, list[float]]:
    """Inside the job: one intra-op thread, the world, the batch and its targets (the
    same on every rank), and the layer times measured on rank 0, given to all;
    ``before_bcast(raw)`` runs between the measurement and the broadcast."""
    import torch
    from mpi4py import MPI

    from mpx.collectives import world
    from mpx.pipeline.model.partition import layer_times

    torch.set_num_threads(1)
    comm = world()
    raw = MPI.COMM_WORLD
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=gen)
    y = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=gen)
    times = layer_times(build(), x[: BATCH // CHUNKS], repeats=5) if comm.rank == 0 else None
    before_bcast(raw)
    return comm, raw, x, y, raw.bcast(times, 0)


def measure() -> None:
    """Runs inside the job; rank 0 prints the table."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from mpx.launch import init_torch_env
    from mpx.pipeline import Pipeline, split_times
    from mpx.pipeline.schedules.table import placement, rank_of

    # The transformer's bench (this folder is on the path): its loss, its barrier
    # and its torch schedules.
    shared = importlib.import_module("bench_transformer")
    loss_fn, polite_barrier = shared.loss_fn, shared.polite_barrier
    measures = importlib.import_module("step_measures")  # and their step measures
    SavedBytes, pass_cost_bound = measures.SavedBytes, measures.pass_cost_bound

    comm, raw, x, y, times = _inputs(polite_barrier)
    rank, p = comm.rank, comm.size

    def owners(v: int, style: str) -> list[int]:
        return [rank_of(s, p, style) for s in range(p * v)]

    def cut(v: int, style: str) -> list[int]:
        return split_times(times, p * v, owners(v, style), CHUNKS)

    def counter(params: Any, deferred: Any = lambda: 0) -> Any:
        return SavedBytes({q.untyped_storage().data_ptr() for q in params}, deferred)

    configs: list[tuple[str, Any, Any, Pipeline | None]] = []  # label, step, counter, pipe
    pipes = []
    for schedule, (_, v) in SCHEDULES.items():
        opts: dict[str, Any] = {"stages_per_rank": v} if v > 1 else {}
        pipe = Pipeline(
            build(), cut(v, placement(schedule)), chunks=CHUNKS, schedule=schedule, **opts
        )
        popt = torch.optim.SGD(pipe.parameters(), lr=1e-3)
        pipes.append((pipe, popt))

        def mpx_step(pipe: Pipeline = pipe, popt: torch.optim.Optimizer = popt) -> None:
            pipe.step(x, y, loss_fn, popt)

        def deferred(pipe: Pipeline = pipe) -> int:
            return pipe.deferred_bytes

        configs.append((f"mpx {schedule}", mpx_step, counter(pipe.parameters(), deferred), pipe))

    init_torch_env()
    dist.init_process_group("gloo")

    torch_error = ""
    for schedule, (name, v) in SCHEDULES.items():
        try:
            owner = owners(v, placement(schedule))
            # A V's rank holds the embedding and the tied output layer: its params once.
            sched, params = shared.torch_schedule(
                name, list(build()), cut(v, placement(schedule)), owner, rank, CHUNKS, loss_fn
            )
            topt = torch.optim.SGD(params, lr=1e-3)
            first, last = owner[0] == rank, owner[-1] == rank

            def torch_step(
                sched: Any = sched, topt: Any = topt, f: bool = first, la: bool = last
            ) -> None:
                topt.zero_grad()
                sched.step(*([x] if f else []), **({"target": y} if la else {}))
                topt.step()

            torch_step()  # torch's stages exchange shapes here
            configs.append((f"torch {schedule}", torch_step, counter(params), None))
        except Exception as error:
            torch_error += f" {name}: {type(error).__name__}: {error}"[:200]

    samples: list[list[float]] = [[] for _ in configs]
    bounds: list[list[float]] = [[] for _ in configs]  # mpx: the round's last step's bound
    for repeat in range(ROUNDS + 1):  # the first round warms up
        for i, (label, fn, saved, traced) in enumerate(configs):
            if rank == 0:
                print(f"round {repeat}/{ROUNDS}: {label}", file=sys.stderr, flush=True)
            polite_barrier(raw)
            fn()
            start = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                for _ in range(STEPS):
                    fn()
            if repeat:
                samples[i].append((time.perf_counter() - start) / STEPS)
                if traced is not None:  # the bound at the measured pass costs
                    trace = [(a.kind, a.mb, a.stage, b, e) for a, b, e in traced.trace]
                    bounds[i].append(pass_cost_bound(raw.allgather(trace)))
    for pipe, popt in pipes:
        pipe.flush(popt)
    dist.destroy_process_group()

    rows = []
    for i, (label, _, saved, _) in enumerate(configs):
        slowest = np.array(samples[i])
        raw.Allreduce(MPI.IN_PLACE, slowest, op=MPI.MAX)
        peak = int(raw.allreduce(saved.peak, op=MPI.MAX))
        bound = float(np.median(bounds[i])) if bounds[i] else None
        rows.append((label, float(np.median(slowest)), peak, bound))
    if rank == 0:
        report(rows, torch_error)


def actions() -> None:
    """``--actions``: CPU seconds per action of mpx's schedules, from the executor's own
    trace timed with ``time.process_time`` (:attr:`mpx.pipeline.runtime.executor.Executor.clock`);
    the schedules alternate step by step, ``ROUNDS`` steps each after one warm-up, and
    every rank prints its medians. A receive's time is mostly its wait (MPI polls)."""
    import numpy as np
    import torch

    from mpx.pipeline import Pipeline, split_times
    from mpx.pipeline.runtime.executor import Executor
    from mpx.pipeline.schedules.table import placement, rank_of

    loss_fn = importlib.import_module("bench_transformer").loss_fn
    comm, raw, x, y, times = _inputs(lambda raw: None)
    rank, p = comm.rank, comm.size
    pipes = {}
    for schedule in ("1f1b", "interleaved_1f1b", "interleaved_zb", "zbv"):
        v = SCHEDULES[schedule][1]
        owner = [rank_of(s, p, placement(schedule)) for s in range(p * v)]
        opts: dict[str, Any] = {"stages_per_rank": v} if v > 1 else {}
        balance = split_times(times, p * v, owner, CHUNKS)
        pipe = Pipeline(build(), balance, chunks=CHUNKS, schedule=schedule, **opts)
        pipes[schedule] = (pipe, torch.optim.SGD(pipe.parameters(), lr=1e-3))
    Executor.clock = time.process_time
    kinds = ("F", "I", "W", "B", "SEND_F", "RECV_F", "RECV_B", "SEND_B")
    cpu: dict[str, list[dict[str, tuple[float, int]]]] = {s: [] for s in pipes}
    steps: dict[str, list[float]] = {s: [] for s in pipes}
    for repeat in range(ROUNDS + 1):
        for schedule, (pipe, opt) in pipes.items():
            raw.Barrier()
            start = time.process_time()
            pipe.step(x, y, loss_fn, opt)
            if repeat:
                steps[schedule].append(time.process_time() - start)
                per: dict[str, tuple[float, int]] = {}
                for a, begin, end in pipe.trace:
                    total, n = per.get(a.kind, (0.0, 0))
                    per[a.kind] = (total + end - begin, n + 1)
                cpu[schedule].append(per)
    lines = []
    for schedule in pipes:
        cells = [f"{np.median(steps[schedule]) * 1e3:.1f}"]
        for kind in kinds:
            rows = [per[kind] for per in cpu[schedule] if kind in per]
            if not rows:
                cells.append("-")
                continue
            total, n = float(np.median([t for t, _ in rows])), rows[0][1]
            cells.append(f"{total * 1e3:.1f} / {n} = {total / n * 1e3:.2f}")
        lines.append(f"| {schedule} | {rank} | " + " | ".join(cells) + " |")
    gathered = raw.gather(lines, 0)
    if gathered is not None:  # rank 0
        print("| schedule | rank | step CPU (ms) | " + " | ".join(kinds) + " |")
        print("|---|---|---|" + "---|" * len(kinds))
        for row in sorted(line for part in gathered for line in part):
            print(row, flush=True)


def report(rows: list[tuple[str, float, int, float | None]], torch_error: str) -> None:
    times = {label: t for label, t, _, _ in rows}
    one_f = times["mpx 1f1b"]
    one_f_bound = next(bound for label, _, _, bound in rows if label == "mpx 1f1b")
    for label, t, peak, bound in rows:
        kind = label.split()[1]
        other = times.get(f"{'torch' if label.startswith('mpx') else 'mpx'} {kind}")
        vs = "-" if other is None or label.startswith("torch") else f"{other / t:.2f}"
        at_costs = "-"
        if bound is not None and one_f_bound is not None:
            at_costs = f"{bound * 1e3:.1f} ({t / bound:.2f}×; {bound / one_f_bound:.2f})"
        print(
            f"| {label} | {BATCH * SEQUENCE / t:.0f} | {t * 1e3:.1f} | {t / one_f:.2f} | "
            f"{vs} | {peak / 2**20:.1f} | {at_costs} |",
            flush=True,
        )
    if torch_error:
        print(f"\ntorch.distributed.pipelining failed:{torch_error}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inner", action="store_true", help="run inside an mpxrun job")
    parser.add_argument("--stages", type=int, default=2, help="pipeline ranks (2)")
    parser.add_argument("--runs", type=int, default=3, help="jobs, one table each (3)")
    parser.add_argument(
        "--actions",
        action="store_true",
        help="instead: CPU ms per action of mpx's 1f1b, interleaved_1f1b, interleaved_zb, zbv "
        "(each rank; the executor's trace timed with process_time; total / count = each)",
    )
    args = parser.parse_args()
    if args.inner:
        actions() if args.actions else measure()
        return
    mpxrun = shutil.which("mpxrun") or os.path.join(os.path.dirname(sys.executable), "mpxrun")
    print(
        f"## mpx-pipeline: GPT-2 with Conv1D layers on {args.stages} stages beside "
        "torch.distributed.pipelining\n\n"
        f"Machine: {platform.machine()}, {os.cpu_count()} cores; {DEPTH} blocks, width "
        f"{WIDTH}, {HEADS} heads, sequence {SEQUENCE}, vocabulary {VOCAB} (tied output), "
        f"batch {BATCH} sequences, m = {CHUNKS}, 1 thread per rank; step = forward + "
        f"backward + SGD step, the median of {ROUNDS} rounds of {STEPS} steps (each "
        "round's slowest rank); `python bench_conv1d.py`.\n"
    )
    for run in range(args.runs):
        load = subprocess.run(
            ["uptime"], check=False, capture_output=True, text=True
        ).stdout.strip()
        print(f"\nRun {run + 1}, load: `{load}`\n", flush=True)
        if not args.actions:  # (--actions prints its own table)
            print(
                "| config | tokens/s | ms a step | ÷ mpx 1f1b | mpx ÷ torch (speed-up) | "
                "peak activations (MiB, a rank) | bound at the measured pass costs (ms; "
                "step ÷ it; ÷ mpx 1f1b's) |\n|---|---|---|---|---|---|---|",
                flush=True,
            )
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH", "")]
        ))  # fmt: skip
        subprocess.run(
            [mpxrun, "-n", str(args.stages), "--timeout", "1800", "--", sys.executable,
             os.path.abspath(__file__), "--inner", *(["--actions"] if args.actions else [])],
            check=True, env=env,
        )  # fmt: skip


if __name__ == "__main__":
    main()
