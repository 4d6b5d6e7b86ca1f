"""mpxrun's argument checks: each error names its own flag and value, and nothing starts."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from mpx.launch.cli import _job_environment
from mpx.launch.command.arguments import (
    MAX_RANKS_PER_CORE,
    Cores,
    check_rank_count,
    job_cores,
    read_hostfile,
)
from mpx.launch.errors import UsageError
from mpx.launch.launchers import Launcher

MPXRUN = shutil.which("mpxrun", path=os.path.dirname(sys.executable)) or "mpxrun"

# Each rank leaves a file behind: none may exist after a refused command.
PROGRAM = "import os, sys\nopen(os.path.join(sys.argv[1], f'ran.{os.getpid()}'), 'w').close()\n"


def _on_cores(count: int) -> Callable[[], None]:
    cores = set(sorted(os.sched_getaffinity(0))[:count])

    def pin() -> None:
        os.sched_setaffinity(0, cores)

    return pin


def _mpxrun(
    tmp_path: Path, *args: str, cores: int | None = None
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    return subprocess.run(
        [MPXRUN, *args, "--", sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        # The cores mpxrun may use decide its limit: pinned, the refusal is
        # tested with a modest -n whatever the machine.
        preexec_fn=None if cores is None else _on_cores(cores),
    )


def _ran(tmp_path: Path) -> list[Path]:
    return sorted(tmp_path.glob("ran.*"))


def test_far_too_many_ranks_a_core_are_refused_and_nothing_starts(tmp_path: Path) -> None:
    nprocs = MAX_RANKS_PER_CORE + 1  # on one core
    proc = _mpxrun(tmp_path, "-n", str(nprocs), "--timeout", "120", cores=1)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"mpxrun: -n {nprocs} is {nprocs} ranks a core on the 1 core")
    assert "--oversubscribe" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert _ran(tmp_path) == []


def test_oversubscribe_starts_them_anyway(tmp_path: Path) -> None:
    nprocs = MAX_RANKS_PER_CORE + 1
    proc = _mpxrun(tmp_path, "-n", str(nprocs), "--oversubscribe", "--timeout", "300", cores=1)
    assert proc.returncode == 0, proc.stderr
    assert len(_ran(tmp_path)) == nprocs


@pytest.mark.parametrize(
    ("nprocs", "cores", "oversubscribe", "refused"),
    [
        (3, 2, False, False),  # as the tests run on a 2-core machine: 1.5 a core
        (1, 1, False, False),
        (2 * MAX_RANKS_PER_CORE, 2, False, False),
        (2 * MAX_RANKS_PER_CORE + 1, 2, False, True),
        (100000, 2, False, True),
        (100000, 2, True, False),
        (100000, None, False, False),  # cores unknown: not checked
    ],
)
def test_the_rank_count_check_refuses_more_than_8_a_core_without_oversubscribe(
    nprocs: int, cores: int | None, oversubscribe: bool, refused: bool
) -> None:
    counted = Cores(cores, f"the {cores} core(s) of the test")
    if refused:
        with pytest.raises(UsageError, match=f"^-n {nprocs} is .* --oversubscribe") as info:
            check_rank_count(nprocs, counted, oversubscribe=oversubscribe)
        assert f"the {cores} core(s) of the test" in str(info.value)
    else:
        check_rank_count(nprocs, counted, oversubscribe=oversubscribe)


def test_the_rank_count_check_counts_every_replica_group() -> None:
    """``--replica-groups 24 -n 1`` starts 24 ranks: refused where ``-n 24`` is."""
    counted = Cores(2, "the 2 core(s) of the test")
    groups = 2 * MAX_RANKS_PER_CORE + 1
    check_rank_count(1, counted, oversubscribe=False, groups=2 * MAX_RANKS_PER_CORE)
    with pytest.raises(UsageError, match=f"^--replica-groups {groups} x -n 1 is .*") as info:
        check_rank_count(1, counted, oversubscribe=False, groups=groups)
    assert "smaller -n or --replica-groups, or --oversubscribe" in str(info.value)
    check_rank_count(1, counted, oversubscribe=True, groups=groups)
    with pytest.raises(UsageError, match="--replica-groups 3 x -n 6 is 9 ranks a core"):
        check_rank_count(6, counted, oversubscribe=False, groups=3)


def test_the_cores_counted_are_the_hosts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    here = len(os.sched_getaffinity(0))
    assert job_cores("mpich", None, None, {}).count == here
    assert job_cores("openmpi", None, None, {}).count == here
    assert job_cores("mpich", None, 2, {}).count == here  # virtual nodes share this host
    hosts = tmp_path / "hosts"
    hosts.write_text("# a cluster\nnode1:4\nnode2 slots=6 max_slots=8\n\nnode3:2  # small\n")
    assert read_hostfile(str(hosts)) == [("node1", 4), ("node2", 6), ("node3", 2)]
    assert job_cores("mpich", str(hosts), None, {}).count == 12
    hosts.write_text("node1:4\nnode2\n")
    unknown = job_cores("openmpi", str(hosts), None, {})
    assert unknown.count is None
    assert "node2" in unknown.source
    slurm = {"SLURM_JOB_CPUS_PER_NODE": "72(x2),36"}
    assert job_cores("slurm", None, None, slurm).count == 180
    assert job_cores("slurm", None, None, {}).count is None


def test_oversubscribe_lets_open_mpi_place_more_ranks_than_slots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("OMPI_MCA_rmaps_base_oversubscribe", "MPIR_CVAR_POLLS_BEFORE_YIELD"):
        monkeypatch.delenv(name, raising=False)
    hosts = tmp_path / "hosts"
    hosts.write_text("node1:2\nnode2:2\n")
    ompi, mpich = Launcher("openmpi", "mpirun"), Launcher("mpich", "mpiexec")
    # Across hosts mpxrun cannot see their cores: only the flag says so.
    assert "OMPI_MCA_rmaps_base_oversubscribe" not in _job_environment(ompi, 8, str(hosts), "none")
    over = _job_environment(ompi, 8, str(hosts), "none", oversubscribe=True)
    assert over["OMPI_MCA_rmaps_base_oversubscribe"] == "1"
    over = _job_environment(mpich, 8, str(hosts), "none", oversubscribe=True)
    assert over["MPIR_CVAR_POLLS_BEFORE_YIELD"] == "1"


def test_under_srun_mpxrun_leaves_the_rendezvous_address_to_the_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """srun picks where rank 0 runs (mpxrun may be on a login node): no MPX_MASTER_ADDR
    (see test_rank's srun case), a port still; other launchers name the address."""
    monkeypatch.delenv("MPX_MASTER_ADDR", raising=False)
    env = _job_environment(Launcher("slurm", "srun"), 2, None, "none")
    assert "MPX_MASTER_ADDR" not in env
    assert env["MPX_MASTER_PORT"].isdigit()
    assert _job_environment(Launcher("mpich", "mpiexec"), 2, None, "none")["MPX_MASTER_ADDR"]


@pytest.mark.parametrize("nodes", ["0", "-1", "201", "two"])
def test_a_bad_virtual_node_count_names_virtual_nodes(tmp_path: Path, nodes: str) -> None:
    proc = _mpxrun(tmp_path, "--virtual-nodes", nodes, "-n", "2", "--timeout", "60")
    assert proc.returncode == 2, proc.stderr
    assert f"--virtual-nodes must be a whole number from 1 to 200, got {nodes!r}" in proc.stderr
    assert "-n must" not in proc.stderr
    assert _ran(tmp_path) == []


def test_more_virtual_nodes_than_ranks_is_refused_and_nothing_starts(tmp_path: Path) -> None:
    proc = _mpxrun(tmp_path, "--virtual-nodes", "5", "-n", "2", "--timeout", "60")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(
        "mpxrun: --virtual-nodes 5 is more nodes than the 2 rank(s) of -n 2"
    )
    assert "pass --virtual-nodes 2 or fewer, or -n 5 or more" in proc.stderr
    assert _ran(tmp_path) == []


def test_a_restart_delay_without_restarts_is_refused_and_nothing_starts(tmp_path: Path) -> None:
    """It was ignored: the user believed restarts were on."""
    proc = _mpxrun(tmp_path, "-n", "1", "--restart-delay", "5", "--timeout", "60")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(
        "mpxrun: --restart-delay 5 waits before a restart, but --max-restarts is 0"
    ), proc.stderr
    assert "add --max-restarts N (N >= 1) or drop --restart-delay" in proc.stderr
    assert _ran(tmp_path) == []
    proc = _mpxrun(tmp_path, "-n", "1", "--restart-delay", "5", "--max-restarts", "1")
    assert proc.returncode == 0, proc.stderr
    assert len(_ran(tmp_path)) == 1


def test_every_numeric_or_enumerated_flag_names_itself_in_its_error(tmp_path: Path) -> None:
    # One test over every such flag of mpxrun's parser: each error names its
    # own flag and the value given, says what is accepted, and comes before
    # anything starts.
    cases = [
        ("-n", "0", "-n must be a positive integer"),
        ("-n", "two", "-n must be a positive integer"),
        ("--virtual-nodes", "0", "--virtual-nodes must be a whole number from 1 to 200"),
        ("--timeout", "0", "--timeout must be a positive number of seconds (at most 1e9)"),
        # inf: a job that never times out, which leaving --timeout out gives.
        ("--timeout", "inf", "--timeout must be a positive number of seconds (at most 1e9)"),
        ("--timeout", "nan", "--timeout must be a positive number of seconds (at most 1e9)"),
        ("--max-restarts", "-1", "--max-restarts must be a whole number >= 0"),
        ("--max-restarts", "1.5", "--max-restarts must be a whole number >= 0"),
        ("--restart-delay", "-1", "--restart-delay must be a number of seconds >= 0"),
        # inf: time.sleep(inf) raised OverflowError at the first restart.
        ("--restart-delay", "inf", "--restart-delay must be a number of seconds >= 0"),
        ("--bind", "socket", "argument --bind: invalid choice"),
        ("--gpus", "all", "argument --gpus: invalid choice"),
    ]
    wrong = []
    for flag, value, says in cases:
        proc = _mpxrun(tmp_path, "-n", "2", "--max-restarts", "1", flag, value)
        if proc.returncode != 2 or says not in proc.stderr or repr(value) not in proc.stderr:
            wrong.append((flag, value, proc.returncode, proc.stderr.strip()))
    assert wrong == []
    assert _ran(tmp_path) == []
