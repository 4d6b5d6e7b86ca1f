"""The root conftest's multi-rank machinery, as a job runs it.

The run_job fixture retries a gloo control run only for torch's gloo exit
abort; a multi-rank pytest run prints one warnings summary, not one per rank.
"""

from __future__ import annotations

import shutil
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


WARNS = """
import warnings

import pytest

pytestmark = pytest.mark.mpi


def test_warns() -> None:
    warnings.warn("a warning every rank gives", UserWarning)


def test_skips() -> None:
    pytest.skip("a skip every rank makes")
"""


def test_a_multi_rank_run_prints_one_warnings_summary(
    tmp_path: Path, run_job: RunJob, fresh_job_environment: Callable[..., dict[str, str]]
) -> None:
    # The repository's conftest, in a directory of its own with one test that warns.
    shutil.copy(Path(__file__).resolve().parent.parent / "conftest.py", tmp_path)
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\naddopts = -ra\nmarkers =\n    mpi: multi-rank\n"
    )
    (tmp_path / "test_warns.py").write_text(WARNS)
    done = run_job(3, ["-m", "pytest", str(tmp_path), "-p", "no:cacheprovider"],
                   fresh_job_environment(), 120)  # fmt: skip
    output = done.stdout + done.stderr
    assert output.count("= warnings summary =") == 1, output
    # The skipped tests, too, are listed by rank 0 alone (-ra): the ranks skip alike.
    assert output.count("a skip every rank makes") == 1, output
    assert output.count("a warning every rank gives") == 2, output  # the location and its line
    for rank in (1, 2):
        assert f"rank {rank}: 1 warning(s), not listed: the warnings summary is rank 0's" in output
