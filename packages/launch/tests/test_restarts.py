"""``mpxrun --max-restarts N``: a failed or hung attempt is torn down and started again.

Each program reads ``MPX_RESTART_COUNT`` to decide whether this attempt fails,
so the tests need no clock and no training.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

MPXRUN = os.path.join(os.path.dirname(sys.executable), "mpxrun")
# A hang that is not restarted shows as exit 124 instead of 0: no clock in the test.
JOB_TIMEOUT_S = 60
# The hang test's --timeout: long enough for a healthy attempt to start MPI on
# a loaded 2-core machine.
HANG_TIMEOUT_S = 15

# argv[1]: "exit" (rank 1 exits 3), "kill" (rank 1 SIGKILLs itself) or
# "hang" (rank 1 sleeps); argv[2]: the attempts that fail ("0" or "all").
PROGRAM = textwrap.dedent(
    """
    import os, signal, sys, time
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    attempt = int(os.environ["MPX_RESTART_COUNT"])
    assert os.environ["TORCHELASTIC_RESTART_COUNT"] == str(attempt)
    how, failing = sys.argv[1], sys.argv[2]
    os.write(1, f"rank {rank} attempt {attempt}\\n".encode())
    if rank == min(1, comm.Get_size() - 1) and (failing == "all" or attempt == 0):
        if how == "exit":
            sys.exit(3)
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)
    comm.Barrier()
    os.write(1, f"rank {rank} finished attempt {attempt}\\n".encode())
    """
)


def _run(
    tmp_path: Path, nprocs: int, options: list[str], how: str, failing: str
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    timeout = ["--timeout", str(JOB_TIMEOUT_S)] if "--timeout" not in options else []
    return subprocess.run(
        [MPXRUN, "-n", str(nprocs), *timeout, *options, str(script), how, failing],
        capture_output=True,
        text=True,
        timeout=3 * JOB_TIMEOUT_S + 60,
        check=False,
    )


@pytest.mark.parametrize(("how", "cause"), [("exit", "exited with code 3"), ("kill", "SIGKILL")])
# 3 ranks: another rank count of the same restarted job (nox -s tests-extended).
@pytest.mark.parametrize("nprocs", [2, pytest.param(3, marks=pytest.mark.extended)])
def test_a_rank_failing_once_is_restarted_and_the_job_succeeds(
    tmp_path: Path, nprocs: int, how: str, cause: str
) -> None:
    proc = _run(tmp_path, nprocs, ["--max-restarts", "1"], how, "0")
    assert proc.returncode == 0, proc.stderr
    for rank in range(nprocs):
        assert f"rank {rank} finished attempt 1" in proc.stdout, proc.stdout
    assert "finished attempt 0" not in proc.stdout
    assert f"mpxrun: rank 1 {'was killed by ' if how == 'kill' else ''}" in proc.stderr
    assert cause in proc.stderr
    assert "Restart 1 of 1" in proc.stderr, proc.stderr
    assert "s lost" in proc.stderr


@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_a_job_failing_every_attempt_gives_up_after_n_restarts(tmp_path: Path, nprocs: int) -> None:
    proc = _run(tmp_path, nprocs, ["--max-restarts", "2"], "exit", "all")
    failing_rank = min(1, nprocs - 1)
    assert proc.returncode == 3, proc.stderr
    for attempt in range(3):
        assert f"rank {failing_rank} attempt {attempt}" in proc.stdout, proc.stdout
    assert "attempt 3" not in proc.stdout
    assert "Restart 1 of 2" in proc.stderr
    assert "Restart 2 of 2" in proc.stderr
    assert (
        f"giving up after 2 restart(s) (--max-restarts 2); the last attempt failed: "
        f"rank {failing_rank} exited with code 3" in proc.stderr
    ), proc.stderr


def test_a_hung_job_is_restarted_after_timeout(tmp_path: Path) -> None:
    options = ["--timeout", str(HANG_TIMEOUT_S), "--max-restarts", "1"]
    proc = _run(tmp_path, 2, options, "hang", "0")
    assert proc.returncode == 0, proc.stderr
    assert "rank 1 finished attempt 1" in proc.stdout, proc.stdout
    assert f"the job ran past --timeout {HANG_TIMEOUT_S} s" in proc.stderr
    assert "Restart 1 of 1" in proc.stderr


def test_without_max_restarts_a_failure_ends_the_job(tmp_path: Path) -> None:
    proc = _run(tmp_path, 2, [], "exit", "0")
    assert proc.returncode == 3, proc.stderr
    assert "finished attempt" not in proc.stdout
    assert "Restart" not in proc.stderr


@pytest.mark.parametrize(
    ("option", "value"),
    [("--max-restarts", "-1"), ("--max-restarts", "two"), ("--restart-delay", "-0.5")],
)
def test_bad_restart_options_are_usage_errors(option: str, value: str) -> None:
    proc = subprocess.run(
        [MPXRUN, option, value, "true"], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 2
    assert f"{option} must be" in proc.stderr
    assert repr(value) in proc.stderr


# A stand-in for srun inside an allocation: it logs its arguments and the
# attempt it was started for, then runs the ranks through MPICH's mpiexec.
# What it checks is mpxrun's side (one srun step per attempt, the attempt's
# environment, --kill-on-bad-exit); Slurm's own step teardown is not here.
FAKE_SRUN = """#!/bin/sh
echo "$MPX_RESTART_COUNT $*" >> "$FAKE_SRUN_LOG"
n=$2
shift 2
while [ "${1#--}" != "$1" ]; do shift; done  # srun's own options
exec "$FAKE_SRUN_MPIEXEC" -n "$n" "$@"
"""


def test_under_slurm_each_attempt_is_a_new_srun_step(tmp_path: Path) -> None:
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable))
    assert mpiexec is not None
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(FAKE_SRUN)
    srun.chmod(0o755)
    log = tmp_path / "srun.log"
    env = dict(
        os.environ,
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        SLURM_JOB_ID="4242",  # inside an allocation: mpxrun picks srun by itself
        FAKE_SRUN_LOG=str(log),
        FAKE_SRUN_MPIEXEC=mpiexec,
    )
    env.pop("MPX_LAUNCHER", None)
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    proc = subprocess.run(
        [
            MPXRUN,
            "-n",
            "2",
            "--timeout",
            str(JOB_TIMEOUT_S),
            "--max-restarts",
            "1",
            str(script),
            "exit",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=3 * JOB_TIMEOUT_S,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Restart 1 of 1" in proc.stderr
    assert "rank 1 finished attempt 1" in proc.stdout, proc.stdout
    steps = log.read_text().splitlines()
    assert [line.split()[0] for line in steps] == ["0", "1"], steps
    assert all(" -n 2 --kill-on-bad-exit=1 " in line for line in steps), steps
