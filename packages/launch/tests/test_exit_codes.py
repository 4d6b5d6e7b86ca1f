"""Every way a Python rank exits non-zero ends the whole job at once, with that code.

``sys.exit(3)``, ``raise SystemExit(3)`` and the builtin ``exit(3)`` while the
other ranks wait in a collective (or sleep) used to differ: only the first
ended the job; the others hung in ``MPI_Finalize`` until ``--timeout`` and the
code was lost. A ``SystemExit`` that the program catches does not end it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

MPXRUN = os.path.join(os.path.dirname(sys.executable), "mpxrun")
# A hang shows as mpxrun's timeout code (124) instead of 3: no clock in the test.
JOB_TIMEOUT_S = 60

PROGRAM = textwrap.dedent(
    """
    import os, sys, threading, time
    how, peers = sys.argv[1], sys.argv[2]
    if how == "usage":  # a usage error: every rank exits 2, rank 0 says why (no MPI needed)
        said = os.path.join(os.path.dirname(os.path.abspath(__file__)), "said")
        if os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK")) == "0":
            print("bad --flag: use --good", file=sys.stderr, flush=True)
            open(said, "w").close()
        while not os.path.exists(said):  # rank 0 has said it before any rank exits
            time.sleep(0.01)
        sys.exit(2)
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    if comm.Get_rank() == comm.Get_size() - 1:
        if how == "raise":
            raise SystemExit(3)
        if how == "builtin":
            exit(3)
        if how == "sys":
            sys.exit(3)
        if how == "message":
            sys.exit("rank gives up")
        if how.startswith("caught-"):
            try:
                if how == "caught-sys":
                    sys.exit(3)
                raise SystemExit(3)
            except SystemExit as exc:
                os.write(1, f"caught {type(exc).__name__}({exc.code})\\n".encode())
        if how == "thread":
            worker = threading.Thread(target=sys.exit, args=(4,))
            worker.start()
            worker.join()
    if peers == "mpi":
        comm.Barrier()
    else:
        time.sleep(120)
    os.write(1, f"rank {comm.Get_rank()} finished\\n".encode())
    """
)


def _run(
    tmp_path: Path, nprocs: int, how: str, peers: str, *options: str
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    return subprocess.run(
        [
            MPXRUN,
            "-n",
            str(nprocs),
            "--timeout",
            str(JOB_TIMEOUT_S),
            *options,
            str(script),
            how,
            peers,
        ],
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S + 60,
        check=False,
    )


@pytest.mark.parametrize("how", ["raise", "builtin", "sys"])
@pytest.mark.parametrize(
    ("nprocs", "peers"), [(1, "mpi"), (2, "mpi"), (3, "mpi"), (2, "sleep"), (3, "sleep")]
)
def test_a_non_zero_exit_ends_the_job_with_its_code(
    tmp_path: Path, nprocs: int, how: str, peers: str
) -> None:
    proc = _run(tmp_path, nprocs, how, peers)
    assert proc.returncode == 3, proc.stderr
    assert f"rank {nprocs - 1} exited with code 3; all ranks were stopped" in proc.stderr


@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_a_usage_error_is_passed_on_once_not_reported_as_a_failure(
    tmp_path: Path, nprocs: int
) -> None:
    proc = _run(tmp_path, nprocs, "usage", "mpi")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("bad --flag: use --good") == 1, proc.stderr
    assert "mpxrun:" not in proc.stderr, proc.stderr


def test_a_usage_error_is_not_restarted(tmp_path: Path) -> None:
    proc = _run(tmp_path, 2, "usage", "mpi", "--max-restarts", "2")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("bad --flag: use --good") == 1, proc.stderr
    assert "Restart" not in proc.stderr, proc.stderr


def test_an_exit_message_ends_the_job_with_code_1(tmp_path: Path) -> None:
    proc = _run(tmp_path, 2, "message", "mpi")
    assert proc.returncode == 1, proc.stderr
    assert "rank gives up" in proc.stderr


@pytest.mark.parametrize("how", ["caught-sys", "caught-raise"])
def test_a_caught_system_exit_does_not_end_the_job(tmp_path: Path, how: str) -> None:
    proc = _run(tmp_path, 2, how, "mpi")
    assert proc.returncode == 0, proc.stderr
    assert "caught SystemExit(3)" in proc.stdout
    assert sorted(ln for ln in proc.stdout.splitlines() if "finished" in ln) == [
        "rank 0 finished",
        "rank 1 finished",
    ]


def test_sys_exit_in_a_thread_ends_only_the_thread_quietly(tmp_path: Path) -> None:
    proc = _run(tmp_path, 2, "thread", "mpi")
    assert proc.returncode == 0, proc.stderr
    assert "Exception in thread" not in proc.stderr
    assert "rank 1 finished" in proc.stdout
