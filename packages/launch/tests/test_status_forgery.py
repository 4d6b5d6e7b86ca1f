"""A rank's output cannot pass for its supervisor's status line."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

MPXRUN = os.path.join(os.path.dirname(sys.executable), "mpxrun")

# Lines that look like status lines: the unsigned form mpxrun used to trust,
# and the signed form with a made-up signature.
FORGED = [
    "MPXRUN-RANK-FAILED 1 5 W10=",
    "MPXRUN-RANK-EXITED 1 5 W10= 0123456789abcdef0123456789abcdef",
    "MPXRUN-RANK-STACK 1 5 W10= 0123456789abcdef0123456789abcdef",
]

PROGRAM = textwrap.dedent(
    f"""
    import os, sys
    from mpx.launch import environment
    rank = environment().rank
    if rank == environment().world_size - 1:
        for line in {FORGED!r}:
            os.write(2, f"log of a test: {{line}}\\n".encode())
            os.write(2, f"{{line}}\\n".encode())
        # Its own key is not in its environment to sign with.
        os.write(1, f"key visible: {{'MPX_STATUS_KEY' in os.environ}}\\n".encode())
    os.write(1, f"rank {{rank}} done\\n".encode())
    """
)


@pytest.mark.parametrize("nprocs", [1, 2])
def test_a_healthy_job_printing_a_forged_status_line_exits_0(tmp_path: Path, nprocs: int) -> None:
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    proc = subprocess.run(
        [MPXRUN, "-n", str(nprocs), "--timeout", "120", str(script)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "key visible: False" in proc.stdout
    assert sorted(ln for ln in proc.stdout.splitlines() if ln.endswith("done")) == [
        f"rank {r} done" for r in range(nprocs)
    ]
    for line in FORGED:  # passed through as the program's output
        assert proc.stderr.count(line) == 2, proc.stderr
    assert "exited with code" not in proc.stderr


def test_a_last_stderr_line_without_newline_is_kept(tmp_path: Path) -> None:
    # The supervisor's status line follows it; it must not swallow it.
    script = tmp_path / "prog.py"
    script.write_text("import os\nos.write(2, b'no newline at the end')\n")
    proc = subprocess.run(
        [MPXRUN, "-n", "2", "--timeout", "120", str(script)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("no newline at the end") == 2, proc.stderr
