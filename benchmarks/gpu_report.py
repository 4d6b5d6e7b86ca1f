"""mpx's CUDA tests and GPU benchmarks within a 15-minute GPU window, in two device-tool calls.

Usage (DEVELOPERS.md says how to call it on the device tool)::

    python3 benchmarks/gpu_report.py --call 1 --install .whl   # ≤ 7 min: install, GPU
    python3 benchmarks/gpu_report.py --call 2 --install .whl   # ≤ 3 min: the 16 CPU cores
    python3 benchmarks/gpu_report.py --plan                    # the parts and budgets
    python3 benchmarks/gpu_report.py --cpu-smoke               # both calls on CPU, tiny sizes
    nox -s gpu-report                                          # installs (CUDA ON) first

Kept at the repository's root, beside ``tests/``, because it spans every
package: it runs their ``gpu``-marked tests and the GPU and many-core jobs
that belong to no single package's benchmark.

A lent GPU comes as a window of 15 minutes in all (machine start, idle waits
and the end count; at most 10 minutes a command). Call 1 (``CALLS[1]``: 420 s
of command time) installs this checkout with the CUDA kernels for the GPU's own
architecture (``INSTALL_BUDGET_S``), then runs the parts that matter most
first: the ``gpu`` tests in one process, the same at 2 ranks, the kernels'
throughput, the CUDA allreduce paths, then (on the CPU cores, while call 1
has the time: the first window's call 1 took 113 s of 420) the pipeline
schedules at 4 and 8 stages. Call 2 (180 s) measures the 16 CPU
cores: layer-parallel MGRIT at 1-16 ranks against the serial network, then
allreduce at 2-16 ranks. Each part has a time budget; a part whose budget
exceeds what is left of its call is skipped with a line saying so, and a part
past its budget is ended with everything it started. Each part's tables are
appended to ``gpu-report.md`` and its output to ``gpu-report.log`` in ``$OUT``
(else ``./gpu-report``) as soon as it ends, so what a call measured comes back
even if the device tool stops it.

Without a CUDA GPU (and without ``--cpu-smoke``) it exits 2 and says what is
missing. Exit 0: every part ran and passed; 1: a part failed, ran out of its
budget or was skipped for time (the report says which).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import importlib.metadata
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["launch", "collectives", "quantize", "mgrit", "pipeline", "dataparallel"]
TEST_PATHS = [f"packages/{name}/tests" for name in PACKAGES] + ["tests"]
EXIT_NO_GPU = 2


@dataclasses.dataclass(frozen=True)
class Call:
    """One device-tool command: its limit of command time and what it is for."""

    number: int
    limit_s: float
    what: str


# The window: ~2 min machine start + call 1 + call 2 + idle gaps and the end
# ≤ 15 min; each call leaves a minute's margin under what DEVELOPERS.md gives
# the device tool as timeout_s (480 s and 240 s).
CALLS = {
    1: Call(
        1,
        420,
        "install (CUDA kernels for this GPU only), GPU tests, kernels, CUDA allreduce, "
        "pipeline schedules on 4 and 8 CPU ranks",
    ),
    2: Call(2, 180, "the 16 CPU cores: layer-parallel MGRIT and allreduce at 2-16 ranks"),
}
# What install() may take out of call 1. Measured here (2 cores at load ~16,
# 2026-11-26): the two concurrent builds took 129 s (mpx-quantize, nvcc for
# sm_90 alone) and 121 s (the other five) of wall time but 27 s of CPU in all;
# on 16 idle cores that is well under a minute (DEVELOPERS.md).
INSTALL_BUDGET_S = 90.0


def _markdown(output: str) -> str:
    """The job's own markdown: everything it printed but log noise."""
    return "\n".join(
        line for line in output.splitlines() if not line.startswith(("[rank", "Traceback"))
    )


@dataclasses.dataclass(frozen=True)
class Part:
    """One step of the report: its commands, its time budget, and what it needs."""

    name: str
    call: int  # 1 or 2: the device-tool call it belongs to
    title: str
    budget_s: float
    command: Callable[[bool], list[list[str]]]  # smoke -> the commands, run one after another
    env: Callable[[bool], dict[str, str]] = lambda smoke: {}
    tables: Callable[[str], str] = _markdown


