"""An uncaught exception prints its traceback, tagged with the rank, on any backend (issue 31).

torch's ``init_process_group`` wraps ``sys.excepthook`` to prefix the
traceback with ``[rank1]: ``, printing what the hook below it wrote to a
buffer once that hook returns. mpx-launch's hook, below it, left the process
at once when MPI was live (the ``mpx`` backend): the traceback stayed in the
buffer, and all a user saw was ``mpxrun: rank 1 exited with code 1``. Under
plain ``mpiexec`` the job also hung in ``MPI_Finalize``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mpx.launch import free_port

BIN = os.path.dirname(sys.executable)
MPXRUN = os.path.join(BIN, "mpxrun")
MPIEXEC = os.path.join(BIN, "mpiexec")
JOB_TIMEOUT_S = 120

PROGRAM = textwrap.dedent(
    """
    import sys
    from mpx.launch import init_torch_env

    backend = sys.argv[1]
    env = init_torch_env()
    if backend == "mpi":
        from mpi4py import MPI  # MPI live, no torch
    elif backend != "none":
        import torch.distributed as dist
        if backend == "mpx":
            import mpx.collectives  # registers the backend
        dist.init_process_group(backend)


    def the_users_own_bug():
        raise ValueError(f"a distinctive bug on rank {env.rank}")


    if env.rank == env.world_size - 1:
        the_users_own_bug()
    if backend == "mpi":
        MPI.COMM_WORLD.Barrier()
    elif backend != "none":
        dist.barrier()
    """
)


def _needs(backend: str) -> None:
    if backend in ("gloo", "mpx") and importlib.util.find_spec("torch") is None:
        pytest.skip("needs torch")
    if backend == "mpx" and importlib.util.find_spec("mpx.collectives") is None:
        pytest.skip("needs mpx-collectives")


def _check_traceback(stderr: str, rank: int) -> None:
    tag = f"[rank{rank}]: "
    assert f"{tag}Traceback (most recent call last):" in stderr, stderr
    assert f"{tag}  File " in stderr
    assert f", in the_users_own_bug\n{tag}    raise ValueError" in stderr
    assert f"{tag}ValueError: a distinctive bug on rank {rank}\n" in stderr


@pytest.mark.parametrize(
    ("backend", "nprocs"),
    [
        ("none", 1),
        ("none", 2),
        ("none", 3),
        ("mpi", 2),
        ("gloo", 2),  # the control: torch's own prefix, as before
        ("mpx", 2),
        pytest.param("mpx", 3, marks=pytest.mark.extended),
    ],
)
def test_mpxrun_prints_the_traceback_with_the_rank(
    tmp_path: Path, backend: str, nprocs: int
) -> None:
    _needs(backend)
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    proc = subprocess.run(
        [MPXRUN, "-n", str(nprocs), "--timeout", str(JOB_TIMEOUT_S), str(script), backend],
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S + 60,
        check=False,
    )
    last = nprocs - 1
    assert proc.returncode == 1, proc.stderr
    # Printed once, as it happened; mpxrun's summary names the rank and points at it.
    _check_traceback(proc.stderr, last)
    assert proc.stderr.count(f"[rank{last}]: Traceback (most recent call last):") == 1
    # Its last line twice: in the traceback, and quoted by the summary.
    assert proc.stderr.count(f"ValueError: a distinctive bug on rank {last}") == 2, proc.stderr
    assert f"mpxrun: rank {last} exited with code 1; all ranks were stopped." in proc.stderr
    assert (
        f"mpxrun: rank {last}'s error is printed above; it ends: "
        f"[rank{last}]: ValueError: a distinctive bug on rank {last}"
    ) in proc.stderr, proc.stderr


@pytest.mark.parametrize("backend", ["none", "mpi", "mpx"])
def test_plain_mpiexec_prints_the_traceback_and_ends(tmp_path: Path, backend: str) -> None:
    _needs(backend)
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    # Not a job of an enclosing mpxrun or mpiexec (a test run under one).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MPX_", "PMI_"))}
    # What mpxrun would export; plain mpiexec leaves torch's rendezvous to the user.
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port("127.0.0.1")))
    env.update(HYDRA_LAUNCHER="fork", FI_PROVIDER="tcp", UCX_NET_DEVICES="lo")
    proc = subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, str(script), backend],
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
        check=False,
        env=env,
    )
    assert proc.returncode != 0, proc.stderr
    _check_traceback(proc.stderr, 1)
