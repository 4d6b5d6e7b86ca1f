"""An unmodified torchrun-style DDP script runs under mpxrun on mpx (and cgx) as on gloo."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MPXRUN = shutil.which("mpxrun", path=os.path.dirname(sys.executable)) or "mpxrun"
SCRIPT = ROOT / "examples" / "ddp_torchrun.py"


RunJob = Callable[..., "subprocess.CompletedProcess[str]"]


def _run(run_job: RunJob, backend: str, env: dict[str, str]) -> list[str]:
    script = [str(SCRIPT), "--backend", backend]
    done = run_job(2, script, env, 300, gloo_control=backend == "gloo")
    return [line for line in done.stdout.splitlines() if line.startswith("step ")]


@pytest.mark.timeout(600)
def test_torchrun_script_on_mpx_equals_gloo(
    fresh_job_environment: Callable[..., dict[str, str]], run_job: RunJob
) -> None:
    on_mpx = _run(run_job, "mpx", fresh_job_environment())
    assert len(on_mpx) == 5
    assert on_mpx == _run(run_job, "gloo", fresh_job_environment())


@pytest.mark.timeout(600)
def test_torchrun_script_on_cgx(
    fresh_job_environment: Callable[..., dict[str, str]], run_job: RunJob
) -> None:
    """``init_process_group("cgx")``: exact at CGX's 32 bits, quantized at 4."""
    on_gloo = _run(run_job, "gloo", fresh_job_environment())
    exact = fresh_job_environment(CGX_COMPRESSION_QUANTIZATION_BITS="32")
    assert _run(run_job, "cgx", exact) == on_gloo
    at_4_bits = _run(run_job, "cgx", fresh_job_environment(CGX_COMPRESSION_QUANTIZATION_BITS="4"))
    assert len(at_4_bits) == 5
    assert at_4_bits != on_gloo


# Rank 0 hosts the env:// rendezvous (TCPStore) on MASTER_PORT and dies with
# its connections open; the restarted job's rank 0 listens on the same port.
RESTARTED_SCRIPT = """
import os, signal
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
rank, attempt = dist.get_rank(), os.environ["TORCHELASTIC_RESTART_COUNT"]
t = torch.ones(4)
dist.all_reduce(t)
line = f"rank {rank} attempt {attempt} port {os.environ['MASTER_PORT']} sum {t[0]:.0f}\\n"
os.write(1, line.encode())
if attempt == "0" and rank == 0:
    os.kill(os.getpid(), signal.SIGKILL)
dist.barrier()
dist.destroy_process_group()
# Skips the C++ static destructors, where torch 2.13's gloo sometimes aborts a
# finished process ("terminate called without an active exception", see
# conftest.GLOO_EXIT_ABORT): that abort would count as a second failure here.
os._exit(0)
"""


@pytest.mark.timeout(600)
@pytest.mark.parametrize("nprocs", [2, pytest.param(3, marks=pytest.mark.extended)])
def test_an_env_rendezvous_survives_a_restart_on_the_same_port(
    tmp_path: Path, nprocs: int, fresh_job_environment: Callable[..., dict[str, str]]
) -> None:
    script = tmp_path / "restarted.py"
    script.write_text(RESTARTED_SCRIPT)
    env = fresh_job_environment()
    done = subprocess.run(
        [MPXRUN, "-n", str(nprocs), "--timeout", "240", "--max-restarts", "1", str(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=540,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 0 was killed by SIGKILL" in done.stderr
    lines = [line.split() for line in done.stdout.splitlines() if line.startswith("rank ")]
    finished = sorted(int(w[1]) for w in lines if w[3] == "1")
    assert finished == list(range(nprocs)), done.stdout
    assert all(w[7] == str(nprocs) for w in lines), done.stdout  # every allreduce summed all
    assert len({w[5] for w in lines}) == 1, done.stdout  # one MASTER_PORT for both attempts
