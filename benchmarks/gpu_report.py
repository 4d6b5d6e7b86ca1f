"""One command on a lent GPU: mpx's CUDA tests and every benchmark, tables into one folder.

Usage (DEVELOPERS.md says how to call it on the device tool)::

    python3 benchmarks/gpu_report.py [--group tests|gpu|cpu|all] [--out DIR]
                                     [--install WHEELS] [--only PART,...]
    python3 benchmarks/gpu_report.py --cpu-smoke     # the plumbing, on CPU, tiny sizes
    nox -s gpu-report                                # installs (CUDA ON) first; needs a network

Kept at the repository's root, beside ``tests/``, because it spans every
package: it runs their ``gpu``-marked tests and their benchmarks
(``packages/*/benchmarks``), adding only the two GPU jobs that belong to no
single package's benchmark (CUDA allreduce through every path, DDP on a
ResNet).

Without a CUDA GPU (and without ``--cpu-smoke``) it exits with status 2 and
says what is missing, having run nothing. Otherwise each part runs as a
subprocess with its own time budget, so that a hang or a crash costs that part
only; as each part ends, its tables are appended to ``gpu-report.md`` and its
whole output to ``gpu-report.log`` in ``$OUT`` (if set, else ``./gpu-report``),
so a run stopped from outside still leaves what it measured. Exit status: 0 if
every part passed, 1 if one failed or ran out of time.

The device tool allows 10 minutes per command, and the parts' budgets add up
to 21: ``--follow 560`` starts the report detached (its own session, which
the tool leaves running while the machine is held) in ``STATE``, follows it for
560 s from the command's start, copies its files into the output folder and
exits 3 while it still runs; the same command, called again, follows the same
run (``--group`` cuts the report into parts by hand instead).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

STATE = "/tmp/mpx-gpu-report"  # the detached run's folder (--follow; --state)
EXIT_STILL_RUNNING = 3
ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["launch", "collectives", "quantize", "mgrit", "pipeline", "dataparallel"]
TEST_PATHS = [f"packages/{name}/tests" for name in PACKAGES] + ["tests"]
EXIT_NO_GPU = 2
SKIPPED_NO_GPU = "skipped: no GPU (--cpu-smoke)"


def _markdown(output: str) -> str:
    """The benchmark's own markdown: everything it printed but log noise."""
    return "\n".join(
        line for line in output.splitlines() if not line.startswith(("[rank", "Traceback"))
    )


@dataclasses.dataclass(frozen=True)
class Part:
    """One step of the report: a command, its time budget, and what it needs."""

    name: str
    group: str  # tests, gpu or cpu: one device-tool call each
    title: str
    budget_s: float
    command: Callable[[bool], list[list[str]]]  # smoke -> the commands, run one after another
    gpu_only: bool = False
    env: Callable[[bool], dict[str, str]] = lambda smoke: {}
    tables: Callable[[str], str] = _markdown


def _mpxrun(n: int, *args: str) -> list[str]:
    mpxrun = shutil.which("mpxrun", path=os.path.dirname(sys.executable)) or "mpxrun"
    return [mpxrun, "-n", str(n), "--timeout", "580", "--", sys.executable, *args]


def _bench(package: str, name: str) -> str:
    return str(ROOT / "packages" / package / "benchmarks" / f"{name}.py")


_OUTCOME = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b ?(.*)$")


def pytest_outcomes(output: str) -> str:
    """A table of pytest's ``-rA`` summary lines: one row per test (per skip reason)."""
    # dict: once each, in order (under mpxrun every rank prints its summary).
    rows = list(dict.fromkeys(m.groups() for m in map(_OUTCOME.match, output.splitlines()) if m))
    totals = [
        line
        for line in output.splitlines()
        if re.match(r"^=+ .*\d+ (passed|failed|skipped|error)", line)
    ]
    if not rows:
        return "No test outcome was reported (see gpu-report.log)."
    body = "\n".join(f"| {outcome} | `{what.replace('|', '/')}` |" for outcome, what in rows)
    summary = f"\n\n{totals[-1].strip('= ')}" if totals else ""
    return f"| outcome | test |\n|---|---|\n{body}{summary}"