def _mpxrun(n: int, *args: str) -> list[str]:
    mpxrun = shutil.which("mpxrun", path=os.path.dirname(sys.executable)) or "mpxrun"
    return [mpxrun, "-n", str(n), "--timeout", "580", "--", sys.executable, *args]


def _bench(package: str, name: str) -> str:
    return str(ROOT / "packages" / package / "benchmarks" / f"{name}.py")


def _gpu(smoke: bool) -> str:
    return "cpu" if smoke else "cuda"


def _inner(job: str, smoke: bool, *args: str) -> list[str]:
    return [os.path.abspath(__file__), "--inner", job, *(["--cpu-smoke"] if smoke else []), *args]


_OUTCOME = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b ?(.*)$")


def pytest_outcomes(output: str) -> str:
    """A table of pytest's ``-rA`` summary lines: one row per test (per skip reason)."""
    # dict: once each, in order (under mpxrun every rank prints its summary).
    rows = list(dict.fromkeys(m.groups() for m in map(_OUTCOME.match, output.splitlines()) if m))
    totals = [
        line
        for line in output.splitlines()
        if re.match(r"^=+ .*\d+ (passed|failed|skipped|error|deselected)", line)
    ]
    if not rows:
        return "No test outcome was reported (see gpu-report.log)."
    body = "\n".join(f"| {outcome} | `{what.replace('|', '/')}` |" for outcome, what in rows)
    summary = f"\n\n{totals[-1].strip('= ')}" if totals else ""
    return f"| outcome | test |\n|---|---|\n{body}{summary}"


def _pytest(marker: str) -> list[str]:
    return ["-m", "pytest", *TEST_PATHS, "-m", marker, "-rA", "-q", "-p", "no:cacheprovider"]


def _gpu_tests_env(smoke: bool) -> dict[str, str]:
    # On the GPU a skipped gpu test is a failure; on --cpu-smoke the tests are
    # collected and skip, which times the part's fixed cost (imports, collection).
    return {} if smoke else {"MPX_REQUIRE_GPU": "1"}


CPU_RANKS = (16, 8, 4, 2)  # 16 first: if the budget runs out, fewer ranks are lost
# bench_transformer's rows at 4 and 8 stages: the targets' (zero bubble and async
# against 1f1b and the best synchronous schedule of those timed), not torch's.
PIPELINE_ROWS = "1f1b,interleaved_zb,zbv,async"
# (stages, blocks, sequences a step): at 8 stages two chunks a rank need 16 virtual
# stages, so 16 blocks (and m = 16 micro-batches of one sequence each).
PIPELINE_RUNS = ((4, 8, 16), (8, 16, 16))
SMOKE_CPU_RANKS = (2,)

