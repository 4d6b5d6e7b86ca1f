"""The run_job fixture retries a gloo control run only for torch's gloo exit abort."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

RunJob = Callable[..., "subprocess.CompletedProcess[str]"]

# Aborts as torch's gloo does at exit on its first run (per rank), succeeds after.
SCRIPT = """
import os, sys
marker = sys.argv[1] + "." + os.environ.get("PMI_RANK", os.environ.get("RANK", "0"))
if not os.path.exists(marker):
    open(marker, "w").close()
    sys.stderr.write("terminate called without an active exception\\n")
    sys.stderr.flush()
    os.abort()
print("finished")
"""


def test_a_gloo_control_run_is_retried_after_the_exit_abort(
    tmp_path: Path, run_job: RunJob, fresh_job_environment: Callable[..., dict[str, str]]
) -> None:
    script = tmp_path / "aborts_once.py"
    script.write_text(SCRIPT)
    done = run_job(1, [str(script), str(tmp_path / "ran")], fresh_job_environment(), 120,
                   gloo_control=True)  # fmt: skip
    assert "finished" in done.stdout


def test_any_other_run_fails_on_the_same_abort(
    tmp_path: Path, run_job: RunJob, fresh_job_environment: Callable[..., dict[str, str]]
) -> None:
    script = tmp_path / "aborts_once.py"
    script.write_text(SCRIPT)
    with pytest.raises(AssertionError, match="terminate called without an active exception"):
        run_job(1, [str(script), str(tmp_path / "ran")], fresh_job_environment(), 120)
