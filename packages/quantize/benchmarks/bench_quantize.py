"""Quantization kernels against the pure-torch quantizer, and the compressed allreduce.

``python bench_quantize.py`` prints one markdown section (``nox -s bench``
writes it into BENCHMARKS.md):

1. Kernels, in this process: quantize + dequantize of float32 input, stochastic
   rounding, GB/s of float32 input: the C++ kernel vs a plain torch quantizer
   (what a user would write: amin/amax, rand_like, shifts; the ratio's peer) vs
   mpx's pure-torch reference (:mod:`mpx.quantize.reference`, which emulates the
   32-bit noise hash in int64 and is timed up to 4 Mi values only) vs a memory copy.
2. Allreduce of float32, 2 ranks (the script starts itself under ``mpxrun -n 2``):
   mpx's compressed allreduce at 4 bits vs ``mpx.collectives.allreduce`` (full
   precision, ``impl="auto"``) vs MPI's own ``Allreduce``; time is the slowest
   rank's median, wire bytes are what one rank sends. Once on shared memory,
   once over a 1 Gbit/s link (see ``shaped_link``: a private network namespace,
   no root needed, nothing outside it is touched).
3. DDP over that 1 Gbit/s link: step time of torch's DistributedDataParallel on
   the ``"cgx"`` backend at 4 bits (``CGX_COMPRESSION_QUANTIZATION_BITS=4``)
   against the ``"mpx"`` backend (fp32), the data-parallel benchmark's 9.5 M
   parameter MLP, 2 ranks, one job (``ddp_job``); ``--ddp-runs N`` repeats the
   job and reports the range.
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
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the functions that run import torch
    import torch

KERNEL_SIZES = [1 << 20, 1 << 22, 1 << 24, 1 << 26]
REFERENCE_MAX = 1 << 22
ALLREDUCE_BYTES = [1 << 20, 4 << 20, 16 << 20, 64 << 20]


def _label(count: int) -> str:
    return f"{count >> 20}M" if count >= 1 << 20 else f"{count >> 10}K"


# Callable[..., object]: the lambdas bind loop variables as defaults (x=x),
# which mypy cannot fit to a Callable[[], object].
def _best(
    fn: Callable[..., object], repeats: int, sync: Callable[[], None] = lambda: None
) -> float:
    """Median time of ``fn``; ``sync`` waits for a device's queued work (CUDA is asynchronous)."""
    fn()  # warm-up: page faults, thread start
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def naive_torch_round_trip(x: torch.Tensor, bits: int, bucket: int, out: torch.Tensor) -> None:
    """The quantizer a user would write in torch (bits dividing 8, length divisible by bucket)."""
    import torch

    levels = (1 << bits) - 1
    rows = x.view(-1, bucket)
    mn = rows.amin(1, keepdim=True)
    unit = (rows.amax(1, keepdim=True) - mn) / levels
    codes = ((rows - mn) / unit + torch.rand_like(rows)).floor_().clamp_(0, levels)
    per = 8 // bits
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=x.device)
    packed = (codes.to(torch.uint8).view(-1, per) << shifts).sum(1, dtype=torch.uint8)
    back = (packed.view(-1, 1) >> shifts) & levels
    out.view(-1, bucket).copy_(back.view(-1, bucket).float() * unit + mn)