def _pytest(marker: str) -> list[str]:
    return ["-m", "pytest", *TEST_PATHS, "-m", marker, "-rA", "-q", "-p", "no:cacheprovider"]


PARTS = [
    Part(
        "gpu-tests",
        "tests",
        "`pytest -m 'gpu and not mpi'` (MPX_REQUIRE_GPU=1)",
        180,
        lambda smoke: [[sys.executable, *_pytest("gpu and not mpi")]],
        gpu_only=True,
        env=lambda smoke: {"MPX_REQUIRE_GPU": "1"},
        tables=pytest_outcomes,
    ),
    Part(
        "gpu-mpi-tests",
        "tests",
        "`mpxrun -n 2 pytest -m 'gpu and mpi'` (both ranks on the one GPU)",
        180,
        lambda smoke: [_mpxrun(2, *_pytest("gpu and mpi"))],
        gpu_only=True,
        env=lambda smoke: {"MPX_REQUIRE_GPU": "1"},
        tables=pytest_outcomes,
    ),
    Part(
        "quantize-kernels",
        "gpu",
        "quantize/dequantize throughput vs device copy and the pure-torch reference",
        90,
        lambda smoke: [
            [
                sys.executable,
                _bench("quantize", "bench_quantize"),
                "--skip-allreduce",
                "--device",
                "cpu" if smoke else "cuda",
                *(["--kernel-sizes", str(1 << 16)] if smoke else []),
            ]
        ],
    ),
    Part(
        "allreduce-cuda",
        "gpu",
        "CUDA allreduce: staged, ipc, CUDA-aware MPI, NCCL and mpx through torch.distributed",
        120,
        lambda smoke: [
            _mpxrun(
                2,
                os.path.abspath(__file__),
                "--inner",
                "allreduce",
                *(["--cpu-smoke"] if smoke else []),
            )
        ],
    ),
    Part(
        "ddp-resnet",
        "gpu",
        "DDP on a ResNet, fp32 and 4-bit gradients, mpx vs NCCL",
        150,
        lambda smoke: [
            _mpxrun(
                2, os.path.abspath(__file__), "--inner", "ddp", *(["--cpu-smoke"] if smoke else [])
            )
        ],
    ),
    Part(
        "collectives-cpu",
        "cpu",
        "collectives on the CPU cores, 2 to 16 ranks",
        180,
        lambda smoke: [
            [
                sys.executable,
                _bench("collectives", "bench_allreduce"),
                "--ranks",
                "2" if smoke else "2,4,8,16",
            ]
        ],
        env=lambda smoke: {"MPX_BENCH_MAX_BYTES": "4K" if smoke else "16M"},
    ),
    Part(
        "dataparallel-cpu",
        "cpu",
        "data parallel on the CPU cores, 2 to 8 ranks",
        120,
        lambda smoke: [
            [
                sys.executable,
                _bench("dataparallel", "bench_dataparallel"),
                "--ranks",
                "2" if smoke else "2,4,8",
            ]
        ],
        env=lambda smoke: {"MPX_BENCH_STEPS": "1", "MPX_BENCH_ROUNDS": "1"} if smoke else {},
    ),
    Part(
        "pipeline-cpu",
        "cpu",
        "pipeline, 2, 4 and 8 stages",
        120,
        lambda smoke: [
            [sys.executable, _bench("pipeline", "bench_pipeline"), "--stages", str(p)]
            for p in ((2,) if smoke else (2, 4, 8))
        ],
        env=lambda smoke: {"MPX_BENCH_BATCH": "256", "MPX_BENCH_ONLY": "gpipe"} if smoke else {},
    ),
    Part(
        "mgrit-cpu",
        "cpu",
        "layer-parallel MGRIT, 1 to 16 ranks, speed-up vs the serial network",
        120,
        lambda smoke: [
            [
                sys.executable,
                _bench("mgrit", "bench_mgrit"),
                "--skip-solvers",
                "--ranks",
                "1,2" if smoke else "1,2,4,8,16",
            ]
        ],
    ),
]


