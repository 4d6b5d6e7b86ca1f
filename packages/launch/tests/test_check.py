"""``mpxrun --check``: the report, and its verdict when something is wrong."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mpx.launch.command import check, run_check

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
    assert "  launch MPI ok: 2 ranks, allreduce exact" in out
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


# Run in every Python process of the check (probes, mpxrun, ranks): torch and
# the packages above mpx-launch look uninstalled, as after
# `pip install "mpx-launch[mpich]"`.
HIDE = """
import importlib.abc, importlib.metadata, sys

MODULES = ("torch", "mpx.collectives", "mpx.quantize", "mpx.dataparallel", "mpx.pipeline",
           "mpx.mgrit")
DISTRIBUTIONS = {"torch", "mpx-collectives", "mpx-quantize", "mpx-dataparallel",
                 "mpx-pipeline", "mpx-mgrit"}


class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in MODULES or name.startswith(tuple(m + "." for m in MODULES)):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Hide())
found = importlib.metadata.version


def version(name):
    if name.lower().replace("_", "-") in DISTRIBUTIONS:
        raise importlib.metadata.PackageNotFoundError(name)
    return found(name)


importlib.metadata.version = version
"""


def test_a_launch_only_install_passes_its_check(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(HIDE)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [MPXRUN, "--check"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=dict(os.environ, PYTHONPATH=path),
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "  mpx-launch       0." in out
    assert "  mpx-collectives  not installed: pip install mpx-collectives adds" in out
    assert "  torch            not installed: pip install torch adds" in out
    assert "mpx.launch.selftest" in out
    assert "  launch MPI ok: 2 ranks, allreduce exact" in out
    assert "mpx.collectives.selftest" not in out
    assert out.rstrip().endswith("result: ok")


def test_missing_packages_are_no_failure_but_say_what_they_add(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(check, "_importable", lambda module: module == "mpi4py")
    monkeypatch.setattr(check, "_installed", lambda name: "0.1.0" if name == "mpx-launch" else None)
    ran: list[list[str]] = []
    lines: list[str] = []

    def smoke(args: list[str]) -> int:
        ran.append(args)
        return 0

    assert check.run_check(smoke=smoke, out=lines.append) == 0
    assert [args[-1] for args in ran] == ["mpx.launch.selftest"]
    for name in check.PACKAGES[1:]:
        assert any(
            line.startswith(f"  {name}") and f"pip install {name} adds {check.ADDS[name]}" in line
            for line in lines
        ), lines
    assert lines[-1] == "result: ok"


def test_the_launch_selftest_runs_without_torch_on_any_rank_count() -> None:
    for nprocs in (1, 2, 3):
        proc = subprocess.run(
            [
                MPXRUN,
                "-n",
                str(nprocs),
                "--timeout",
                "120",
                "--",
                sys.executable,
                "-m",
                "mpx.launch.selftest",
            ],
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        assert f"  launch MPI ok: {nprocs} ranks, allreduce exact" in proc.stdout


def test_kernels_line_says_the_cpu_kernels_run_where_cuda_ones_cannot() -> None:
    """The CUDA wheel on a machine without a GPU or driver: a clear line, not 'cpu,cuda'."""
    line = check._kernels_line(["cpu", "cuda"], ["cpu"])
    assert line.startswith("cpu,cuda (")
    assert "no CUDA GPU or driver here: the CPU kernels run" in line
    assert check._kernels_line(["cpu", "cuda"], ["cpu", "cuda"]) == "cpu,cuda"
    assert check._kernels_line(["cpu"], ["cpu"]) == "cpu"
    assert check._kernels_line([], []) == "none"
