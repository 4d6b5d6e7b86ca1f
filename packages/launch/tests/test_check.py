"""``mpxrun --check``: the report, and its verdict when something is wrong."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from mpx.launch.check import run_check

MPXRUN = shutil.which("mpxrun", path=os.path.dirname(sys.executable)) or "mpxrun"


def test_check_reports_and_runs_the_smoke_test() -> None:
    proc = subprocess.run(
        [MPXRUN, "--check"], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for label in (
        "launcher",
        "MPI library",
        "thread level",
        "CUDA-aware",
        "mpx-launch",
        "GPUs",
        "quantize",
        "smoke test     passed",
    ):
        assert label in out, f"{label!r} missing from:\n{out}"
    assert "  mpi   ok" in out
    assert out.rstrip().endswith("result: ok")


def test_a_failed_smoke_test_fails_the_check() -> None:
    lines: list[str] = []
    code = run_check(smoke=lambda args: 3, out=lines.append)
    assert code == 1
    assert "  smoke test     FAILED (exit 3)" in lines
    assert lines[-1] == "result: problems found (see above)"


def test_check_without_smoke_test_still_reports() -> None:
    lines: list[str] = []
    assert run_check(smoke=None, out=lines.append) == 0
    assert any(line.startswith("  mpx-collectives") for line in lines)