def missing_gpu() -> str | None:
    """What stops the GPU report here, in words; None if nothing does."""
    try:
        import torch
    except ImportError:
        return "torch is not installed (python3 there must be the one that holds PyTorch)"
    if not torch.cuda.is_available():
        build = torch.version.cuda or "none: a CPU-only build"
        return (
            f"no CUDA GPU: torch {torch.__version__} (CUDA {build}) sees no CUDA device. "
            "Run this on a machine with an NVIDIA GPU and a CUDA build of torch, or pass "
            "--cpu-smoke to try the plumbing on CPU"
        )
    try:
        from mpx.quantize import available_backends
    except ImportError:
        return (
            "mpx is not installed: pass --install WHEELS (DEVELOPERS.md) or use nox -s gpu-report"
        )
    if "cuda" not in available_backends():
        return (
            "mpx.quantize was built without its CUDA kernels: reinstall it with "
            "MPX_QUANTIZE_CUDA=ON (--install does)"
        )
    return None


def install(wheels: str) -> None:
    """Installs the packages from this checkout, CUDA ON, with no network.

    ``wheels`` holds what the GPU machine's image lacks (the build backend
    hatchling and its needs, the MPICH wheel); the rest (torch, numpy, mpi4py,
    setuptools, Cython, scikit-build-core, pybind11) comes with the image.
    """
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
    found = sorted(str(p) for p in Path(wheels).glob("*.whl"))
    if found:
        subprocess.run([*pip, *found], check=True)
    env = os.environ | {"MPX_QUANTIZE_CUDA": "ON"}
    import torch

    if torch.cuda.is_available():
        # This GPU's architecture alone: the default four (sm_80 to sm_100) take
        # nvcc minutes longer, out of the device time.
        major, minor = torch.cuda.get_device_capability()
        env["CMAKE_ARGS"] = f"{env.get('CMAKE_ARGS', '')} -DCMAKE_CUDA_ARCHITECTURES={major}{minor}"
    paths = [str(ROOT / "packages" / name) for name in PACKAGES]
    subprocess.run([*pip, "--no-build-isolation", *paths], check=True, env=env)
    importlib.invalidate_caches()  # this process looks for mpx again (missing_gpu)


def _device_line(smoke: bool) -> str:
    import platform

    import torch

    device = "none (--cpu-smoke)" if smoke else torch.cuda.get_device_name()
    return (
        f"Device: {device}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
        f"{os.cpu_count()} CPU cores ({platform.machine()}); Python {platform.python_version()}."
    )


def run_part(part: Part, smoke: bool, md: Path, log: Path, budget_scale: float = 1.0) -> bool:
    """Runs one part within its budget; appends its tables and output. True if it passed."""
    budget = part.budget_s * budget_scale
    with md.open("a") as f:
        f.write(f"\n## {part.name}: {part.title}\n\n")
    if smoke and part.gpu_only:
        with md.open("a") as f:
            f.write(f"{SKIPPED_NO_GPU}\n")
        return True
    env = os.environ | {"PYTHONUNBUFFERED": "1"} | part.env(smoke)
    deadline = time.monotonic() + budget
    ok = True
    for command in part.command(smoke):
        left = deadline - time.monotonic()
        start = time.monotonic()
        status = ""
        try:
            out, err, code = _run_within(command, env, max(left, 1.0))
            if code is None:
                status = (
                    f"**timed out after its budget of {part.budget_s:g} s** (partial output above)"
                )
            elif code != 0:
                status = f"**failed: exit {code}** (see gpu-report.log)"
        except OSError as exc:  # the command could not start (a missing program)
            out, err, status = "", str(exc), f"**failed to start: {exc}**"
        ok = ok and not status
        with log.open("a") as f:
            f.write(f"\n===== {part.name}: {' '.join(command)}\n{out}\n----- stderr\n{err}\n")
        with md.open("a") as f:
            f.write(part.tables(out).strip() + "\n")
            if status:
                f.write(f"\n{status}\n")
            f.write(f"\n({time.monotonic() - start:.0f} s: `{_shown(command)}`)\n")
    return ok


