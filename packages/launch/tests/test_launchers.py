"""Launcher detection and each launcher's dialect."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from mpx.launch import Launcher, LauncherNotFound, UsageError, find_launcher


def test_finds_the_mpich_wheels_mpiexec() -> None:
    launcher = find_launcher()
    assert launcher.kind in ("mpich", "openmpi")
    assert launcher.path.endswith(("mpiexec", "mpirun"))


def test_no_launcher_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", "/nonexistent/bin/python")
    with pytest.raises(LauncherNotFound, match="pip install mpi4py mpich"):
        find_launcher(env={"PATH": "/nonexistent"})


def test_a_path_that_is_no_mpi_launcher_is_refused() -> None:
    with pytest.raises(LauncherNotFound, match="'/bin/true'"):
        find_launcher("/bin/true")


def test_mpich_command() -> None:
    cmd = Launcher("mpich", "mpiexec").command(
        3, ["prog", "-x"], hostfile="hosts", bind="core", tag_output=True, export=["A"]
    )
    assert cmd == [
        "mpiexec",
        "-n",
        "3",
        "-f",
        "hosts",
        "-bind-to",
        "core",  # no -prepend-rank: the rank supervisors tag whole lines (MPX_TAG_OUTPUT)
        "prog",
        "-x",
    ]


def test_open_mpi_command_exports_variables() -> None:
    cmd = Launcher("openmpi", "mpirun").command(2, ["prog"], export=["MPX_JOB_ID", "OMP_X"])
    assert cmd == [
        "mpirun",
        "-n",
        "2",
        "--bind-to",
        "none",
        "-x",
        "MPX_JOB_ID",
        "-x",
        "OMP_X",
        "prog",
    ]


def test_slurm_command_and_hostfile_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_MPI_TYPE", "pmix")  # the user's choice: no --mpi added
    srun = Launcher("slurm", "srun")
    assert srun.command(4, ["prog"], bind="numa", tag_output=True) == [
        "srun",
        "-n",
        "4",
        "--cpu-bind=ldoms",
        "--kill-on-bad-exit=1",
        "--label",
        "prog",
    ]
    with pytest.raises(UsageError, match="--hostfile cannot be used with srun"):
        srun.command(4, ["prog"], hostfile="hosts")


def test_bad_bind_is_named() -> None:
    with pytest.raises(UsageError, match="'socket'"):
        Launcher("mpich", "mpiexec").command(2, ["prog"], bind="socket")


def test_oversubscription_makes_mpich_yield_and_open_mpi_accept() -> None:
    mpich = Launcher("mpich", "mpiexec").environment(8, oversubscribed=True)
    assert mpich["MPIR_CVAR_CH4_PROGRESS_THROTTLE"] == "true"
    assert mpich["HYDRA_LAUNCHER"] == "fork"
    assert "MPIR_CVAR_POLLS_BEFORE_YIELD" not in Launcher("mpich", "mpiexec").environment(
        2, oversubscribed=False
    )
    ompi = Launcher("openmpi", "mpirun").environment(8, oversubscribed=True)
    assert ompi["PRTE_MCA_rmaps_default_mapping_policy"] == ":oversubscribe"


def _fake_scontrol(tmp_path: Path, mpi_default: str) -> str:
    tool = tmp_path / "scontrol"
    tool.write_text(f"#!/bin/sh\necho 'MpiDefault              = {mpi_default}'\n")
    tool.chmod(0o755)
    return f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}"


@pytest.mark.parametrize(
    ("mpi_default", "user_type", "added"),
    [("none", None, True), ("pmi2", None, False), ("pmix", None, False), ("none", "pmix", False)],
)
def test_srun_gets_pmi2_only_where_the_cluster_gives_no_pmi(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    mpi_default: str,
    user_type: str | None,
    added: bool,
) -> None:
    """A cluster whose MpiDefault is none started each rank as an MPI world of its own."""
    monkeypatch.setenv("PATH", _fake_scontrol(tmp_path, mpi_default))
    if user_type is None:
        monkeypatch.delenv("SLURM_MPI_TYPE", raising=False)
    else:
        monkeypatch.setenv("SLURM_MPI_TYPE", user_type)
    cmd = Launcher("slurm", "srun").command(2, ["prog"])
    assert ("--mpi=pmi2" in cmd) == added, cmd
    assert not any(part.startswith("--cpu-bind") for part in cmd)  # bind="none": no flag
