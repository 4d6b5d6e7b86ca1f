"""Training step time of a ~10 M parameter model: mpx DistributedOptimizer vs torch DDP.

``python bench_dataparallel.py`` times a single process first, then starts
itself under ``mpxrun -n 2`` where, in one job and one after another, the
same model and per-rank batch run with:

    mpx DistributedOptimizer fp32   the default, overlap="auto" (see overlap_pays)
    mpx, MPX_CHECK=0                the same without the default cross-rank check
    mpx, overlap=True               buckets allreduced from gradient hooks
    mpx, overlap=False              every bucket allreduced in step()
    mpx, 4-bit compression          mpx.quantize.allreduce (row left empty without it)
    mpx, 4-bit, when="auto"         compressed only where measured faster (first step)
    torch DDP, gloo                 the peer
    torch DDP, mpx backend          DDP on mpx.collectives' torch.distributed backend
    ..., MPX_PROGRESS_THREAD=0      the same with futures completed synchronously (no overlap)
    local step, no communication    each rank alone (the compute the others hide comm behind)
    communication alone             every gradient bucket allreduced, no compute
    ..., gradients copied in        the same after the gradients are copied into the buckets

Step = forward + backward + optimizer (SGD with momentum). Figures are the
slowest rank's best-of-rounds mean; the rounds interleave the methods, so a
load change on the machine hits them all. Overlap = share of the
communication time hidden behind compute: (local + comm - step) / comm,
clipped to [0, 100] %.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the functions that run under mpxrun import torch
    from torch import nn

BATCH = 32  # per rank
# MPX_BENCH_STEPS=1 MPX_BENCH_ROUNDS=1: a quick run (gpu_report.py --cpu-smoke).
STEPS = int(os.environ.get("MPX_BENCH_STEPS", "8"))
ROUNDS = int(os.environ.get("MPX_BENCH_ROUNDS", "3"))
WARMUP = 2


def make_model() -> nn.Sequential:
    from torch import nn

    # 1024 -> 2048 -> 2048 -> 1024 -> 1024 -> 10: 9.4 M parameters.
    return nn.Sequential(
        nn.Linear(1024, 2048),
        nn.ReLU(),
        nn.Linear(2048, 2048),
        nn.ReLU(),
        nn.Linear(2048, 1024),
        nn.ReLU(),
        nn.Linear(1024, 1024),
        nn.ReLU(),
        nn.Linear(1024, 10),
    )


def _step_fn(model: object, opt: object) -> Callable[[], None]:
    import torch
    from torch import nn

    assert isinstance(model, nn.Module)
    assert isinstance(opt, torch.optim.Optimizer)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, 1024, generator=g)
    y = torch.randint(0, 10, (BATCH,), generator=g)
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    return step


def _time_all(fns: dict[str, Callable[[], None]], barrier: Callable[[], None]) -> dict[str, float]:
    """Best mean step time of each function; rounds interleave them so load drift is shared."""
    for fn in fns.values():
        for _ in range(WARMUP):
            fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            barrier()
            start = time.perf_counter()
            for _ in range(STEPS):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / STEPS)
    return best


def single_process() -> float:
    import torch

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return _time_all({"single": _step_fn(model, opt)}, lambda: None)["single"]


def measure() -> None:
    """Inside the 2-rank job: every rank times; rank 0 prints JSON."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI
    from torch import nn

    import mpx.dataparallel as dp
    from mpx.collectives import allreduce, register_torch_backend
    from mpx.launch import init_torch_env
    from mpx.launch.settings import reload as reload_settings

    comm = dp.init()
    raw = MPI.COMM_WORLD
    init_torch_env()
    dist.init_process_group("gloo")
    register_torch_backend()
    mpx_group = dist.new_group(backend="mpx")

    def fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = make_model()
        assert isinstance(model, nn.Module)
        return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    fns: dict[str, Callable[[], None]] = {}
    model, inner = fresh()
    fns["local step, no communication"] = _step_fn(model, inner)
    model, inner = fresh()
    opt = dp.DistributedOptimizer(inner, model)
    fns["mpx DistributedOptimizer fp32"] = _step_fn(model, opt)
    auto_overlaps = opt.overlap
    flats = [b.flat for b in opt._buckets if b.flat is not None]  # the same, without compute
    assert len(flats) == len(opt._buckets)

    def comm_only() -> None:
        handles = [allreduce(f, "avg", comm=comm, async_op=True) for f in flats]
        for h in handles:
            h.wait()

    fns["communication alone"] = comm_only
    # The same with the gradients copied into the buckets first: the hooks do it
    # in the step (a fresh gradient into its node-shared slot), so the bound the
    # step is held to, local + communication, misses it in the row above.
    grads = [(view, torch.randn(view.shape)) for b in opt._buckets for view in b.views]

    def copy_and_comm() -> None:
        for view, grad in grads:
            view.copy_(grad)
        comm_only()

    fns["communication alone, gradients copied in"] = copy_and_comm
    model, inner = fresh()
    unchecked = _step_fn(model, dp.DistributedOptimizer(inner, model))

    def with_setting(name: str, step: Callable[[], None]) -> Callable[[], None]:
        """``step`` with the setting ``name`` (an ``MPX_*`` variable) set to 0."""

        def run() -> None:
            os.environ[name] = "0"
            reload_settings()
            try:
                step()
            finally:
                del os.environ[name]
                reload_settings()

        return run

    # The default step with the cross-rank check (MPX_CHECK=auto) off.
    fns["mpx DistributedOptimizer fp32, MPX_CHECK=0"] = with_setting("MPX_CHECK", unchecked)
    model, inner = fresh()
    opt = dp.DistributedOptimizer(inner, model, overlap=True)
    fns["mpx DistributedOptimizer fp32, overlap=True"] = _step_fn(model, opt)
    model, inner = fresh()
    opt = dp.DistributedOptimizer(inner, model, overlap=False)
    fns["mpx DistributedOptimizer fp32, overlap=False"] = _step_fn(model, opt)
    compressed = False
    try:
        from mpx import quantize

        if hasattr(quantize, "allreduce") and hasattr(quantize, "CompressionConfig"):
            model, inner = fresh()
            config = quantize.CompressionConfig(bits=4)
            opt = dp.DistributedOptimizer(inner, model, compression=config)
            fns["mpx DistributedOptimizer 4-bit"] = _step_fn(model, opt)
            model, inner = fresh()
            auto = config.with_(when="auto")  # decides in the warm-up steps
            opt = dp.DistributedOptimizer(inner, model, compression=auto)
            fns["mpx DistributedOptimizer 4-bit, when=auto"] = _step_fn(model, opt)
            compressed = True
    except ImportError:
        pass
    for name, group in (("torch DDP, gloo", None), ("torch DDP, mpx backend", mpx_group)):
        model, _ = fresh()
        ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
        fns[name] = _step_fn(ddp, torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9))

    model, _ = fresh()
    ddp = nn.parallel.DistributedDataParallel(model, process_group=mpx_group)
    synchronous = _step_fn(ddp, torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9))

    # DDP on mpx as before asynchronous work: get_future() waits for the allreduce.
    fns["torch DDP, mpx backend, MPX_PROGRESS_THREAD=0"] = with_setting(
        "MPX_PROGRESS_THREAD", synchronous
    )

    best = _time_all(fns, raw.Barrier)
    results: dict[str, float | None] = {
        name: float(raw.allreduce(seconds, op=MPI.MAX)) for name, seconds in best.items()
    }
    if not compressed:
        results["mpx DistributedOptimizer 4-bit"] = None
        results["mpx DistributedOptimizer 4-bit, when=auto"] = None
    results["auto overlaps"] = float(auto_overlaps)
    dist.destroy_process_group()
    if comm.rank == 0:
        print("RESULTS " + json.dumps(results), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--ranks", default="2", help="rank counts, one job and table each (default 2)"
    )
    args = parser.parse_args()
    if args.inside:
        measure()
        return
    import torch

    torch.set_num_threads(1)  # as each of the ranks (mpxrun gives each rank one thread here)
    single = single_process()
    for nprocs in (int(n) for n in args.ranks.split(",")):
        report(nprocs, single)


