"""An unmodified torchrun-style DDP script runs under mpxrun on mpx (and cgx) as on gloo."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MPXRUN = shutil.which("mpxrun", path=os.path.dirname(sys.executable)) or "mpxrun"
SCRIPT = ROOT / "examples" / "ddp_torchrun.py"


def _run(backend: str, env: dict[str, str]) -> list[str]:
    done = subprocess.run(
        [
            MPXRUN,
            "-n",
            "2",
            "--timeout",
            "240",
            "--",
            sys.executable,
            str(SCRIPT),
            *["--backend", backend],
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [line for line in done.stdout.splitlines() if line.startswith("step ")]


@pytest.mark.timeout(600)
def test_torchrun_script_on_mpx_equals_gloo(
    fresh_job_environment: Callable[..., dict[str, str]],
) -> None:
    on_mpx = _run("mpx", fresh_job_environment())
    assert len(on_mpx) == 5
    assert on_mpx == _run("gloo", fresh_job_environment())


@pytest.mark.timeout(600)
def test_torchrun_script_on_cgx(fresh_job_environment: Callable[..., dict[str, str]]) -> None:
    """``init_process_group("cgx")``: exact at CGX's 32 bits, quantized at 4."""
    on_gloo = _run("gloo", fresh_job_environment())
    assert _run("cgx", fresh_job_environment(CGX_COMPRESSION_QUANTIZATION_BITS="32")) == on_gloo
    at_4_bits = _run("cgx", fresh_job_environment(CGX_COMPRESSION_QUANTIZATION_BITS="4"))
    assert len(at_4_bits) == 5
    assert at_4_bits != on_gloo