def _run_within(
    command: list[str], env: dict[str, str], timeout: float
) -> tuple[str, str, int | None]:
    """stdout, stderr and exit status of ``command``; status None if it ran out of time.

    The command gets a process group of its own, so that running out of time
    ends all of it (an mpxrun job's ranks too), not only its first process:
    SIGTERM first (mpxrun stops its job on it), SIGKILL 10 s later.
    """
    import signal

    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
        return out, err, proc.returncode
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                out, err = proc.communicate(timeout=10)
                return out, err, None
            except subprocess.TimeoutExpired:
                continue
        # A process outside the group still holds the pipes: leave it, and its output.
        return "", "(output lost: a process of the part outlived SIGKILL of its group)", None


def _shown(command: list[str]) -> str:
    words = [os.path.relpath(w, ROOT) if w.startswith(str(ROOT)) else w for w in command]
    return " ".join(
        "python" if w == sys.executable else os.path.basename(w) if w.endswith("mpxrun") else w
        for w in words
    )


# ---- the GPU jobs of no single package's benchmark, run under mpxrun -n 2 ----


def _timed(
    fn: Callable[..., object], reps: int, barrier: Callable[[], None], sync: Callable[[], None]
) -> float:
    """Median seconds of ``fn`` after a barrier, slowest rank's (the caller takes the max)."""
    fn()
    sync()
    samples = []
    for _ in range(reps):
        barrier()
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def allreduce_job(smoke: bool) -> None:
    """float32 allreduce of device tensors through every path; rank 0 prints the table."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from mpx.collectives import allreduce, register_torch_backend, world
    from mpx.launch import init_torch_env

    comm = world()
    raw = MPI.COMM_WORLD
    device = torch.device("cpu") if smoke else torch.device("cuda", 0)
    if not smoke:
        torch.cuda.set_device(device)
    sync: Callable[[], None] = (lambda: None) if smoke else torch.cuda.synchronize
    aware = "cuda" in MPI.Get_library_version().lower()
    sizes = [1 << 12] if smoke else [1 << 20, 16 << 20, 64 << 20, 256 << 20]
    impls = ["mpi", "shm"] if smoke else ["staged", "ipc"] + (["mpi"] if aware else [])
    if comm.rank == 0:
        name = "CPU (--cpu-smoke)" if smoke else torch.cuda.get_device_name(device)
        _say(
            f"Device: {name}; {comm.size} ranks on the one device (they share its memory "
            "bandwidth and copy engines, and every exchange stays within one GPU: the figures "
            "are the cost of each path's machinery, not of a link between GPUs). CUDA-aware "
            f"MPI: {'yes' if aware else 'no, so no `mpi` row'}. Time: median of samples after "
            "a barrier, slowest rank; busbw = bytes·2(n-1)/n ÷ time.\n"
        )
        _say("| size | path | time (ms) | busbw (GB/s) |\n|---|---|---|---|")

    def row(nbytes: int, label: str, seconds: float | None, error: str = "") -> None:
        # A rank that failed counts as infinitely slow: the row says failed if any did.
        worst = raw.allreduce(seconds if seconds is not None else float("inf"), op=MPI.MAX)
        if comm.rank != 0:
            return
        if worst == float("inf"):
            _say(f"| {nbytes >> 10} KiB | {label} | failed: {error[:160]} | |")
            return
        bus = nbytes * 2 * (comm.size - 1) / comm.size / worst / 1e9
        _say(f"| {nbytes >> 10} KiB | {label} | {worst * 1e3:.3f} | {bus:.1f} |")

    for nbytes in sizes:
        x = torch.ones(nbytes // 4, device=device)
        reps = 5 if smoke else max(5, min(50, (256 << 20) // nbytes))
        for impl in impls:
            try:
                t = _timed(
                    lambda impl=impl, x=x: allreduce(x, comm=comm, impl=impl),
                    reps,
                    raw.Barrier,
                    sync,
                )
                row(nbytes, f"mpx `{impl}`", t)
            except Exception as exc:  # a path that cannot run here is a row, not the end
                row(nbytes, f"mpx `{impl}`", None, f"{type(exc).__name__}: {exc}")
    init_torch_env()
    register_torch_backend()
    backends = [("mpx", "torch.distributed, mpx backend")]
    backends.append(
        ("gloo", "torch.distributed, gloo") if smoke else ("nccl", "torch.distributed, NCCL")
    )
    for backend, label in backends:
        try:
            dist.init_process_group(backend)
        except Exception as exc:
            for nbytes in sizes:
                row(nbytes, label, None, f"{type(exc).__name__}: {exc}")
            continue
        for nbytes in sizes:
            x = torch.ones(nbytes // 4, device=device)
            reps = 5 if smoke else max(5, min(50, (256 << 20) // nbytes))
            try:
                t = _timed(lambda x=x: dist.all_reduce(x), reps, raw.Barrier, sync)
                row(nbytes, label, t)
            except Exception as exc:
                row(nbytes, label, None, f"{type(exc).__name__}: {exc}")
        dist.destroy_process_group()


def small_resnet(num_classes: int = 10) -> Any:
    """A ResNet of 3 stages of 2 basic blocks, for images where torchvision is missing."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout),
            )  # fmt: skip
            self.skip = (
                nn.Identity()
                if stride == 1 and cin == cout
                else nn.Sequential(
                    nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
                )
            )
            self.relu = nn.ReLU()

        def forward(self, x: Any) -> Any:
            return self.relu(self.body(x) + self.skip(x))

    layers: list[nn.Module] = [nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU()]
    for cin, cout, stride in ((32, 32, 1), (32, 64, 2), (64, 128, 2)):
        layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, num_classes)]
    return nn.Sequential(*layers)