def report(nprocs: int, single: float) -> None:
    """One job of ``nprocs`` ranks, and its table."""
    import torch

    params = sum(p.numel() for p in make_model().parameters())
    mpxrun = shutil.which("mpxrun", path=os.path.dirname(sys.executable)) or "mpxrun"
    command = [mpxrun, "-n", str(nprocs), "--timeout", "600", "--"]
    command += [sys.executable, __file__, "--inside"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULTS ")]
    if done.returncode != 0 or not lines:
        sys.stderr.write(done.stdout + done.stderr)
        raise SystemExit(f"the benchmark job failed (exit {done.returncode})")
    results: dict[str, float | None] = json.loads(lines[-1][len("RESULTS ") :])
    results["single process (1 thread, no communication)"] = single
    auto_overlaps = bool(results.pop("auto overlaps"))
    gloo = results["torch DDP, gloo"]
    assert gloo is not None
    print(f"## mpx-dataparallel: training step time, {nprocs} ranks\n")
    print(
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, torch {torch.__version__}, MPICH wheel; model: MLP "
        f"with {params / 1e6:.1f} M float32 parameters, batch {BATCH} per rank, SGD with "
        "momentum; step = forward + backward + optimizer; slowest rank's best mean over "
        f"{ROUNDS} rounds of {STEPS} steps (`python packages/dataparallel/benchmarks/"
        "bench_dataparallel.py`). Ratio = time ÷ DDP on gloo (lower is better).\n"
    )
    print("| method | step time (ms) | ÷ DDP gloo |")
    print("|---|---|---|")
    order = [
        "mpx DistributedOptimizer fp32",
        "mpx DistributedOptimizer fp32, MPX_CHECK=0",
        "mpx DistributedOptimizer fp32, overlap=True",
        "mpx DistributedOptimizer fp32, overlap=False",
        "mpx DistributedOptimizer 4-bit",
        "mpx DistributedOptimizer 4-bit, when=auto",
        "torch DDP, gloo",
        "torch DDP, mpx backend",
        "torch DDP, mpx backend, MPX_PROGRESS_THREAD=0",
        "local step, no communication",
        "communication alone",
        "communication alone, gradients copied in",
        "single process (1 thread, no communication)",
    ]
    for name in order:
        value = results.get(name)
        if value is None:
            print(f"| {name} | n/a (needs mpx.quantize.allreduce) | |")
        else:
            print(f"| {name} | {value * 1e3:.1f} | {value / gloo:.2f} |")
    local = results["local step, no communication"]
    comm = results["communication alone"]
    step = results["mpx DistributedOptimizer fp32, overlap=True"]
    assert local is not None
    assert comm is not None
    assert step is not None
    hidden = max(0.0, min(1.0, (local + comm - step) / comm))
    print(
        f"\nOverlap: communication alone {comm * 1e3:.1f} ms, local step {local * 1e3:.1f} ms, "
        f"mpx step with overlap=True {step * 1e3:.1f} ms: {hidden * 100:.0f} % of the "
        "communication hidden behind compute ((local + comm - step) / comm). The default, "
        "overlap='auto', overlaps only where a core (or a device, or a network) is idle: "
        f"{'yes' if auto_overlaps else 'no'} here."
    )
    fp32 = results["mpx DistributedOptimizer fp32"]
    copied = results["communication alone, gradients copied in"]
    assert fp32 is not None
    assert copied is not None
    print(
        "\nDistributedOptimizer fp32 ÷ (local + communication alone): "
        f"{fp32 / (local + comm):.2f}; ÷ (local + communication with the gradients copied "
        f"in): {fp32 / (local + copied):.2f} "
        "(issue 46's target: <= 1.1)."
    )


if __name__ == "__main__":
    main()
