"""Lightning's Trainer with ``DDPStrategy(process_group_backend="mpx")`` under mpxrun."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("lightning", reason="the nox test sessions install lightning")

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "lightning_digits.py"


RunJob = Callable[..., "subprocess.CompletedProcess[str]"]


def _epochs(run_job: RunJob, backend: str, nprocs: int, env: dict[str, str]) -> list[str]:
    script = [str(SCRIPT), "--backend", backend, "--epochs", "2"]
    done = run_job(nprocs, script, env, 450, gloo_control=backend == "gloo")
    lines = [line for line in done.stdout.splitlines() if line.startswith("epoch ")]
    assert len(lines) == 2, done.stdout
    assert all(f"(backend {backend}, {nprocs} ranks)" in line for line in lines), lines
    return [line.split(" (backend")[0] for line in lines]


@pytest.mark.timeout(900)
def test_lightning_trainer_on_mpx_equals_gloo(
    fresh_job_environment: Callable[[], dict[str, str]], run_job: RunJob
) -> None:
    # Two ranks' float32 gradients sum exactly in any order: bitwise equal.
    on_mpx = _epochs(run_job, "mpx", 2, fresh_job_environment())
    assert on_mpx == _epochs(run_job, "gloo", 2, fresh_job_environment())
    loss = [float(line.split()[3]) for line in on_mpx]
    assert loss[1] < loss[0] < 2.4  # it learns (ln 10 = 2.30 at chance)
