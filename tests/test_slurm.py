"""mpx under a real Slurm: srun, salloc, sbatch on a one-node cluster of Debian's daemons.

CI starts the cluster (``tools/slurm_cluster.sh start``: slurmctld, slurmd and
munge from Debian's packages, ``MpiDefault=none`` as many clusters ship it);
these tests find it through ``tools/slurm_cluster.sh status`` and are skipped,
with the reason, where it is not running. The flows an MPI user has:

* ``srun -n N --mpi=pmi2 python prog.py``: torch DDP on the mpx backend with
  nothing set by hand (no mpxrun, no RANK or MASTER_ADDR);
* ``mpxrun --launcher slurm`` (srun underneath, its own allocation) and
  ``salloc -n 2 mpxrun -n 2`` (mpxrun finds the allocation);
* an ``sbatch`` script running ``mpxrun --max-restarts 1`` whose rank 1 is
  SIGKILLed mid-run: the job resumes from its checkpoints to the parameters of
  an uninterrupted run, bit for bit;
* ``mpxrun --check`` inside an allocation names Slurm and passes;
* ``salloc -n 2 mpxrun --replica-groups 2 -n 1``: live recovery, each group an srun
  step, a group killed and restarted.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
CLUSTER = HERE.parent / "tools" / "slurm_cluster.sh"
BIN = os.path.dirname(sys.executable)
MPXRUN = os.path.join(BIN, "mpxrun")
JOB = HERE / "bare_launcher_job.py"
TIMEOUT_S = 300


def _sibling(name: str) -> object:
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_bare = _sibling("test_bare_launchers")
# The resumable training program of the mpxrun restart tests (one program, two launchers).
RESUMABLE: str = _sibling("test_elastic_restart").PROGRAM  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def slurm_env() -> dict[str, str]:
    """The environment of a job submitted to the running cluster (skips without one)."""
    status = subprocess.run(
        ["bash", str(CLUSTER), "status"], capture_output=True, text=True, timeout=260, check=False
    )
    conf = status.stdout.strip().removeprefix("SLURM_CONF=")
    if status.returncode != 0 or not conf:
        pytest.skip(
            "no Slurm cluster running here (start one as root: tools/slurm_cluster.sh start)"
        )
    env: dict[str, str] = _bare.bare_environment()  # type: ignore[attr-defined]
    env["SLURM_CONF"] = conf
    env["PATH"] = os.pathsep.join([BIN, env.get("PATH", "")])
    return env


def _run(cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )


@pytest.mark.parametrize("ranks", [2, 3])
def test_plain_srun_runs_ddp_on_mpx(slurm_env: dict[str, str], tmp_path: Path, ranks: int) -> None:
    """Before: ``environment variable RANK expected, but not set``."""
    out = tmp_path / "out.json"
    proc = _run(
        ["srun", "-n", str(ranks), "--mpi=pmi2", sys.executable, str(JOB), "mpx", str(out)],
        slurm_env,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    _bare.check_views(out, ranks, "mpx")  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "start",
    [
        pytest.param([MPXRUN, "--launcher", "slurm", "-n", "2"], id="mpxrun-launcher-slurm"),
        pytest.param(["salloc", "-n", "2", MPXRUN, "-n", "2"], id="salloc-then-mpxrun"),
    ],
)
def test_mpxrun_under_slurm(slurm_env: dict[str, str], tmp_path: Path, start: list[str]) -> None:
    """srun makes its own allocation, or mpxrun finds salloc's."""
    out = tmp_path / "out.json"
    proc = _run(
        [*start, "--timeout", "240", "--", sys.executable, str(JOB), "mpx", str(out)],
        slurm_env,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    _bare.check_views(out, 2, "mpx")  # type: ignore[attr-defined]


def test_mpxrun_check_names_slurm(slurm_env: dict[str, str], tmp_path: Path) -> None:
    """Before mpxrun passed --mpi=pmi2 where the cluster gives no PMI: 'the launcher says
    rank 1 of 2, MPI says 0 of 1'."""
    proc = _run(["salloc", "-n", "2", MPXRUN, "--check"], slurm_env, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "launcher       slurm (" in proc.stdout, proc.stdout
    assert "result: ok" in proc.stdout, proc.stdout


def test_sbatch_restart_resumes_to_the_uninterrupted_result(
    slurm_env: dict[str, str], tmp_path: Path
) -> None:
    (tmp_path / "train.py").write_text(RESUMABLE)
    results = {}
    for name, kill_at in (("straight", -1), ("killed", 7)):
        script = tmp_path / f"{name}.sbatch"
        script.write_text(
            textwrap.dedent(
                f"""\
                #!/bin/bash
                #SBATCH -n 2
                #SBATCH -o {tmp_path}/{name}.log
                {MPXRUN} -n 2 --max-restarts 1 --timeout 240 -- \\
                    {sys.executable} {tmp_path}/train.py {tmp_path}/{name} \\
                    {tmp_path}/{name}.pt {kill_at}
                """
            )
        )
        proc = _run(["sbatch", "--wait", str(script)], slurm_env, tmp_path)
        log = (tmp_path / f"{name}.log").read_text() if (tmp_path / f"{name}.log").exists() else ""
        assert proc.returncode == 0, proc.stdout + proc.stderr + log[-4000:]
        assert ("Restart 1 of 1" in log) == (kill_at >= 0), log[-4000:]
        params = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        results[name] = torch.cat([p.reshape(-1) for p in params])
    assert torch.equal(results["killed"], results["straight"])


def test_replica_groups_under_slurm_survive_a_kill(
    slurm_env: dict[str, str], tmp_path: Path
) -> None:
    """``salloc -n 2 mpxrun --replica-groups 2 -n 1``: each group an srun step of the
    allocation; group 1's rank is SIGKILLed in step 30, its step restarts and rejoins
    with the live state; both groups end with the same weights."""
    example = HERE.parent / "examples" / "live_recovery.py"
    env = dict(slurm_env, MPX_FT_HEARTBEAT_TIMEOUT="20")
    proc = _run(
        [
            *("salloc", "-n", "2", MPXRUN, "--replica-groups", "2", "-n", "1"),
            *("--max-restarts", "1", "--timeout", "240", "--", sys.executable, str(example)),
            *("--epochs", "2", "--fail-at", "30:1"),
        ],
        env,
        tmp_path,
    )
    out = proc.stdout[-3000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, out
    assert "group 1: --fail-at: SIGKILL in step 30" in proc.stdout, out
    assert "group 1: rejoined at step" in proc.stdout, out
    sums = re.findall(r"group (\d): done, 44 steps: .* weights sha256 ([0-9a-f]{16})", proc.stdout)
    assert sorted(g for g, _ in sums) == ["0", "1"], out
    assert sums[0][1] == sums[1][1], out
