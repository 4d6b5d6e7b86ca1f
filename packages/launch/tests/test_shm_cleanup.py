"""mpxrun removes the MPI shared memory its job's dead ranks left, and only that."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mpx.launch.supervision import shm_cleanup

MPXRUN = shutil.which("mpxrun", path=os.path.dirname(sys.executable)) or "mpxrun"


def test_only_new_unused_segments_are_removed(tmp_path: Path) -> None:
    old = tmp_path / "mpich_shm_old_0"
    old.write_bytes(b"x")  # there before the job: not ours
    before = shm_cleanup.segments(tmp_path)
    orphan = tmp_path / "mpich_shm_dead_0"
    orphan.write_bytes(b"x")  # created by the job, nobody holds it
    held = tmp_path / "mpich_shm_live_0"
    held.write_bytes(b"x")
    other = tmp_path / "not_mpi_0"
    other.write_bytes(b"x")  # not an MPI segment
    with open(held, "rb"):  # a running process has it open: another job's
        removed = shm_cleanup.remove_orphans(before, tmp_path)
    assert removed == ["mpich_shm_dead_0"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "mpich_shm_live_0",
        "mpich_shm_old_0",
        "not_mpi_0",
    ]


@pytest.mark.skipif(not shm_cleanup.SHM_DIR.is_dir(), reason="no /dev/shm on this system")
@pytest.mark.parametrize("how", ["raise", "sigkill"])
def test_a_failed_job_leaves_no_mpich_segment(tmp_path: Path, how: str) -> None:
    program = tmp_path / "job.py"
    program.write_text(
        textwrap.dedent(
            f"""
            import os
            from mpi4py import MPI
            MPI.COMM_WORLD.Barrier()  # MPICH has made the node's shared memory
            if MPI.COMM_WORLD.Get_rank() == 1:
                if {how!r} == "sigkill":
                    os.kill(os.getpid(), 9)
                raise RuntimeError("deliberate failure")
            MPI.COMM_WORLD.Barrier()
            """
        )
    )
    before = shm_cleanup.segments()
    done = subprocess.run(
        [MPXRUN, "-n", "2", "--timeout", "120", "--", sys.executable, str(program)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode != 0, done.stderr  # the job did fail...
    new = shm_cleanup.segments() - before
    # ...and left no segment. Every rank of this job has ended, so a new segment that
    # a live process maps is another job's, started meanwhile (a test running beside
    # this one under pytest-xdist, another user's): not this job's leftover.
    assert {name for name in new if not _mapped_by_a_running_process(name)} == set()


def _mapped_by_a_running_process(name: str) -> bool:
    """Whether a process now maps or holds open /dev/shm/NAME (read from /proc)."""
    path = str(shm_cleanup.SHM_DIR / name)
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if path in (proc / "maps").read_text():
                return True
            fds = list((proc / "fd").iterdir())
        except OSError:  # the process ended meanwhile, or is not ours to read
            continue
        for fd in fds:
            try:
                if os.readlink(fd) == path:
                    return True
            except OSError:  # closed meanwhile
                continue
    return False
