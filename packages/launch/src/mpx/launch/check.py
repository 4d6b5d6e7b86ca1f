"""``mpxrun --check``: what this installation can do, and a 2-rank smoke test.

Like ``horovodrun --check-build``: it reports, without needing a job::

    launcher        kind and path of mpiexec/mpirun/srun
    MPI library     version line, thread level, CUDA-aware or not
    mpx packages    which are installed, with versions
    quantize        which kernels were built (cpu, cuda)
    GPUs            what torch sees
    smoke test      mpxrun -n 2 python -m mpx.collectives.selftest

mpx-launch needs neither torch nor mpi4py, so every probe runs in a
subprocess and a missing piece is reported, not raised.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from collections.abc import Callable

from mpx.launch.errors import LaunchError
from mpx.launch.launchers import find_launcher

__all__ = ["run_check"]

PACKAGES = (
    "mpx-launch",
    "mpx-collectives",
    "mpx-quantize",
    "mpx-dataparallel",
    "mpx-pipeline",
    "mpx-mgrit",
)

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
print(",".join(mpx.quantize.available_backends()) or "none")
"""


def _probe(code: str, timeout: float = 120) -> tuple[bool, list[str]]:
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, check=False
    )
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
        return False, [last]
    return True, result.stdout.strip().splitlines()


def run_check(
    smoke: Callable[[list[str]], int] | None = None, out: Callable[[str], None] = print
) -> int:
    """Prints the report; returns 0 if MPI works and the smoke test passed.

    Args:
        smoke: runs ``mpxrun`` with the given arguments and returns its exit
            code (the CLI passes itself); None skips the smoke test.
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
    for name in PACKAGES:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            version = "not installed"
        out(f"  {name:<16} {version}")
    ok, lines = _probe(_TORCH_PROBE)
    if ok:
        count, *names = lines[1].split()
        out(f"  torch          {lines[0]}")
        out(f"  GPUs           {count}" + (f" ({', '.join(names)})" if names else ""))
    else:
        out(f"  torch          not importable: {lines[0]}")
    ok, lines = _probe(_QUANTIZE_PROBE)
    out(f"  quantize       {'kernels: ' + lines[0] if ok else 'not available: ' + lines[0]}")
    if smoke is not None and not failed:
        out("  smoke test     mpxrun -n 2 python -m mpx.collectives.selftest")
        code = smoke(
            ["-n", "2", "--timeout", "300", "--", sys.executable, "-m", "mpx.collectives.selftest"]
        )
        out(f"  smoke test     {'passed' if code == 0 else f'FAILED (exit {code})'}")
        failed = failed or code != 0
    out("result: " + ("problems found (see above)" if failed else "ok"))
    return 1 if failed else 0
