"""float32 allreduce and broadcast: every mpx implementation beside MPI's own and gloo.

``python bench_allreduce.py`` starts itself under ``mpxrun -n 2`` and ``-n 3``
and prints one markdown section (``nox -s bench`` writes it into
BENCHMARKS.md). For each rank count it first tunes the policy for this
machine (``mpxrun --tune`` into a temporary file), then, for every size, runs
the peers in the same job, taking turns over 5 interleaved rounds (so that a
burst of load elsewhere hits every row alike): mpi4py's ``Allreduce`` in place
and out of place (MPI's own), torch ``gloo``, and mpx's ``mpi``, ``ring``,
``shm``, ``auto`` with the built-in policy (also with shm's flag-based small
allreduce off, ``MPX_SHM_FLAG_BYTES=0``) and ``auto`` with the tuned one, and
``shm`` on a tensor from ``empty_shared`` (zero copy), and, where DeepSpeed is
installed and its CPU shared-memory op builds, DeepSpeed's
``inference_all_reduce`` (a sum; ``MPX_BENCH_DEEPSPEED=0`` leaves it out). A second table
puts each ``auto`` beside the fastest of mpx's implementations at that size,
and a third times single blocking 4 KiB calls against mpi4py's own on a
prepared buffer. Time is the best of the samples (each the slowest rank's), a sample
being the mean of a burst of calls after a barrier that lasts at least 10 ms
(at most 1024 calls: one small call is shorter than the ranks' skew at the
barrier);
algorithm bandwidth = bytes / time, bus bandwidth = algbw * 2(n-1)/n
(nccl-tests' definition).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

# MPX_BENCH_MAX_BYTES=64K: a quick run of the small sizes only (a smoke test).
MAX_BYTES = os.environ.get("MPX_BENCH_MAX_BYTES", "256M")
SIZES = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]
IMPLS = ["mpi", "ring", "shm"]
AUTOS = {"auto (built-in)": "none", "auto (tuned)": "tuned"}
# auto as before shm's flag-based small allreduce (MPX_SHM_FLAG_BYTES=0): MPI
# below MPX_AUTO_SMALL_BYTES, shm's slots above -- the A/B of issue 46.
FLAGS_OFF = {"auto (built-in, flags off)": "noflags"}
ROUNDS = 5  # interleaved rounds over the contenders of one size
DEEPSPEED_ROW = "DeepSpeed shm (inference_all_reduce)"


def _deepspeed_allreduce(n_ranks: int) -> tuple[Callable[[Any], object] | None, str]:
    """DeepSpeed's CPU shared-memory allreduce, or None and why it cannot run here.

    An optional peer (issue 46): DeepSpeed JIT-builds its shm op on first use
    (about two minutes, then cached under ~/.cache/torch_extensions) and falls
    back to ``torch.distributed.all_reduce`` -- gloo here -- when the op did not
    build or the CPU lacks AVX2; such a fallback is reported as a skip, never
    timed under DeepSpeed's name. Runs after ``init_process_group("gloo")``:
    DeepSpeed wraps the existing group.
    """
    if os.environ.get("MPX_BENCH_DEEPSPEED", "1") == "0":
        return None, "left out (MPX_BENCH_DEEPSPEED=0)"
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # the shm op sizes its segment by the ranks on this node
    os.environ.setdefault("LOCAL_SIZE", str(n_ranks))
    try:
        import deepspeed
        import deepspeed.comm as ds_comm
    except ImportError as exc:
        return None, f"not installed ({exc}); `pip install deepspeed` to add it"
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    backend = ds_comm.comm.cdb
    if getattr(backend, "shm_comm_op", None) is None:
        return None, "DeepSpeed's shm op did not build here (it would fall back to gloo)"
    if getattr(backend, "shm_vector_kernel_level", 0) < 1:
        return None, "DeepSpeed's fp32 shm kernel needs AVX2 (it would fall back to gloo)"
    op = torch.distributed.ReduceOp.SUM
    return (lambda x: ds_comm.inference_all_reduce(x, op)), f"DeepSpeed {deepspeed.__version__}"


def _label(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def measure(tuned: str) -> None:
    """Runs inside the job: every rank times, rank 0 prints table rows."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from mpx.collectives import allreduce, broadcast, empty_shared, world
    from mpx.collectives.tune import time_interleaved
    from mpx.launch import init_torch_env
    from mpx.launch.settings import reload

    def use_policy(which: str) -> None:
        # Every rank switches together: the next call decides afresh.
        os.environ["MPX_POLICY_FILE"] = tuned if which == "tuned" else "none"
        if which == "noflags":
            os.environ["MPX_SHM_FLAG_BYTES"] = "0"
        else:
            os.environ.pop("MPX_SHM_FLAG_BYTES", None)
        reload()

    comm = world()
    init_torch_env()
    dist.init_process_group("gloo")
    n = comm.size
    raw = MPI.COMM_WORLD
    ds_allreduce, ds_about = _deepspeed_allreduce(n)
    if comm.rank == 0:
        print(f"DEEPSPEED {n} ranks: {ds_about}", flush=True)

    # Callable[..., object]: the lambdas bind loop variables as defaults (x=x),
    # which mypy cannot fit to a Callable[[], object].
    Contenders = dict[str, tuple[Callable[..., object], str]]

    def timed(contenders: Contenders, nbytes: int) -> dict[str, float]:
        """Each contender's time per call: the tuner's estimator (``time_interleaved``).

        Interleaved rounds, each starting at another contender, so a burst of
        load from elsewhere on the machine hits them all alike instead of one
        row (which made 'auto' look up to 3.8x slower than the very
        implementation it runs); bursts of >= 10 ms, the best sample of the
        slowest rank. Each contender's policy ("none" or "tuned") is set on
        every rank before its turn.
        """
        warmed: set[str] = set()

        def before_turn(name: str) -> None:
            fn, policy = contenders[name]
            use_policy(policy)
            # warm-up: workspaces, page faults, connections; then a call or
            # two to find the caches of this contender again
            for _ in range(2 if name in warmed else 3):
                fn()
            warmed.add(name)

        per_round = 4 if nbytes <= 1 << 20 else 1  # small sizes are cheap and noisy
        runners = {name: fn for name, (fn, _) in contenders.items()}
        figures = time_interleaved(runners, raw, ROUNDS, per_round, before_turn)
        use_policy("none")
        return figures

    summary: list[str] = []
    ds_rows: list[str] = []
    from mpx.launch.settings import parse_size

    for nbytes in (s for s in SIZES if s <= parse_size(MAX_BYTES)):
        x = torch.ones(nbytes // 4)
        out = torch.empty_like(x)
        shared = empty_shared(nbytes // 4)
        shared.fill_(1.0)
        contenders: Contenders = {
            "MPI Allreduce": (lambda x=x: raw.Allreduce(MPI.IN_PLACE, x.numpy()), "none"),
            "MPI Allreduce, out of place": (
                lambda x=x, out=out: raw.Allreduce(x.numpy(), out.numpy()),
                "none",
            ),
            "gloo": (lambda x=x: dist.all_reduce(x), "none"),
        }
        for impl in IMPLS:
            contenders[f"mpx {impl}"] = (lambda impl=impl, x=x: allreduce(x, impl=impl), "none")
        # torch's gloo again, as an mpx implementation (TorchMPI's per-call choice)
        contenders["mpx gloo (impl='gloo')"] = (lambda x=x: allreduce(x, impl="gloo"), "none")
        for label, which in {**AUTOS, **FLAGS_OFF}.items():
            contenders[f"mpx {label}"] = (lambda x=x: allreduce(x), which)
        contenders["mpx shm, empty_shared tensor"] = (
            lambda s=shared: allreduce(s, impl="shm"),
            "none",
        )
        if ds_allreduce is not None:
            contenders[DEEPSPEED_ROW] = (lambda x=x, f=ds_allreduce: f(x), "none")
            _check_same_sum(ds_allreduce, nbytes // 4, raw)
        times = timed(contenders, nbytes)
        if ds_allreduce is not None:
            auto, ds = times["mpx auto (built-in)"], times[DEEPSPEED_ROW]
            ds_rows.append(
                f"| {n} | {_label(nbytes)} | {ds * 1e3:.3f} | {auto * 1e3:.3f} | {auto / ds:.3g} |"
            )
        best_name = min((f"mpx {i}" for i in IMPLS), key=times.__getitem__)
        mpi_best = min(times["MPI Allreduce"], times["MPI Allreduce, out of place"])
        summary.append(
            f"| {n} | {_label(nbytes)} | {best_name.removeprefix('mpx ')} | "
            f"{times['mpx auto (built-in)'] / times[best_name]:.2f} | "
            f"{times['mpx auto (tuned)'] / times[best_name]:.2f} | "
            f"{mpi_best / times['mpx auto (tuned)']:.2f} |"
        )
        base, gloo = times["MPI Allreduce"], times["gloo"]
        for name, seconds in times.items():
            algbw = nbytes / seconds / 1e9
            busbw = algbw * 2 * (n - 1) / n
            if comm.rank == 0:
                print(
                    f"| allreduce | {n} | {_label(nbytes)} | {name} | {seconds * 1e3:.3f} | "
                    f"{algbw:.2f} | {busbw:.2f} | {seconds / base:.2f} | {seconds / gloo:.2f} |",
                    flush=True,
                )
        if nbytes in (4 << 10, 64 << 20):
            bcontenders: Contenders = {
                "MPI Bcast": (lambda x=x: raw.Bcast(x.numpy(), root=0), "none"),
                "gloo": (lambda x=x: dist.broadcast(x, 0), "none"),
            }
            for impl in IMPLS:
                bcontenders[f"mpx {impl}"] = (
                    lambda impl=impl, x=x: broadcast(x, 0, impl=impl),
                    "none",
                )
            for label, which in AUTOS.items():
                bcontenders[f"mpx {label}"] = (lambda x=x: broadcast(x, 0), which)
            bcontenders["mpx shm, empty_shared tensor"] = (
                lambda s=shared: broadcast(s, 0, impl="shm"),
                "none",
            )
            btimes = timed(bcontenders, nbytes)
            for name, seconds in btimes.items():
                if comm.rank == 0:
                    print(
                        f"| broadcast | {n} | {_label(nbytes)} | {name} | {seconds * 1e3:.3f} | "
                        f"{nbytes / seconds / 1e9:.2f} | | {seconds / btimes['MPI Bcast']:.2f} | "
                        f"{seconds / btimes['gloo']:.2f} |",
                        flush=True,
                    )
    latency = _single_calls(comm, raw)
    if comm.rank == 0:
        for row in summary:
            print(f"SUMMARY {row}", flush=True)
        for row in latency:
            print(f"LATENCY | {n} {row}", flush=True)
        for row in ds_rows:
            print(f"DSROW {row}", flush=True)
    dist.destroy_process_group()


def _check_same_sum(fn: Callable[[Any], object], count: int, raw: Any) -> None:
    """A peer's row counts only if it computed the sum: checked against mpx's before timing."""
    import torch
    from mpi4py import MPI

    from mpx.collectives import allreduce

    mine = torch.arange(count, dtype=torch.float32).remainder_(97).add_(raw.Get_rank())
    theirs = mine.clone()
    fn(theirs)
    allreduce(mine)
    # every rank decides together: one rank leaving alone would hang the rest
    if not raw.allreduce(bool(torch.equal(mine, theirs)), op=MPI.LAND):
        raise SystemExit(f"{DEEPSPEED_ROW} gave another sum than mpx's at {count} floats")


def _single_calls(comm: Any, raw: Any) -> list[str]:
    """Blocking 4 KiB allreduce, one call at a time in a tight loop, against mpi4py's own."""
    import torch
    from mpi4py import MPI

    from mpx.collectives import allreduce

    t = torch.ones(1024)
    prepared = [MPI.buffer.fromaddress(t.data_ptr(), t.nbytes), MPI.FLOAT]
    calls: dict[str, Callable[[], object]] = {
        "mpi4py Iallreduce+Wait, prepared buffer": lambda: raw.Iallreduce(
            MPI.IN_PLACE, prepared
        ).Wait(),
        "mpi4py Allreduce, numpy array": lambda: raw.Allreduce(MPI.IN_PLACE, t.numpy()),
        "mpx allreduce": lambda: allreduce(t),
    }
    best = {name: float("inf") for name in calls}
    for _ in range(5):  # interleaved rounds: load bursts hit every contender alike
        for name, fn in calls.items():
            for _ in range(500):
                fn()
            raw.Barrier()
            start = time.perf_counter()
            for _ in range(5000):
                fn()
            mine = (time.perf_counter() - start) / 5000
            best[name] = min(best[name], float(raw.allreduce(mine, op=MPI.MAX)))
    base = best["mpi4py Iallreduce+Wait, prepared buffer"]
    return [f"| {name} | {sec * 1e6:.2f} | {sec / base:.2f} |" for name, sec in best.items()]


def _checked(command: list[str]) -> subprocess.CompletedProcess[str]:
    """Runs a job, its output captured; on failure its stderr is shown, then it raises."""
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-8000:])
        raise subprocess.CalledProcessError(done.returncode, command)
    return done


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tuned", default="", help=argparse.SUPPRESS)
    parser.add_argument(
        "--ranks", default="2,3", help="rank counts, one job each, comma-separated (default 2,3)"
    )
    args = parser.parse_args()
    if args.inside:
        measure(args.tuned)
        return
    mpxrun = shutil.which("mpxrun", path=os.path.dirname(sys.executable)) or "mpxrun"
    print("## mpx-collectives: float32 allreduce and broadcast\n")
    print(
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, MPICH wheel; one job per rank count, all peers in the "
        "same job (`python packages/collectives/benchmarks/bench_allreduce.py`). "
        "Time is the best sample (each the slowest rank's), a sample the mean of a burst of calls "
        "after a barrier, lasting >= 10 ms (at most 1024 calls), the peers of one size "
        "taking turns over 5 interleaved rounds; "
        "ratio = time ÷ MPI's own (lower is better). "
        "3 ranks on 2 cores are oversubscribed.\n"
    )
    print(
        "| op | ranks | size | implementation | time (ms) | algbw (GB/s) | busbw (GB/s) "
        "| ÷ MPI | ÷ gloo |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    summaries, latencies, policies, ds_rows, ds_about = [], [], [], [], []
    here = os.path.abspath(__file__)
    with tempfile.TemporaryDirectory() as tmp:
        for nprocs in (int(n) for n in args.ranks.split(",")):
            tuned = os.path.join(tmp, f"policy-{nprocs}.json")
            job = [mpxrun, "-n", str(nprocs), "--timeout", "1200"]
            tune = [*job, "--tune", "--", "--ops", "allreduce,broadcast"]
            tune += ["--max-size", MAX_BYTES, "--output", tuned]
            tuning = _checked(tune)
            bands = [
                b for b in tuning.stdout.splitlines() if b.startswith(("allreduce:", "broadcast:"))
            ]
            policies.append(f"{nprocs} ranks: " + "; ".join(bands))
            inside = [*job, "--", sys.executable, here, "--inside", "--tuned", tuned]
            run = _checked(inside)
            for line in run.stdout.splitlines():
                if line.startswith("SUMMARY "):
                    summaries.append(line.removeprefix("SUMMARY "))
                elif line.startswith("LATENCY "):
                    latencies.append(line.removeprefix("LATENCY "))
                elif line.startswith("DSROW "):
                    ds_rows.append(line.removeprefix("DSROW "))
                elif line.startswith("DEEPSPEED "):
                    ds_about.append(line.removeprefix("DEEPSPEED "))
                elif line.startswith("|"):
                    print(line)
    print(
        "\n### auto against the fastest implementation\n\n"
        "The tuned policy was measured just before each job, by `mpxrun -n N --tune` "
        "(allreduce and broadcast, 4 KiB to 256 MiB), on the same machine:\n"
    )
    for line in policies:
        print(f"- {line}")
    print(
        "\n| ranks | size | fastest mpx implementation | auto, built-in ÷ fastest "
        "| auto, tuned ÷ fastest | faster MPI form ÷ auto (tuned) |"
    )
    print("|---|---|---|---|---|---|")
    for row in summaries:
        print(row)
    print(
        "\n### Single blocking 4 KiB allreduce, one call at a time\n\n"
        "Best of 5 interleaved rounds of 5000 calls, slowest rank; "
        "÷ mpi4py's `Iallreduce(IN_PLACE, prepared buffer).Wait()`.\n"
    )
    print("| ranks | call | µs | ÷ mpi4py on a prepared buffer |")
    print("|---|---|---|---|")
    for row in latencies:
        print(row)
    print(
        "\n### Against DeepSpeed's CPU shared-memory allreduce\n\n"
        "DeepSpeed's `inference_all_reduce` (its JIT-built shm op) in the same job as the rows "
        "above, float32 sum; its result checked equal to mpx's before timing.\n"
    )
    for line in ds_about:
        print(f"- {line}")
    if ds_rows:
        print("\n| ranks | size | DeepSpeed shm (ms) | mpx auto, built-in (ms) | mpx ÷ DeepSpeed |")
        print("|---|---|---|---|---|")
        for row in ds_rows:
            print(row)


if __name__ == "__main__":
    main()