# Budgets: each part's time on --cpu-smoke here (its fixed cost: imports,
# collection, mpxrun's start) divided by this machine's load factor, plus its
# work at full size on the GPU machine; DEVELOPERS.md shows the derivation.
PARTS = [
    Part(
        "gpu-tests",
        1,
        "`pytest -m 'gpu and not mpi'` (MPX_REQUIRE_GPU=1)",
        50,
        lambda smoke: [[sys.executable, *_pytest("gpu and not mpi")]],
        env=_gpu_tests_env,
        tables=pytest_outcomes,
    ),
    Part(
        "gpu-mpi-tests",
        1,
        "`mpxrun -n 2 pytest -m 'gpu and mpi'` (both ranks on the one GPU)",
        60,
        lambda smoke: [_mpxrun(2, *_pytest("gpu and mpi"))],
        env=_gpu_tests_env,
        tables=pytest_outcomes,
    ),
    Part(
        "quantize-kernels",
        1,
        "quantize/dequantize throughput vs the device-to-device copy and the pure-torch quantizer",
        30,
        lambda smoke: [
            [
                sys.executable,
                _bench("quantize", "bench_quantize"),
                "--skip-allreduce",
                "--device",
                "cpu" if smoke else "cuda",
                "--kernel-sizes",
                str(1 << 16) if smoke else f"{1 << 20},{16 << 20},{64 << 20}",
            ]
        ],
    ),
    Part(
        "allreduce-cuda",
        1,
        "CUDA allreduce, 2 ranks on the one GPU: staged, ipc, auto (CUDA-aware MPI if it is) "
        "vs gloo on CUDA tensors",
        45,
        lambda smoke: [
            _mpxrun(2, *_inner("allreduce", smoke, "--header", "--device", _gpu(smoke)))
        ],
    ),
    Part(
        "pipeline-cpu",
        1,
        "pipeline schedules on 4 and 8 CPU ranks (bench_transformer: 1f1b, interleaved_zb, zbv, "
        "async; no GPU): zero bubble's and async's gain where a 2-core machine cannot show it",
        120,
        lambda smoke: [
            [
                "env",
                f"MPX_BENCH_DEPTH={depth}",
                f"MPX_BENCH_BATCH={batch}",
                sys.executable,
                _bench("pipeline", "bench_transformer"),
                "--stages",
                str(stages),
                "--only",
                PIPELINE_ROWS,
            ]
            for stages, depth, batch in (((2, 2, 8),) if smoke else PIPELINE_RUNS)
        ],
        env=lambda smoke: {"MPX_BENCH_REPEATS": "1" if smoke else "2"},
    ),
    Part(
        "mgrit-cpu",
        2,
        "layer-parallel MGRIT at 1-16 ranks vs the serial network (torchbraid-like: 4 levels, "
        "cfactor 4)",
        95,
        lambda smoke: [_mpxrun(2 if smoke else 16, *_inner("mgrit", smoke))],
    ),
    Part(
        "allreduce-cpu",
        2,
        "allreduce on the CPU cores, 2 to 16 ranks: mpx's paths vs gloo",
        75,
        lambda smoke: [
            _mpxrun(n, *_inner("allreduce", smoke, "--device", "cpu", *["--header"][: i == 0]))
            for i, n in enumerate(SMOKE_CPU_RANKS if smoke else CPU_RANKS)
        ],
    ),
]


def plan_lines(parts: Sequence[Part] = PARTS, scale: float = 1.0) -> list[str]:
    """The plan in words: each call's parts, budgets and total against its limit."""
    lines = []
    for call in CALLS.values():
        mine = [p for p in parts if p.call == call.number]
        install = INSTALL_BUDGET_S if call.number == 1 else 0.0
        total = (install + sum(p.budget_s for p in mine)) * scale
        lines.append(
            f"call {call.number} ({call.what}): {total:.0f} s of {call.limit_s * scale:.0f} s"
        )
        if install:
            lines.append(f"  install          {install * scale:5.0f} s")
        lines += [f"  {p.name:16} {p.budget_s * scale:5.0f} s  {p.title}" for p in mine]
    return lines


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


def _installed() -> bool:
    """Whether every mpx package is installed (a later call on the same machine)."""
    try:
        for name in PACKAGES:
            importlib.metadata.version(f"mpx-{name}")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", version.split("+", maxsplit=1)[0])[:4])


def carried_to_install(wheels: Sequence[Path]) -> list[Path]:
    """The carried wheels whose distribution is missing here or older than the wheel's.

    The GPU image has most of what the build needs (torch, numpy, mpi4py,
    Cython, scikit-build-core, pybind11): its own copies are kept unless
    older than the carried ones, and what it lacks (hatchling and its needs,
    the MPICH wheel) is installed.
    """
    chosen = []
    for wheel in wheels:
        name, version = wheel.name.split("-")[:2]
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            chosen.append(wheel)
            continue
        if _version_key(have) < _version_key(version):
            chosen.append(wheel)
    return chosen


