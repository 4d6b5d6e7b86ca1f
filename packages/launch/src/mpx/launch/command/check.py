"""``mpxrun --check``: what this installation can do, and a 2-rank smoke test.

Like ``horovodrun --check-build``: it reports, without needing a job::

    launcher        kind and path of mpiexec/mpirun/srun
    MPI library     version line, thread level, CUDA-aware or not (mpi4py)
    mpx packages    which are installed, with versions; for the others, what
                    installing them would add
    torch, GPUs     what torch sees, if torch is installed
    quantize        which kernels were built, if mpx-quantize is installed
    smoke test      mpxrun -n 2 python -m mpx.launch.selftest (no torch), and
                    python -m mpx.collectives.selftest if mpx-collectives is installed

mpx-launch needs neither torch nor mpi4py: the check asks only of the install
what its packages promise. A launch-only install passes with a launcher (and
mpi4py, if installed, working); a missing optional package is reported with
what it would add, never as a failure. Every probe runs in a subprocess and a
missing piece is reported, not raised.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Callable

from mpx.launch.errors import LaunchError
from mpx.launch.launchers import find_launcher

__all__ = ["ADDS", "PACKAGES", "run_check"]

PACKAGES = (
    "mpx-launch",
    "mpx-collectives",
    "mpx-quantize",
    "mpx-dataparallel",
    "mpx-pipeline",
    "mpx-mgrit",
)

# What each package would add to an install that lacks it.
ADDS = {
    "mpx-collectives": "collectives on torch tensors and the 'mpx' torch.distributed backend "
    "(needs torch, mpi4py)",
    "mpx-quantize": "quantized (1-8 bit) compressed allreduce kernels",
    "mpx-dataparallel": "data-parallel training: overlapped gradient allreduce, parameter server",
    "mpx-pipeline": "pipeline-parallel training: GPipe, 1F1B, asynchronous pipelines",
    "mpx-mgrit": "MGRIT parallel-in-time solver and layer-parallel training",
    "mpi4py": "MPI from Python (mpx-collectives needs it)",
    "torch": "tensors (every mpx package but mpx-launch needs it)",
}

_MPI_PROBE = """
from mpi4py import MPI
lines = MPI.Get_library_version().strip().splitlines()
names = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
         MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
print(" ".join(lines[0].split()))
print(names.get(MPI.Query_thread(), "unknown"))
print("yes" if "cuda" in MPI.Get_library_version().lower() else "no")
"""

_TORCH_PROBE = """
import torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(torch.__version__)
print(n, *[torch.cuda.get_device_name(i).replace(" ", "_") for i in range(n)])
"""

_QUANTIZE_PROBE = """
import mpx.quantize
from mpx.launch.command.check import _kernels_line
q = mpx.quantize
print(_kernels_line(q.available_backends(), q.available_backends(usable_only=True)))
"""


def _kernels_line(built: list[str], usable: list[str]) -> str:
    """The quantize line: the kernels built, and which run where a built one cannot."""
    line = ",".join(built) or "none"
    if "cuda" in built and "cuda" not in usable:
        # The released wheel carries the CUDA kernels; without a GPU the CPU ones run.
        line += " (CUDA kernels built, but no CUDA GPU or driver here: the CPU kernels run)"
    return line


def _probe(code: str, timeout: float = 120) -> tuple[bool, list[str]]:
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, check=False
    )
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
        return False, [last]
    return True, result.stdout.strip().splitlines()


def _installed(name: str) -> str | None:
    # Imported here: importlib.metadata costs every mpxrun ~12 ms, and only --check reads it.
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing or broken
        return False


def _missing(name: str, label: str = "") -> str:
    label = label or name
    return f"  {label:<16} not installed: pip install {name} adds {ADDS[name]}"


def run_check(
    smoke: Callable[[list[str]], int] | None = None, out: Callable[[str], None] = print
) -> int:
    """Prints the report; returns 0 if what is installed works and the smoke tests passed.

    Args:
        smoke: runs ``mpxrun`` with the given arguments and returns its exit
            code (the CLI passes itself); None skips the smoke tests.
        out: where lines go.
    """
    failed = False
    out("mpxrun --check")
    try:
        launcher = find_launcher()
        out(f"  launcher       {launcher.kind} ({launcher.path})")
    except LaunchError as exc:
        out(f"  launcher       MISSING: {exc}")
        failed = True
    if _importable("mpi4py"):
        ok, lines = _probe(_MPI_PROBE)
        if ok:
            out(f"  MPI library    {lines[0]}")
            out(f"  thread level   {lines[1]}")
            out(
                f"  CUDA-aware     {lines[2]} (mpx passes device buffers to MPI only with "
                "MPX_CUDA_AWARE=1; otherwise CUDA tensors go through 'staged')"
            )
        else:
            out(f"  MPI library    NOT USABLE from Python: {lines[0]} (pip install mpi4py mpich)")
            failed = True
    else:
        out(_missing("mpi4py", "MPI library"))
    versions = {name: _installed(name) for name in PACKAGES}
    for name, version in versions.items():
        out(f"  {name:<16} {version}" if version else _missing(name))
    if _importable("torch"):
        ok, lines = _probe(_TORCH_PROBE)
        if ok:
            count, *names = lines[1].split()
            out(f"  torch          {lines[0]}")
            out(f"  GPUs           {count}" + (f" ({', '.join(names)})" if names else ""))
        else:
            out(f"  torch          not importable: {lines[0]}")
            # The packages installed on top of it cannot work.
            failed = failed or any(versions[name] for name in PACKAGES[1:])
    else:
        out(_missing("torch"))
        out("  GPUs           not probed (no torch)")
    if versions["mpx-quantize"]:
        ok, lines = _probe(_QUANTIZE_PROBE)
        out(f"  quantize       {'kernels: ' + lines[0] if ok else 'not available: ' + lines[0]}")
    if smoke is not None and not failed:
        tests = [("mpx.launch.selftest", "launcher and MPI, without torch")]
        if versions["mpx-collectives"]:
            tests.append(("mpx.collectives.selftest", "every collective implementation"))
        for module, what in tests:
            out(f"  smoke test     mpxrun -n 2 python -m {module} ({what})")
            code = smoke(["-n", "2", "--timeout", "300", "--", sys.executable, "-m", module])
            out(f"  smoke test     {'passed' if code == 0 else f'FAILED (exit {code})'}")
            failed = failed or code != 0
    out("result: " + ("problems found (see above)" if failed else "ok"))
    return 1 if failed else 0
