"""mpxrun end to end: real jobs of 1, 2 and 3 ranks, failures, timeouts, bad usage."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mpx.launch import cli

MPXRUN = shutil.which("mpxrun", path=os.path.dirname(sys.executable)) or "mpxrun"

# Every rank records its pid, so that the test can check nothing survives.
PROGRAM = textwrap.dedent(
    """
    import os, sys, time
    from mpx.launch import environment
    env = environment()
    out = sys.argv[1]
    with open(os.path.join(out, f"pid.{env.rank}"), "w") as fh:
        fh.write(str(os.getpid()))
    # One write() per line: with PYTHONUNBUFFERED, print() writes the text and
    # the newline separately, and the launcher may interleave other ranks between.
    os.write(1, f"rank {env.rank} of {env.world_size} threads={os.environ['OMP_NUM_THREADS']}\\n"
             .encode())
    mode = sys.argv[2] if len(sys.argv) > 2 else "ok"
    if mode == "mpi":
        from mpi4py import MPI
        MPI.COMM_WORLD.Barrier()
    if env.rank == 1 and mode in ("raise", "mpi"):
        print("rank 1 is about to fail", file=sys.stderr, flush=True)
        raise ValueError("deliberate failure on rank 1")
    if env.rank == 1 and mode == "mpi-exit3":
        from mpi4py import MPI
        sys.exit(3)  # while rank 0 waits in a barrier
    if env.rank == 0 and mode == "mpi-exit3":
        from mpi4py import MPI
        MPI.COMM_WORLD.Barrier()
    if env.rank == 1 and mode == "sigkill":
        os.kill(os.getpid(), 9)
    if env.rank == 0 and mode == "exit7":
        sys.exit(7)
    if mode == "mpi":
        MPI.COMM_WORLD.Barrier()  # rank 1 never arrives
    if mode != "ok":
        time.sleep(120)
    """
)


def _run(
    tmp_path: Path, *args: str, timeout: float = 60
) -> tuple[subprocess.CompletedProcess[str], float]:
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    start = time.monotonic()
    proc = subprocess.run(
        [MPXRUN, *args[:-1], str(script), str(tmp_path), args[-1]],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return proc, time.monotonic() - start


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as fh:
            return not any(line.startswith("State:\tZ") for line in fh)
    except FileNotFoundError:
        return False


def _assert_no_survivors(tmp_path: Path) -> None:
    pids = [int(p.read_text()) for p in tmp_path.glob("pid.*")]
    assert pids, "the ranks never started"
    time.sleep(0.5)
    assert [pid for pid in pids if _alive(pid)] == []


@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_job_runs_every_rank(tmp_path: Path, nprocs: int) -> None:
    proc, _ = _run(tmp_path, "-n", str(nprocs), "ok")
    assert proc.returncode == 0, proc.stderr
    assert sorted(line for line in proc.stdout.splitlines() if line.startswith("rank")) == [
        f"rank {r} of {nprocs} threads={max(1, len(os.sched_getaffinity(0)) // nprocs)}"
        for r in range(nprocs)
    ]


def test_exit_code_passes_through(tmp_path: Path) -> None:
    proc, _ = _run(tmp_path, "-n", "2", "exit7")
    assert proc.returncode == 7
    assert "rank 0 exited with code 7" in proc.stderr
    _assert_no_survivors(tmp_path)


@pytest.mark.parametrize("nprocs", [2, 3])
def test_a_raising_rank_stops_the_job_and_is_named(tmp_path: Path, nprocs: int) -> None:
    proc, took = _run(tmp_path, "-n", str(nprocs), "raise")
    assert took < 10
    assert proc.returncode == 1
    assert "mpxrun: rank 1 exited with code 1; all ranks were stopped." in proc.stderr
    # Printed with the rank, as torch does, once; the summary points at it.
    assert "\n[rank1]: ValueError: deliberate failure on rank 1\n" in proc.stderr
    assert proc.stderr.count("[rank1]: Traceback (most recent call last):") == 1, proc.stderr
    assert (
        "mpxrun: rank 1's error is printed above; it ends: "
        "[rank1]: ValueError: deliberate failure on rank 1"
    ) in proc.stderr
    assert "MPXRUN-RANK-FAILED" not in proc.stderr + proc.stdout
    _assert_no_survivors(tmp_path)


def test_a_rank_raising_while_peers_wait_in_mpi_stops_the_job(tmp_path: Path) -> None:
    # Without mpx's exit hook, rank 1 would hang in MPI_Finalize at exit.
    proc, took = _run(tmp_path, "-n", "3", "mpi")
    assert took < 10, proc.stderr
    assert proc.returncode == 1
    assert "rank 1 exited with code 1" in proc.stderr
    _assert_no_survivors(tmp_path)


def test_sys_exit_while_peers_wait_in_mpi_stops_the_job(tmp_path: Path) -> None:
    # sys.exit(3) would otherwise wait in MPI_Finalize for rank 0, stuck in a barrier.
    proc, took = _run(tmp_path, "-n", "2", "mpi-exit3")
    assert took < 10, proc.stderr
    assert proc.returncode == 3
    assert "rank 1 exited with code 3" in proc.stderr
    _assert_no_survivors(tmp_path)


def test_a_sigkilled_rank_stops_the_job(tmp_path: Path) -> None:
    proc, took = _run(tmp_path, "-n", "3", "sigkill")
    assert took < 10
    assert proc.returncode == 137
    assert "rank 1 was killed by SIGKILL" in proc.stderr
    _assert_no_survivors(tmp_path)


def test_timeout_stops_a_hung_job(tmp_path: Path) -> None:
    proc, took = _run(tmp_path, "-n", "2", "--timeout", "3", "hang")
    assert 3 <= took < 10
    assert proc.returncode == 124
    assert "ran past --timeout 3 s" in proc.stderr
    _assert_no_survivors(tmp_path)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize(
    ("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGHUP, 129), (signal.SIGINT, 130)]
)
def test_a_signal_to_mpxrun_stops_the_job_with_128_plus_its_number(
    tmp_path: Path, signum: int, code: int
) -> None:
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    proc = subprocess.Popen(
        [MPXRUN, "-n", "2", sys.executable, str(script), str(tmp_path), "sleep"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A shell ignores SIGINT in the commands it starts with `&` (CI run in the
        # background), and the ignore is inherited: mpxrun, as Python itself, keeps
        # it. The test is about a SIGINT mpxrun is meant to receive.
        preexec_fn=_default_sigint,  # noqa: PLW1509 (sets one signal disposition)
    )
    deadline = time.monotonic() + 60
    # Both ranks running, their pids written: a rank stopped between creating its
    # file and writing it left an empty one (seen once under load).
    while len([p for p in tmp_path.glob("pid.*") if p.read_text()]) < 2:
        assert time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.1)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert f"{signal.Signals(signum).name} received; all ranks were stopped" in err
    _assert_no_survivors(tmp_path)


def test_tag_output_prefixes_lines(tmp_path: Path) -> None:
    proc, _ = _run(tmp_path, "-n", "2", "--tag-output", "ok")
    assert proc.returncode == 0
    # Each launcher's own tag: Hydra's "[1] ", gforker's "1>" (single-host MPICH jobs).
    assert any(
        line.startswith(("[1]", "1>")) and "rank 1 of 2" in line
        for line in proc.stdout.splitlines()
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-n", "0", "prog"], "-n must be a positive integer, got '0'"),
        (["-n", "two", "prog"], "-n must be a positive integer, got 'two'"),
        (["-n", "2", "no-such-program-xyz"], "program 'no-such-program-xyz' not found on PATH"),
        (["-n", "2", "missing.py"], "program 'missing.py' not found"),
        (["-n", "2"], "no program given"),
        (["--timeout", "-1", "true"], "--timeout must be a positive number"),
    ],
)
def test_bad_usage_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    proc = subprocess.run([MPXRUN, *args], capture_output=True, text=True, timeout=30, check=False)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_no_mpi_installed_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "executable", "/nonexistent/bin/python")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.delenv("MPX_LAUNCHER", raising=False)
    if shutil.which("mpiexec") or shutil.which("mpirun"):
        pytest.skip("a system-wide MPI is installed")
    assert cli.main(["-n", "2", "true"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mpxrun: no MPI launcher found")
    assert "pip install mpi4py mpich" in err
    assert len(err.splitlines()) == 1


def test_a_nested_job_replaces_the_outer_jobs_torchrun_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """mpxrun inside an mpxrun rank: RANK & co. are the outer rank's, not the user's."""
    from mpx.launch.cli import _job_environment
    from mpx.launch.launchers import find_launcher

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "7")  # set by the user: not in MPX_TORCH_ENV
    monkeypatch.setenv("MPX_TORCH_ENV", "RANK,WORLD_SIZE")
    env = _job_environment(find_launcher(), 3, None, "none")
    assert "RANK" not in env
    assert "WORLD_SIZE" not in env
    assert "MPX_TORCH_ENV" not in env
    assert env["LOCAL_RANK"] == "7"
