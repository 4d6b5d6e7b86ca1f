"""``mpxrun --replica-groups R``: R jobs that fail and restart alone, and what each rank is told."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mpx.launch.cli import EXIT_USAGE, main

PROGRAM = textwrap.dedent(
    """
    import hashlib, os, sys, time
    group, attempt = os.environ["MPX_REPLICA_GROUP"], os.environ["MPX_RESTART_COUNT"]
    secret = os.environ["MPX_JOB_SECRET"]  # printed as a digest only
    print(f"start group={group} of={os.environ['MPX_REPLICA_GROUPS']} attempt={attempt} "
          f"lighthouse={os.environ['MPX_LIGHTHOUSE']} job={os.environ['MPX_JOB_ID']} "
          f"secret={len(secret)}:{hashlib.sha256(secret.encode()).hexdigest()[:12]}", flush=True)
    if group == "1" and attempt == "0":
        sys.exit(3)          # group 1 fails once; group 0 must not be restarted for it
    time.sleep(float(sys.argv[1]) if group == "0" else 0)
    """
)


def _mpxrun(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    mpxrun = Path(sys.executable).parent / "mpxrun"
    return subprocess.run(
        [str(mpxrun), *args, "--timeout", "100", "--", sys.executable, str(script), "3"],
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )


def test_a_failed_group_restarts_alone(tmp_path: Path) -> None:
    done = _mpxrun(tmp_path, "--replica-groups", "2", "--max-restarts", "1")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    starts = sorted(line for line in done.stdout.splitlines() if line.startswith("start"))
    assert [s.split(" lighthouse")[0] for s in starts] == [
        "start group=0 of=2 attempt=0",
        "start group=1 of=2 attempt=0",
        "start group=1 of=2 attempt=1",
    ], out
    # One lighthouse and one secret (64 hex digits) for all; each group its own job id.
    assert len({s.split("lighthouse=")[1].split()[0] for s in starts}) == 1
    assert len({s.split("job=")[1].split()[0] for s in starts[:2]}) == 2
    assert {s.split("secret=")[1].split(":")[0] for s in starts} == {"64"}
    assert len({s.split("secret=")[1] for s in starts}) == 1
    assert (
        "replica group 1: rank 0 exited with code 3; its ranks were stopped, the other "
        "groups go on. Restart 1 of 1" in out
    )


def test_a_group_out_of_restarts_fails_the_job(tmp_path: Path) -> None:
    done = _mpxrun(tmp_path, "--replica-groups", "2")
    assert done.returncode == 3, done.stderr
    assert "replica group 1 failed for good: rank 0 exited with code 3" in done.stderr


@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_bad_group_count_is_refused(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--replica-groups", value, "--", "true"])
    assert exit_info.value.code == EXIT_USAGE
    assert "--replica-groups" in capsys.readouterr().err


def test_replica_groups_off_this_host_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost:2\n")
    code = main(["--replica-groups", "2", "--hostfile", str(hostfile), "--", "true"])
    assert code == EXIT_USAGE
    assert "--replica-groups runs every group on this host" in capsys.readouterr().err
