"""Lightning's Trainer with ``DDPStrategy(process_group_backend="mpx")`` under mpxrun."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("lightning", reason="the nox test sessions install lightning")

ROOT = Path(__file__).resolve().parent.parent
MPXRUN = shutil.which("mpxrun", path=os.path.dirname(sys.executable)) or "mpxrun"
SCRIPT = ROOT / "examples" / "lightning_digits.py"


def _epochs(backend: str, nprocs: int, env: dict[str, str]) -> list[str]:
    mpxrun = [MPXRUN, "-n", str(nprocs), "--timeout", "400", "--"]
    done = subprocess.run(
        [*mpxrun, sys.executable, str(SCRIPT), "--backend", backend, "--epochs", "2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=450,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("epoch ")]
    assert len(lines) == 2, done.stdout
    assert all(f"(backend {backend}, {nprocs} ranks)" in line for line in lines), lines
    return [line.split(" (backend")[0] for line in lines]


@pytest.mark.timeout(900)
def test_lightning_trainer_on_mpx_equals_gloo(
    fresh_job_environment: Callable[[], dict[str, str]],
) -> None:
    # Two ranks' float32 gradients sum exactly in any order: bitwise equal.
    on_mpx = _epochs("mpx", 2, fresh_job_environment())
    assert on_mpx == _epochs("gloo", 2, fresh_job_environment())
    loss = [float(line.split()[3]) for line in on_mpx]
    assert loss[1] < loss[0] < 2.4  # it learns (ln 10 = 2.30 at chance)