def ddp_job(smoke: bool) -> None:
    """DDP training steps of a ResNet on each rank's share of the one device."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI
    from torch import nn

    import mpx.quantize as mq
    from mpx.collectives import register_torch_backend, world
    from mpx.launch import init_torch_env

    comm = world()
    raw = MPI.COMM_WORLD
    device = torch.device("cpu") if smoke else torch.device("cuda", 0)
    sync: Callable[[], None] = (lambda: None) if smoke else torch.cuda.synchronize
    if not smoke:
        torch.cuda.set_device(device)
    make: Callable[[], Any]
    try:
        if smoke:
            raise ImportError("--cpu-smoke: the small ResNet")
        # By name: the GPU machine's image has torchvision, CI's environment has not.
        models = importlib.import_module("torchvision.models")
        model_name = "torchvision ResNet-18 (11.7 M parameters), 224×224 images"
        make = lambda: models.resnet18(num_classes=1000)  # noqa: E731
        shape = (32, 3, 224, 224)
    except ImportError:
        model_name = "a small ResNet of this script (3 stages of 2 basic blocks), 32×32 images"
        make = small_resnet
        shape = (4 if smoke else 64, 3, 32, 32)
    steps = 1 if smoke else 20
    init_torch_env()
    register_torch_backend()
    if comm.rank == 0:
        name = "CPU (--cpu-smoke)" if smoke else torch.cuda.get_device_name(device)
        _say(
            f"Device: {name}; {comm.size} ranks on the one device. Model: {model_name}, batch "
            f"{shape[0]} per rank, SGD with momentum; step = forward + backward + optimizer, "
            f"median of {steps} steps after 3 warm-up steps, slowest rank. 4-bit = "
            "`mpx.quantize.ddp_comm_hook` (bucket 512, stochastic rounding). NCCL refuses two "
            "ranks on one GPU, in which case its rows say so.\n"
        )
        peer_name = "gloo" if smoke else "NCCL"
        _say(f"| gradients | backend | step (ms) | ÷ {peer_name} fp32 |\n|---|---|---|---|")
    results: dict[str, float | None] = {}
    errors: dict[str, str] = {}
    x = torch.randn(*shape, device=device)
    y = torch.randint(0, 10, (shape[0],), device=device)
    variants = [("fp32", "mpx"), ("4-bit", "mpx"), ("fp32", "gloo" if smoke else "nccl")]
    for grads, backend in variants:
        key = f"| {grads} | {backend} |"
        try:
            dist.init_process_group(backend)
        except Exception as exc:
            results[key], errors[key] = None, f"{type(exc).__name__}: {exc}"
            continue
        try:
            torch.manual_seed(0)
            model = make().to(device)
            ddp = nn.parallel.DistributedDataParallel(model)
            if grads == "4-bit":
                state = mq.QuantizeState(mq.CompressionConfig(bits=4, bucket_size=512), comm, model)
                ddp.register_comm_hook(state, mq.ddp_comm_hook)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)

            def step(ddp: Any = ddp, opt: Any = opt) -> None:
                opt.zero_grad(set_to_none=True)
                nn.functional.cross_entropy(ddp(x), y).backward()
                opt.step()

            for _ in range(2):
                step()
            results[key] = _timed(step, steps, raw.Barrier, sync)
        except Exception as exc:
            results[key], errors[key] = None, f"{type(exc).__name__}: {exc}"
        dist.destroy_process_group()
    inf = float("inf")  # a rank that failed counts as infinitely slow
    worst = {k: raw.allreduce(inf if v is None else v, op=MPI.MAX) for k, v in results.items()}
    if comm.rank != 0:
        return
    peer = worst.get(f"| fp32 | {variants[-1][1]} |", inf)
    for key, seconds in worst.items():
        if seconds == inf:
            _say(f"{key} failed: {errors.get(key, 'on another rank')[:160]} | |")
            continue
        ratio = f"{seconds / peer:.2f}" if peer != inf else "—"
        _say(f"{key} {seconds * 1e3:.1f} | {ratio} |")


# ---- the command ----


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def follow(argv: list[str], state: Path, out: Path, until: float) -> int:
    """Starts the report detached in ``state`` (unless it runs or ran there); follows it.

    Copies the run's files into ``out`` when it ends or at ``until`` (a
    monotonic time), whichever comes first; returns the report's exit status,
    or EXIT_STILL_RUNNING if it had not finished by then.
    """
    pidfile, codefile = state / "pid", state / "exit-code"
    running = pidfile.exists() and _alive(int(pidfile.read_text()))
    if not running and not codefile.exists():
        state.mkdir(parents=True, exist_ok=True)
        for old in state.iterdir():
            old.unlink()
        with (state / "driver.log").open("w") as driver_log:
            command = [sys.executable, os.path.abspath(__file__), *argv, "--out", str(state)]
            command += ["--exit-code-file", str(codefile)]
            child = subprocess.Popen(
                command,
                cwd=ROOT, stdout=driver_log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        pidfile.write_text(str(child.pid))
        sys.stdout.write(f"gpu_report: started detached (pid {child.pid}) in {state}\n")
    else:
        sys.stdout.write(f"gpu_report: following the run in {state}\n")
    sys.stdout.flush()
    while not codefile.exists() and time.monotonic() < until:
        time.sleep(2)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("gpu-report.md", "gpu-report.log", "driver.log"):
        if (state / name).exists():
            shutil.copyfile(state / name, out / name)
    if codefile.exists():
        code = int(codefile.read_text() or "1")
        sys.stdout.write(f"gpu_report: finished, exit {code}; files in {out}\n")
        return code
    sys.stdout.write(
        f"gpu_report: still running; the files so far are in {out}. Call the same command "
        "again (at once: the machine goes back when idle) to follow it further\n"
    )
    return EXIT_STILL_RUNNING


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--out", default="", help="output folder (default: $OUT, else ./gpu-report)"
    )
    parser.add_argument("--group", choices=["tests", "gpu", "cpu", "all"], default="all")
    parser.add_argument("--only", default="", help="parts to run, comma-separated")
    parser.add_argument(
        "--budget-scale", type=float, default=1.0, metavar="X",
        help="every part's time budget times X (a busy machine: --cpu-smoke --budget-scale 3)",
    )  # fmt: skip
    parser.add_argument("--cpu-smoke", "--dry-run", action="store_true", dest="smoke")
    parser.add_argument(
        "--install", default="", metavar="WHEELS", help="install mpx first (CUDA ON), offline"
    )
    parser.add_argument(
        "--follow", type=float, default=0, metavar="SECONDS",
        help="run detached; follow it until SECONDS after this command's start (see above)",
    )  # fmt: skip
    parser.add_argument("--state", default=STATE, help="the detached run's folder (--follow)")
    parser.add_argument("--exit-code-file", default="", help=argparse.SUPPRESS)
    parser.add_argument("--inner", choices=["allreduce", "ddp"], help=argparse.SUPPRESS)
    started = time.monotonic()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.inner == "allreduce":
        allreduce_job(args.smoke)
        return 0
    if args.inner == "ddp":
        ddp_job(args.smoke)
        return 0
    out = Path(args.out or os.environ.get("OUT") or ROOT / "gpu-report")
    state = Path(args.state)
    passed_on = _without_values(argv, ("--follow", "--install", "--out", "--state"))
    if args.follow and (state / "pid").exists():
        return follow(passed_on, state, out, started + args.follow)  # under way or done
    if args.install and (args.smoke or missing_gpu() is not None):
        install(args.install)
    if not args.smoke:
        missing = missing_gpu()
        if missing is not None:
            sys.stderr.write(f"gpu_report: cannot run: {missing}\n")
            return EXIT_NO_GPU
    if args.follow:
        return follow(passed_on, state, out, started + args.follow)
    code = report(args, out, parser)
    if args.exit_code_file:
        Path(args.exit_code_file).write_text(str(code))
    return code


def _without_values(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """``argv`` without the given options and their values (``--opt v`` or ``--opt=v``)."""
    kept: list[str] = []
    skip = False
    for word in argv:
        if skip:
            skip = False
        elif word in options:
            skip = True
        elif not word.startswith(tuple(f"{o}=" for o in options)):
            kept.append(word)
    return kept


def report(args: argparse.Namespace, out: Path, parser: argparse.ArgumentParser) -> int:
    """The report's parts, one after another, into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    md, log = out / "gpu-report.md", out / "gpu-report.log"
    only = {name for name in args.only.split(",") if name}
    unknown = only - {p.name for p in PARTS}
    if unknown:
        parser.error(f"--only: no part named {sorted(unknown)}; parts: {[p.name for p in PARTS]}")
    parts = [p for p in PARTS if (not only or p.name in only) and args.group in ("all", p.group)]
    md.write_text(f"# mpx GPU report\n\n{_device_line(args.smoke)}\n")
    log.write_text("")
    failed = []
    for part in parts:
        sys.stdout.write(
            f"gpu_report: {part.name} (budget {part.budget_s * args.budget_scale:g} s)\n"
        )
        sys.stdout.flush()
        if not run_part(part, args.smoke, md, log, args.budget_scale):
            failed.append(part.name)
    sys.stdout.write(f"gpu_report: tables in {md}, output in {log}\n")
    if failed:
        sys.stdout.write(f"gpu_report: failed or out of time: {', '.join(failed)}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