def cuda_architecture() -> str | None:
    """This GPU's architecture as CMake names it (``90`` for an H100), or None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"{major}{minor}"


def install_commands(
    wheels: Sequence[Path], built: Path, arch: str | None
) -> tuple[list[list[str]], list[list[str]], list[str], dict[str, str]]:
    """(carried-wheel installs, concurrent builds, the final install, the builds' environment).

    No build isolation and no index (the image's build tools; no network), no
    dependencies resolved (the image's torch stays). mpx-quantize (CMake, nvcc)
    builds beside the other five (hatchling, Cython): the two take about as
    long, so the install costs the slower of them, not their sum.
    """
    pip = [sys.executable, "-m", "pip"]
    quiet = ["-q", "--no-index", "--no-deps", "--disable-pip-version-check"]
    carried = [[*pip, "install", *quiet, *map(str, wheels)]] if wheels else []
    wheel = [*pip, "wheel", *quiet, "--no-build-isolation", "-w", str(built)]
    others = [str(ROOT / "packages" / n) for n in PACKAGES if n != "quantize"]
    builds = [[*wheel, str(ROOT / "packages" / "quantize")], [*wheel, *others]]
    final = [*pip, "install", *quiet, "--force-reinstall"]  # + the wheels built
    env = dict(os.environ)
    env["MPX_QUANTIZE_CUDA"] = "ON" if arch else "AUTO"
    env["CMAKE_BUILD_PARALLEL_LEVEL"] = str(os.cpu_count() or 1)
    if arch:
        # This GPU's architecture alone: the release's three (80, 90, 100) and
        # PTX take nvcc minutes longer, out of the window.
        env["CMAKE_ARGS"] = f"{env.get('CMAKE_ARGS', '')} -DCMAKE_CUDA_ARCHITECTURES={arch}-real"
    return carried, builds, final, env


def install(wheels_dir: str, log: Callable[[str], None], cuda: bool = True) -> float:
    """Installs this checkout with no network; returns the seconds it took.

    ``cuda``: the CUDA kernels for this GPU (call 1). Call 2, on a machine
    that went back in between, needs only the CPU kernels: no nvcc, seconds.
    """
    start = time.monotonic()
    found = sorted(Path(wheels_dir).glob("*.whl"))
    wanted = carried_to_install(found)
    kept = sorted(set(found) - set(wanted))
    if kept:
        log(f"install: the image has these already: {', '.join(p.name for p in kept)}")
    with tempfile.TemporaryDirectory() as tmp:
        arch = cuda_architecture() if cuda else None
        carried, builds, final, env = install_commands(wanted, Path(tmp), arch)
        if not cuda:
            env["MPX_QUANTIZE_CUDA"] = "OFF"
        for command in carried:
            subprocess.run(command, check=True)
        running = [subprocess.Popen(command, env=env) for command in builds]
        codes = [proc.wait() for proc in running]
        if any(codes):
            raise SystemExit(f"gpu_report: install: a build failed (exit {codes}); see above")
        subprocess.run([*final, *sorted(str(p) for p in Path(tmp).glob("*.whl"))], check=True)
    importlib.invalidate_caches()  # this process looks for mpx again (missing_gpu)
    return time.monotonic() - start


def _device_line(smoke: bool) -> str:
    import platform

    import torch

    device = "none (--cpu-smoke)" if smoke else torch.cuda.get_device_name()
    load = os.getloadavg()[0]
    return (
        f"Device: {device}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
        f"{os.cpu_count()} CPU cores ({platform.machine()}, load {load:.1f} at the start); "
        f"Python {platform.python_version()}."
    )


def run_part(
    part: Part, smoke: bool, md: Path, log: Path, budget_scale: float = 1.0, left_s: float = 1e9
) -> str:
    """Runs one part within its budget; appends its tables and output.

    Returns ``"passed"``, ``"failed"`` (an error or past its budget) or
    ``"skipped"``: its budget exceeds ``left_s``, the time left of its call.
    """
    budget = part.budget_s * budget_scale
    with md.open("a") as f:
        f.write(f"\n## {part.name}: {part.title}\n\n")
        if budget > left_s:
            f.write(
                f"**skipped: its budget of {budget:.0f} s exceeds the {max(left_s, 0):.0f} s "
                f"left of call {part.call}** (rerun it: `--only {part.name}`)\n"
            )
            return "skipped"
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
                status = f"**timed out after its budget of {budget:g} s** (partial output above)"
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
            f.write(f"\n({time.monotonic() - start:.1f} s: `{_shown(command)}`)\n")
        if code is None:
            break  # the budget is spent: the part's further commands would not start
    return "passed" if ok else "failed"


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


# ---- the jobs of no single package's benchmark, run under mpxrun ----


def _say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def _per_call(
    fn: Callable[[], object],
    sync: Callable[[], None],
    barrier: Callable[[], None],
    agree: Callable[[int], int],
    bursts: int = 5,
) -> float:
    """Median seconds per call of ``fn``: bursts of calls after a barrier, ≥ ~5 ms each.

    A burst rather than one call: a 4 KiB allreduce is shorter than the ranks'
    skew at a barrier. ``agree`` makes every rank take the same burst length.
    """
    fn()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    once = time.perf_counter() - start
    calls = agree(max(1, min(1000, int(0.005 / max(once, 1e-7)))))
    samples = []
    for _ in range(bursts):
        barrier()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


CUDA_SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]
CPU_SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20]


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def allreduce_job(smoke: bool, header: bool, device_kind: str) -> None:
    """float32 allreduce through mpx's paths and gloo; rank 0 prints rows as they are measured."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    aware = "cuda" in MPI.Get_library_version().lower()
    if aware and device_kind == "cuda":
        # mpx hands device buffers to MPI only when told the MPI takes them.
        os.environ["MPX_CUDA_AWARE"] = "1"
    from mpx.collectives import allreduce, world
    from mpx.launch import init_torch_env

    comm = world()
    raw = MPI.COMM_WORLD
    cuda = device_kind == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # one core a rank: 16 ranks on 16 cores
    sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
    sizes = [4 << 10] if smoke else CUDA_SIZES if cuda else CPU_SIZES
    impls = ["staged", "ipc", "auto"] + (["mpi"] if aware else []) if cuda else []
    impls = impls or ["mpi", "ring", "shm", "auto"]
    if comm.rank == 0 and header:
        where = torch.cuda.get_device_name(device) if cuda else "CPU"
        _say(
            f"Device: {where}, {comm.size} ranks"
            + (
                " on the one GPU (they share its memory bandwidth and copy engines: the figures "
                "are the cost of each path's machinery, not of a link between GPUs). CUDA-aware "
                f"MPI: {'yes' if aware else 'no, so no `mpi` row'}."
                if cuda
                else ", one core each (torch.set_num_threads(1))."
            )
            + " Time: median of 5 bursts (≥ 5 ms each) after a barrier, per call; "
            "busbw = bytes·2(n-1)/n ÷ time; ÷ gloo = gloo's time ÷ this one (above 1: faster).\n"
        )
        _say(
            "| ranks | size | path | time (ms) | busbw (GB/s) | ÷ gloo |\n|---|---|---|---|---|---|"
        )
    agree: Callable[[int], int] = lambda n: int(raw.allreduce(n, op=MPI.MAX))  # noqa: E731
    results: dict[tuple[int, str], float | None] = {}
    errors: dict[tuple[int, str], str] = {}

    def measure(nbytes: int, label: str, fn: Callable[[], object]) -> None:
        try:
            seconds: float | None = _per_call(fn, sync, raw.Barrier, agree)
        except Exception as exc:  # a path that cannot run here is a row, not the end
            seconds, errors[nbytes, label] = None, f"{type(exc).__name__}: {exc}"
        # A rank that failed counts as infinitely slow: the row says failed if any did.
        worst = raw.allreduce(float("inf") if seconds is None else seconds, op=MPI.MAX)
        results[nbytes, label] = None if worst == float("inf") else worst

    # gloo first: every mpx row is compared with it as it is printed.
    init_torch_env()
    try:
        dist.init_process_group("gloo")
    except Exception as exc:
        for nbytes in sizes:
            results[nbytes, "gloo"], errors[nbytes, "gloo"] = None, f"{type(exc).__name__}: {exc}"
    else:
        for nbytes in sizes:
            x = torch.zeros(nbytes // 4, device=device)
            measure(nbytes, "gloo", functools.partial(dist.all_reduce, x))
        dist.destroy_process_group()
    for nbytes in sizes:
        x = torch.zeros(nbytes // 4, device=device)  # zeros: sums that never overflow
        _row(comm, nbytes, "torch.distributed gloo", results, errors, "gloo")
        for impl in impls:
            measure(nbytes, impl, functools.partial(allreduce, x, comm=comm, impl=impl))
            _row(comm, nbytes, f"mpx `{impl}`", results, errors, impl)


def _row(
    comm: Any,
    nbytes: int,
    label: str,
    results: dict[tuple[int, str], float | None],
    errors: dict[tuple[int, str], str],
    key: str,
) -> None:
    size = comm.size
    if comm.rank != 0:
        return
    seconds = results.get((nbytes, key))
    if seconds is None:
        why = errors.get((nbytes, key), "on another rank")[:160].replace("|", "/")
        _say(f"| {size} | {_size(nbytes)} | {label} | failed: {why} | | |")
        return
    bus = nbytes * 2 * (size - 1) / size / seconds / 1e9
    gloo = results.get((nbytes, "gloo"))
    ratio = f"{gloo / seconds:.2f}" if gloo else "—"
    _say(f"| {size} | {_size(nbytes)} | {label} | {seconds * 1e3:.3f} | {bus:.2f} | {ratio} |")


@dataclasses.dataclass(frozen=True)
class MGRITConfig:
    """A layer-parallel network like torchbraid's published ones, sized for the window."""

    steps: int
    width: int
    batch: int
    levels: int
    cfactor: int
    rank_counts: tuple[int, ...]
    repeats: int


# 1024 residual steps of a 128-wide Linear + tanh on a batch of 128 (a step of
# ~0.3 ms on one core, against a 64 KiB message between neighbours of ~20 µs:
# costly enough to parallelise); 4 levels of cfactor 4 (the model's best level
# count at 16 ranks: mpx.mgrit.model). LayerParallel splits the fine grid, so
# any rank count up to 1024 / 4 works. 16 ranks first: if time runs out, the
# rows that matter least (fewer ranks) are the ones lost.
MGRIT_FULL = MGRITConfig(1024, 128, 128, 4, 4, (16, 8, 4, 2, 1), 3)
MGRIT_SMOKE = MGRITConfig(32, 16, 8, 3, 4, (2, 1), 2)


def mgrit_job(smoke: bool) -> None:
    """LayerParallel forward + backward on P of the job's ranks vs the serial network.

    One job of the largest rank count: the smaller counts run on its first P
    ranks (a split communicator) while the others wait, which saves a job's
    start (seconds at 16 ranks) per row.
    """
    import torch
    from torch import nn

    from mpx.collectives import Communicator, world
    from mpx.mgrit import LayerParallel

    cfg = MGRIT_SMOKE if smoke else MGRIT_FULL
    torch.set_num_threads(1)  # one core a rank; the serial network gets one core too
    comm = world()
    x = torch.randn(cfg.batch, cfg.width, generator=torch.Generator().manual_seed(1))

    def make(sub: Communicator) -> LayerParallel:
        torch.manual_seed(0)
        return LayerParallel(
            nn.Identity(), lambda: nn.Sequential(nn.Linear(cfg.width, cfg.width), nn.Tanh()),
            nn.Linear(cfg.width, 10), num_steps=cfg.steps, Tf=cfg.steps / 64,
            comm=sub, levels=cfg.levels, cfactor=cfg.cfactor, fwd_iters=2, bwd_iters=1, tol=0.0,
        )  # fmt: skip

    def median_time(net: nn.Module, sub: Communicator) -> float:
        """Median seconds of a training step's forward + backward, slowest rank of ``sub``."""

        def step() -> None:
            net.zero_grad()
            torch.autograd.backward(net(x).square().sum())

        step()
        samples = []
        for _ in range(cfg.repeats):
            sub.mpi.Barrier()
            start = time.perf_counter()
            step()
            samples.append(time.perf_counter() - start)
        return float(sub.mpi.allreduce(statistics.median(samples), op=_mpi_max()))

    if comm.rank == 0:
        _say(
            f"{cfg.steps} residual steps x + h·tanh(W x + b), width {cfg.width}, batch "
            f"{cfg.batch}, float32; MGRIT {cfg.levels} levels, cfactor {cfg.cfactor}, 2 forward "
            "and 1 adjoint V-cycle (torchbraid's published runs: cfactor 4, 3 levels or more); "
            "one core a rank; time = forward + backward, median of "
            f"{cfg.repeats} after a warm-up, slowest rank. Serial = the same network with plain "
            "autograd on one core. torchbraid reports ~10× over serial at its largest rank "
            "counts.\n"
        )
        _say("| ranks | layer-parallel (ms) | serial (ms) | speed-up |\n|---|---|---|---|")
    solo = comm.split(0 if comm.rank == 0 else None)
    serial_s = median_time(make(solo).serial(), solo) if solo is not None else 0.0
    if solo is not None:
        _say(f"| serial | — | {serial_s * 1e3:.1f} | 1.00 |")
        solo.free()
    serial_s = float(comm.mpi.bcast(serial_s, root=0))
    measured: dict[int, float] = {}
    one_rank: dict[str, float] = {}
    for p in (p for p in cfg.rank_counts if p <= comm.size):
        sub = comm.split(0 if comm.rank < p else None)
        if sub is not None:
            net = make(sub)
            t = median_time(net, sub)
            measured[p] = t
            if p == 1:  # the model's costs: the time inside the stacked steps, by kind
                one_rank = dict(net.stepper.seconds)
            if sub.rank == 0:
                _say(f"| {p} | {t * 1e3:.1f} | {serial_s * 1e3:.1f} | {serial_s / t:.2f} |")
            net.close()
            sub.free()
        comm.mpi.Barrier()
    # One state (batch x width float32) between ranks 0 and 1, one way: the model's
    # message, measured as the layer-parallel benchmarks measure it.
    message = _lp_measures().message_seconds(comm, torch.zeros(cfg.batch, cfg.width))
    if comm.rank == 0 and one_rank and 1 in measured:
        _mgrit_model(cfg, measured, one_rank, message, serial_s)


def _lp_measures() -> Any:
    """mpx-mgrit's benchmarks' shared measurements (packages/mgrit/benchmarks/lp_measures.py)."""
    folder = str(ROOT / "packages" / "mgrit" / "benchmarks")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module("lp_measures")


def _mgrit_model(
    cfg: MGRITConfig,
    measured: dict[int, float],
    seconds: dict[str, float],
    message: float,
    serial_s: float,
) -> None:
    """The measured rows beside ``mpx.mgrit.model``'s (costs from the 1-rank row), and its
    predictions beyond this machine's cores."""
    from mpx.mgrit.model import costs_of, count, predict

    def work(p: int, costs: Any = None) -> Any:
        return count(cfg.steps, cfg.levels, cfg.cfactor, 2, 1, p, costs=costs)

    costs = costs_of(seconds, work(1), measured[1], message=message)
    _say(
        f"\nModel (`mpx.mgrit.model`: the step replayed on every rank's clock, its critical "
        f"path priced with the 1-rank row's costs and a {message * 1e6:.0f} µs message):\n"
    )
    _say("| ranks | measured (ms) | model (ms) | model error | model speed-up |")
    _say("|---|---|---|---|---|")
    for p in sorted({*measured, 64, 256}):
        t = predict(work(p, costs), costs, p)
        got = measured.get(p)
        shown = f"{got * 1e3:.1f}" if got is not None else "—"
        error = f"{(t - got) / got:+.0%}" if got is not None else "—"
        _say(f"| {p} | {shown} | {t * 1e3:.1f} | {error} | {serial_s / t:.2f} |")


def _mpi_max() -> Any:
    from mpi4py import MPI

    return MPI.MAX


# ---- the command ----


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--out", default="", help="output folder (default: $OUT, else ./gpu-report)"
    )
    parser.add_argument(
        "--call", choices=["1", "2", "all"], default="all",
        help="which device-tool call's parts (1: install + GPU, 2: CPU cores; default both)",
    )  # fmt: skip
    parser.add_argument("--only", default="", help="parts to run, comma-separated")
    parser.add_argument(
        "--budget-scale", type=float, default=1.0, metavar="X",
        help="every budget and call limit times X (a loaded machine: --cpu-smoke --budget-scale 3)",
    )  # fmt: skip
    parser.add_argument("--cpu-smoke", "--dry-run", action="store_true", dest="smoke")
    parser.add_argument("--plan", action="store_true", help="print the parts and budgets; run none")
    parser.add_argument(
        "--install", default="", metavar="WHEELS",
        help="install this checkout first (CUDA kernels for this GPU), offline, with the "
        "wheels of WHEELS (DEVELOPERS.md); skipped where mpx is installed already",
    )  # fmt: skip
    parser.add_argument("--inner", choices=["allreduce", "mgrit"], help=argparse.SUPPRESS)
    parser.add_argument("--header", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda", help=argparse.SUPPRESS)
    started = time.monotonic()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.inner == "allreduce":
        allreduce_job(args.smoke, args.header, args.device)
        return 0
    if args.inner == "mgrit":
        mgrit_job(args.smoke)
        return 0
    if args.plan:
        sys.stdout.write("\n".join(plan_lines(scale=args.budget_scale)) + "\n")
        return 0
    out = Path(args.out or os.environ.get("OUT") or ROOT / "gpu-report")
    notes: list[str] = []
    if args.install and not _installed():
        spent = install(args.install, notes.append, cuda=args.call != "2")
        notes.append(f"install: {spent:.0f} s (budget {INSTALL_BUDGET_S:.0f} s)")
    elif args.install:
        notes.append("install: mpx is installed already (an earlier call): skipped")
    if not args.smoke and args.call != "2":  # call 2 measures the CPU cores: no GPU needed
        missing = missing_gpu()
        if missing is not None:
            sys.stderr.write(f"gpu_report: cannot run: {missing}\n")
            return EXIT_NO_GPU
    return report(args, out, parser, started, notes)


def choose_parts(call: str, only: str) -> tuple[list[Part], list[str]]:
    """The parts of ``call`` (1, 2 or all) named in ``only`` (all if empty); unknown names."""
    names = {name for name in only.split(",") if name}
    unknown = sorted(names - {p.name for p in PARTS})
    parts = [p for p in PARTS if (not names or p.name in names) and call in ("all", str(p.call))]
    return parts, unknown


def timing_table(
    parts: Sequence[Part], scale: float, outcome: dict[str, str], took: dict[str, float]
) -> str:
    """Each part's budget beside the time it took: the measurements the budgets come from."""
    rows = [
        f"| {p.name} | {p.call} | {p.budget_s * scale:.0f} | {took[p.name]:.1f} | "
        f"{outcome[p.name]} |"
        for p in parts
    ]
    head = (
        "\n## Timing\n\n| part | call | budget (s) | took (s) | outcome |\n|---|---|---|---|---|\n"
    )
    return head + "\n".join(rows) + "\n"


def report(
    args: argparse.Namespace,
    out: Path,
    parser: argparse.ArgumentParser,
    started: float,
    notes: Sequence[str] = (),
) -> int:
    """The parts of the chosen call(s), in order, each within its budget and the call's limit."""
    parts, unknown = choose_parts(args.call, args.only)
    if unknown:
        parser.error(f"--only: no part named {unknown}; parts: {[p.name for p in PARTS]}")
    if not parts:
        parser.error(f"--only {args.only}: none of these parts is in call {args.call}")
    out.mkdir(parents=True, exist_ok=True)
    md, log = out / "gpu-report.md", out / "gpu-report.log"
    title = "all calls" if args.call == "all" else f"call {args.call}"
    with md.open("a") as f:  # a second call adds to the first's file (the same $OUT or not)
        f.write(f"\n# mpx GPU report, {title}\n\n{_device_line(args.smoke)}\n")
        for note in notes:
            f.write(f"\n{note}\n")
    scale = args.budget_scale
    outcome: dict[str, str] = {}
    took: dict[str, float] = {}
    for call in CALLS.values():
        mine = [p for p in parts if p.call == call.number]
        if not mine:
            continue
        # The limit counts from this command's start (call 1's install included);
        # with --call all, each call's from when its first part starts.
        begin = started if call.number == min(p.call for p in parts) else time.monotonic()
        deadline = begin + call.limit_s * scale
        for part in mine:
            left = deadline - time.monotonic()
            sys.stdout.write(f"gpu_report: {part.name} (budget {part.budget_s * scale:g} s, "
                             f"{left:.0f} s left of call {call.number})\n")  # fmt: skip
            sys.stdout.flush()
            part_start = time.monotonic()
            outcome[part.name] = run_part(part, args.smoke, md, log, scale, left)
            took[part.name] = time.monotonic() - part_start
    with md.open("a") as f:
        f.write(timing_table(parts, scale, outcome, took))
        f.write(f"\nCommand time: {time.monotonic() - started:.0f} s.\n")
    sys.stdout.write(f"gpu_report: tables in {md}, output in {log}\n")
    bad = [name for name, result in outcome.items() if result != "passed"]
    if bad:
        sys.stdout.write(f"gpu_report: failed, out of time or skipped: {', '.join(bad)}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