def kernels(device: str = "cpu", sizes: list[int] = KERNEL_SIZES) -> None:
    """The kernel table; on ``device="cuda"`` the CUDA kernels against a device copy."""
    import torch

    import mpx.quantize as mq
    from mpx.quantize import reference

    cuda = device.startswith("cuda")
    kind = "CUDA" if cuda else "C++"
    copy_name = "device copy" if cuda else "memcpy"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    print(
        f"| values | bits | bucket | {kind} quantize (GB/s) | {kind} quantize into `out` (GB/s) | "
        f"{kind} dequantize (GB/s) | plain torch q+dq (GB/s) | mpx reference q+dq (GB/s) | "
        f"{copy_name} (GB/s) | {kind} q+dq ÷ plain torch | {kind} q+dq (into `out`) ÷ "
        f"{copy_name} |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for count in sizes:
        x = torch.randn(count, device=device)
        out = torch.empty_like(x)
        nbytes = x.numel() * 4
        reps = max(3, min(20, (1 << 26) // count))
        copy = _best(lambda x=x, out=out: out.copy_(x), reps, sync)
        cases = [(4, 512), (4, 1024)] + ([(2, 512), (8, 512)] if count == sizes[-1] else [])
        for bits, bucket in cases:
            gen = torch.Generator().manual_seed(0)
            tq = _best(
                lambda x=x, b=bits, s=bucket, g=gen: mq.quantize(x, b, s, generator=g), reps, sync
            )
            q = mq.quantize(x, bits, bucket, generator=gen)
            # Into a reused buffer, as memcpy writes into ``out``: no page faults.
            tqo = _best(
                lambda x=x, b=bits, s=bucket, g=gen, q=q: mq.quantize(x, b, s, generator=g, out=q),
                reps,
                sync,
            )
            tdq = _best(lambda q=q, out=out: mq.dequantize(q, out=out), reps, sync)
            tnaive = _best(
                lambda x=x, b=bits, s=bucket, out=out: naive_torch_round_trip(x, b, s, out),
                max(1, reps // 4),
                sync,
            )
            ref = "—"
            if count <= REFERENCE_MAX:

                def ref_round_trip(
                    x: torch.Tensor = x, b: int = bits, s: int = bucket, out: torch.Tensor = out
                ) -> None:
                    reference.dequantize(reference.quantize(x, b, s, seed=1), out=out)

                tref = _best(ref_round_trip, 1, sync)
                ref = f"{nbytes / tref / 1e9:.3f}"
            print(
                f"| {_label(count)} | {bits} | {bucket} | {nbytes / tq / 1e9:.2f} | "
                f"{nbytes / tqo / 1e9:.2f} | "
                f"{nbytes / tdq / 1e9:.2f} | {nbytes / tnaive / 1e9:.2f} | {ref} | "
                f"{nbytes / copy / 1e9:.2f} | {tnaive / (tq + tdq):.1f}× | "
                f"{copy / (tqo + tdq):.2f} |",
                flush=True,
            )


def allreduce_job(sizes: list[int], repeats: int) -> None:
    """Runs inside the mpxrun job: every rank times, rank 0 prints rows."""
    import torch
    from mpi4py import MPI

    import mpx.quantize as mq
    from mpx.collectives import allreduce, world

    comm = world()
    raw = MPI.COMM_WORLD
    n = comm.size

    # Callable[..., object]: the lambdas bind loop variables as defaults (x=x),
    # which mypy cannot fit to a Callable[[], object].
    def timed(fn: Callable[..., object], reps: int) -> float:
        fn()
        samples = []
        for _ in range(reps):
            raw.Barrier()
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return float(raw.allreduce(statistics.median(samples), op=MPI.MAX))

    for nbytes in sizes:
        x = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(comm.rank))
        reps = repeats or max(3, min(30, (64 << 20) // nbytes * 2))
        config = mq.CompressionConfig(bits=4, bucket_size=512)
        state = mq.QuantizeState(config, comm)
        t_q = timed(
            lambda x=x, c=config, s=state: mq.allreduce(x.clone(), comm, config=c, state=s), reps
        )
        wire_q = state.bytes_sent // (reps + 1)
        t_mpx = timed(lambda x=x: allreduce(x.clone(), comm=comm), reps)
        t_mpi = timed(lambda x=x: raw.Allreduce(MPI.IN_PLACE, x.clone().numpy()), reps)
        wire_fp32 = 2 * (n - 1) * nbytes // n
        if comm.rank == 0:
            print(
                f"| {nbytes >> 20} MiB | {t_q * 1e3:.1f} | {t_mpx * 1e3:.1f} | {t_mpi * 1e3:.1f} | "
                f"{t_q / t_mpx:.2f} | {t_q / t_mpi:.2f} | {wire_q / 2**20:.2f} | "
                f"{wire_fp32 / 2**20:.2f} | {wire_q / wire_fp32:.3f} |",
                flush=True,
            )
    if os.environ.get("MPX_BENCH_SKIP_FINALIZE"):
        # libfabric's tcp provider fails MPI_Finalize on the namespaced loopback
        # ("fabricclose ... busy") after the work is done: leave without it.
        raw.Barrier()
        sys.stdout.flush()
        os._exit(0)


TABLE_HEAD = (
    "| size | 4-bit mpx.quantize (ms) | mpx.collectives fp32 (ms) | MPI Allreduce (ms) | "
    "÷ mpx.collectives | ÷ MPI | wire 4-bit (MiB) | wire fp32 ring (MiB) | wire ratio |\n"
    "|---|---|---|---|---|---|---|---|---|"
)

# The 1 Gbit/s link: a private network namespace (unshare -rn: no root needed,
# nothing outside it changes) whose loopback is shaped by a token bucket; MPICH
# is told to treat the ranks as remote (NOLOCAL) and to talk TCP over it, and
# mpx.collectives to use MPI's collectives (its shm path would bypass the link).
# Both directions share the one loopback queue: a half-duplex 1 Gbit/s link.
SHAPED_SETUP = (
    "ip link set lo up && tc qdisc add dev lo root tbf rate 1gbit burst 256kb latency 100ms"
)
SHAPED_ENV = {
    "MPIR_CVAR_NOLOCAL": "1",
    "MPIR_CVAR_CH4_NETMOD": "ofi",
    "FI_PROVIDER": "tcp",
    "MPX_COLLECTIVES_IMPL": "mpi",
    "MPX_BENCH_SKIP_FINALIZE": "1",
}
SHAPED_BYTES = [1 << 20, 16 << 20, 64 << 20, 256 << 20]


def _job(sizes: list[int], repeats: int) -> list[str]:
    mpxrun = shutil.which("mpxrun", path=os.path.dirname(sys.executable)) or "mpxrun"
    return [
        mpxrun,
        "-n",
        "2",
        "--timeout",
        "600",
        "--",
        sys.executable,
        os.path.abspath(__file__),
        "--inside",
        "--sizes",
        ",".join(str(b) for b in sizes),
        "--repeats",
        str(repeats),
    ]


# DDP over the link: the data-parallel benchmark's model (1024-2048-2048-1024-1024-10).
DDP_WIDTHS = [1024, 2048, 2048, 1024, 1024, 10]
DDP_BATCH = 32  # per rank
DDP_STEPS = 3
DDP_ROUNDS = 3


def ddp_job() -> None:
    """Inside the shaped job: DDP step time on "mpx" (fp32) and on "cgx" (the CGX_* bits)."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI
    from torch import nn

    from mpx.collectives import init_process_group, world
    from mpx.launch import init_torch_env

    init_torch_env()
    init_process_group("env://")  # the default group: "mpx"
    cgx = dist.new_group(backend="cgx")
    raw = MPI.COMM_WORLD
    g = torch.Generator().manual_seed(world().rank)
    x = torch.randn(DDP_BATCH, DDP_WIDTHS[0], generator=g)
    y = torch.randint(0, DDP_WIDTHS[-1], (DDP_BATCH,), generator=g)
    steps = {}
    for name, group in (("mpx", None), ("cgx", cgx)):
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(itertools.pairwise(DDP_WIDTHS)):
            layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(DDP_WIDTHS) - 2 else [])
        model = nn.parallel.DistributedDataParallel(nn.Sequential(*layers), process_group=group)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def step(model: nn.Module = model, opt: torch.optim.Optimizer = opt) -> None:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        steps[name] = step
    best = dict.fromkeys(steps, float("inf"))
    for fn in steps.values():
        fn()  # warm-up
    for _ in range(DDP_ROUNDS):
        for name, fn in steps.items():
            raw.Barrier()
            start = time.perf_counter()
            for _ in range(DDP_STEPS):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / DDP_STEPS)
    slowest = {name: float(raw.allreduce(t, op=MPI.MAX)) for name, t in best.items()}
    if raw.Get_rank() == 0:
        print(f"DDP {slowest['mpx']} {slowest['cgx']}", flush=True)
    raw.Barrier()
    sys.stdout.flush()
    os._exit(0)  # as allreduce_job: MPI_Finalize fails on the namespaced loopback


def shaped_ddp(runs: int) -> None:
    import shlex

    print(
        f"\nDDP over the same 1 Gbit/s link: torch DistributedDataParallel, MLP "
        f"{'-'.join(map(str, DDP_WIDTHS))} (9.5 M float32 parameters), batch {DDP_BATCH} per "
        f"rank, SGD with momentum, 2 ranks; step time = the slowest rank's best mean over "
        f"{DDP_ROUNDS} rounds of {DDP_STEPS} steps, the backends taking turns in one job; "
        f'range over {runs} job(s). `cgx` = `init_process_group("cgx")` with '
        "`CGX_COMPRESSION_QUANTIZATION_BITS=4` (bucket 512).\n"
    )
    if not (shutil.which("unshare") and shutil.which("tc") and shutil.which("ip")):
        print("(skipped: needs unshare, ip and tc)")
        return
    env = " ".join(f"{k}={v}" for k, v in SHAPED_ENV.items())
    mpxrun = shutil.which("mpxrun", path=os.path.dirname(sys.executable)) or "mpxrun"
    job = [mpxrun, "-n", "2", "--timeout", "600", "--", sys.executable]
    job += [os.path.abspath(__file__), "--inside-ddp"]
    inner = (
        f"{SHAPED_SETUP} && exec env {env} CGX_COMPRESSION_QUANTIZATION_BITS=4 {shlex.join(job)}"
    )
    times: dict[str, list[float]] = {"mpx": [], "cgx": []}
    for _ in range(runs):
        done = subprocess.run(
            ["unshare", "-rn", "bash", "-c", inner], capture_output=True, text=True, check=False
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("DDP ")]
        if done.returncode or not lines:
            print(f"(the shaped DDP run failed with exit code {done.returncode})")
            sys.stderr.write(done.stdout + done.stderr)
            return
        mpx_s, cgx_s = (float(v) for v in lines[-1].split()[1:])
        times["mpx"].append(mpx_s)
        times["cgx"].append(cgx_s)

    def span(values: list[float], scale: float = 1e3, fmt: str = ".0f") -> str:
        low, high = min(values) * scale, max(values) * scale
        return f"{low:{fmt}}" if f"{low:{fmt}}" == f"{high:{fmt}}" else f"{low:{fmt}}–{high:{fmt}}"

    ratios = [c / m for c, m in zip(times["cgx"], times["mpx"], strict=True)]
    print("| backend | DDP step time (ms) | ÷ mpx fp32 |")
    print("|---|---|---|")
    print(f"| mpx (fp32) | {span(times['mpx'])} | 1.00 |")
    print(f"| cgx, 4 bits | {span(times['cgx'])} | {span(ratios, 1.0, '.2f')} |")


def shaped_link() -> None:
    print(
        "\nThe same over a 1 Gbit/s link: both ranks in a private network namespace "
        "(`unshare -rn`) whose loopback is shaped with `tc qdisc add dev lo root tbf rate "
        "1gbit burst 256kb latency 100ms` (both directions share it), MPICH forced onto "
        "TCP (`MPIR_CVAR_NOLOCAL=1 MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp`) and "
        "`MPX_COLLECTIVES_IMPL=mpi`.\n"
    )
    if not (shutil.which("unshare") and shutil.which("tc") and shutil.which("ip")):
        print("(skipped: needs unshare, ip and tc)")
        return
    import shlex

    env = " ".join(f"{k}={v}" for k, v in SHAPED_ENV.items())
    inner = f"{SHAPED_SETUP} && exec env {env} {shlex.join(_job(SHAPED_BYTES, 2))}"
    print(TABLE_HEAD, flush=True)
    done = subprocess.run(["unshare", "-rn", "bash", "-c", inner], check=False)
    if done.returncode:
        print(f"\n(the shaped run failed with exit code {done.returncode})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default="", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--skip-allreduce", action="store_true")
    parser.add_argument("--skip-shaped", action="store_true", help="no 1 Gbit/s link run")
    parser.add_argument(
        "--device", default="cpu", help="the kernels' tensors: cpu (default) or cuda"
    )
    parser.add_argument(
        "--kernel-sizes",
        default="",
        help="values per kernel row, comma-separated (default: 1M to 64M)",
    )
    parser.add_argument("--inside-ddp", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ddp-runs", type=int, default=3, help="jobs of the DDP-over-link run")
    parser.add_argument("--only-ddp", action="store_true", help="only the DDP-over-link run")
    args = parser.parse_args()
    if args.inside:
        allreduce_job([int(b) for b in args.sizes.split(",")], args.repeats)
        return
    if args.inside_ddp:
        ddp_job()
        return
    if args.only_ddp:
        shaped_ddp(args.ddp_runs)
        return
    import torch

    print("## mpx-quantize: kernels and the compressed allreduce\n")
    print(
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), Python {platform.python_version()}, MPICH "
        "wheel (`python packages/quantize/benchmarks/bench_quantize.py`). Kernels: float32 "
        "input, stochastic rounding, GB/s of input, median of repeats; ratios > 1 mean the "
        "C++ kernel is faster.\n"
    )
    if args.device.startswith("cuda"):
        print(
            f"Device: {torch.cuda.get_device_name(torch.device(args.device))}; CUDA kernels on "
            "device tensors, each timing waits for the device (`torch.cuda.synchronize`); "
            "device copy = `out.copy_(x)` on the device, GB/s of input.\n"
        )
    if not args.skip_kernels:
        sizes = [int(v) for v in args.kernel_sizes.split(",")] if args.kernel_sizes else None
        kernels(args.device, sizes or KERNEL_SIZES)
    if args.skip_allreduce:
        return
    print(
        "\nAllreduce of float32 on 2 ranks (shared memory), 4 bits, bucket 512, stochastic; "
        "time is the slowest rank's median; ratio = compressed time ÷ peer time (lower is "
        "better); wire = bytes one rank sends (fp32: a ring allreduce's 2(n-1)/n of the data).\n"
    )
    print(TABLE_HEAD, flush=True)
    subprocess.run(_job(ALLREDUCE_BYTES, 0), check=True)
    if not args.skip_shaped:
        shaped_link()
        shaped_ddp(args.ddp_runs)


if __name__ == "__main__":
    main()
