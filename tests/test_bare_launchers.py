"""``init_process_group("mpx")`` under a plain ``mpiexec``: no mpxrun, nothing set by hand.

torch's default rendezvous (``env://``) reads RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT; a bare MPI launcher exports none of them. mpx-collectives fills
them in from the launcher's own variables and MPI (``mpx._collectives_autoload``,
``mpx.launch.init_torch_env_under_mpi``). Before, the job failed with
``environment variable RANK expected, but not set``. ``srun`` is in test_slurm.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

JOB = Path(__file__).with_name("bare_launcher_job.py")
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable))

# What mpxrun, torchrun or an outer test run may have exported: a bare launch has none.
_INHERITED = (
    *("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"),
    *("MASTER_ADDR", "MASTER_PORT"),
)


def bare_environment() -> dict[str, str]:
    """This process's environment less every launcher's variables."""
    drop = ("MPX_", "PMI_", "PMIX_", "OMPI_", "SLURM_", "HYDRA_", "MPI_LOCAL")
    return {k: v for k, v in os.environ.items() if k not in _INHERITED and not k.startswith(drop)}


def check_views(out: Path, ranks: int, backend: str) -> None:
    result = json.loads(out.read_text())
    assert [v["rank"] for v in result["views"]] == list(range(ranks))
    assert {v["size"] for v in result["views"]} == {ranks}
    assert {v["backend"] for v in result["views"]} == {backend}
    # The ranks torch saw are MPI's (the launcher's), exported for the program too.
    assert [v["RANK"] for v in result["views"]] == [str(r) for r in range(ranks)]


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec beside this Python (pip install mpich)")
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("backend", ["mpx", "gloo"])
def test_ddp_under_plain_mpiexec(tmp_path: Path, ranks: int, backend: str) -> None:
    assert MPIEXEC is not None
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [MPIEXEC, "-n", str(ranks), sys.executable, str(JOB), backend, str(out)],
        env=bare_environment(), capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    check_views(out, ranks, backend)


def test_a_plain_python_is_left_to_torch(tmp_path: Path) -> None:
    """No launcher: nothing is invented, torch's own error about RANK (as for gloo)."""
    proc = subprocess.run(
        [sys.executable, str(JOB), "mpx", str(tmp_path / "out.json")],
        env=bare_environment(), capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "RANK expected, but not set" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec beside this Python (pip install mpich)")
def test_cgx_scripts_find_their_rank_under_plain_mpiexec() -> None:
    """CGX's scripts read Open MPI's OMPI_COMM_WORLD_* ("Launch with mpirun" without
    them): ``import torch_cgx`` sets them from MPICH's variables (issue 59)."""
    assert MPIEXEC is not None
    script = (
        "import os, sys, torch_cgx\n"
        "names = ('RANK', 'SIZE', 'LOCAL_RANK', 'LOCAL_SIZE')\n"
        # One write() for the line: under PYTHONUNBUFFERED print() writes each part apart,
        # and the two ranks' parts may interleave in mpiexec's output.
        "line = ' '.join(os.environ['OMPI_COMM_WORLD_' + n] for n in names)\n"
        "sys.stdout.write(line + '\\n'); sys.stdout.flush()\n"
    )
    proc = subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, "-c", script],
        env=bare_environment(), capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert sorted(proc.stdout.splitlines()) == ["0 2 0 2", "1 2 1 2"]
