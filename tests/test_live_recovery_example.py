"""examples/live_recovery.py as docs/live-recovery.md runs it: two replica groups, one killed.

Group 1 SIGKILLs itself in step 30 of its first start; the job must end with
exit 0, the survivor having discarded and redone that step, group 1 having
rejoined with the live state after its restart, both groups at the same step
count with the same weights (checksum), and the model learnt.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "live_recovery.py"
MPXRUN = shutil.which("mpxrun", path=os.path.dirname(sys.executable)) or "mpxrun"
DONE = re.compile(
    r"group (\d): done, (\d+) steps: .* test accuracy ([\d.]+)%, weights sha256 ([0-9a-f]{16})"
)
EPOCHS = 4  # 22 steps an epoch: the kill at step 30 falls in the second
STEPS = EPOCHS * 22


def test_a_killed_group_rejoins_and_the_groups_end_equal(
    tmp_path: Path, fresh_job_environment: Callable[..., dict[str, str]]
) -> None:
    # A SIGKILL is seen by its closed connection; a long heartbeat timeout keeps a
    # pause of this loaded 2-core machine from counting a live group out.
    env = fresh_job_environment(MPX_FT_HEARTBEAT_TIMEOUT="20")
    command = [MPXRUN, "--replica-groups", "2", "-n", "1", "--max-restarts", "1"]
    command += ["--timeout", "240", "--", sys.executable, str(EXAMPLE)]
    command += ["--epochs", str(EPOCHS), "--fail-at", "30:1"]
    proc = subprocess.run(
        command, capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path, env=env
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "group 1: --fail-at: SIGKILL in step 30" in out, out[-4000:]
    assert "group 0: step 30 discarded" in out, out[-4000:]
    rejoined = re.search(r"group 1: rejoined at step (\d+)", out)
    assert rejoined, out[-4000:]
    assert 30 <= int(rejoined[1]) < STEPS, out[-4000:]
    done = {int(m[1]): m for m in DONE.finditer(out)}
    assert sorted(done) == [0, 1], out[-4000:]
    assert [int(done[g][2]) for g in (0, 1)] == [STEPS, STEPS], out[-4000:]
    assert done[0][4] == done[1][4], out[-4000:]  # the same weights in both groups
    assert float(done[0][3]) >= 90.0, out[-4000:]  # 95 % after 4 epochs on this split


def test_a_malformed_fail_at_is_a_usage_error(
    tmp_path: Path, user_environment: dict[str, str]
) -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--fail-at", "30"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
        env=user_environment,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--fail-at '30': expected STEP:GROUP" in proc.stderr, proc.stderr


def test_both_groups_killed_resume_from_their_checkpoints(
    tmp_path: Path, fresh_job_environment: Callable[..., dict[str, str]]
) -> None:
    """Both groups die in step 30: no live state is left, and each resumes from its own
    checkpoint of step 30 (docs/live-recovery.md, 'Checkpoints'); both finish equal."""
    env = fresh_job_environment(MPX_FT_HEARTBEAT_TIMEOUT="20")
    command = [MPXRUN, "--replica-groups", "2", "-n", "1", "--max-restarts", "1"]
    command += ["--timeout", "240", "--", sys.executable, str(EXAMPLE)]
    command += ["--epochs", str(EPOCHS), "--fail-at", "30:0", "--fail-at", "30:1"]
    command += ["--checkpoint-dir", "ckpt"]
    proc = subprocess.run(
        command, capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path, env=env
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for group in (0, 1):
        assert f"group {group}: --fail-at: SIGKILL in step 30" in out, out[-4000:]
        assert f"group {group}: resumed from ckpt/ckpt_group{group}_rank0.pt at step 30" in out
    done = {int(m[1]): m for m in DONE.finditer(out)}
    assert sorted(done) == [0, 1], out[-4000:]
    assert [int(done[g][2]) for g in (0, 1)] == [STEPS, STEPS], out[-4000:]
    assert done[0][4] == done[1][4], out[-4000:]
    assert float(done[0][3]) >= 90.0, out[-4000:]
