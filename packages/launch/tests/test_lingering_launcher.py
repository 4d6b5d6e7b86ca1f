"""A launcher that lingers after its ranks have all exited 0 does not hold up the job.

MPICH's gforker busy-waits 2 s after its last rank more often than not; mpxrun
stops it once every rank's supervisor has reported a clean exit.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from mpx.launch import cli
from mpx.launch.rank import new_key


def _lingering_launcher(nprocs: int, code: int) -> list[str]:
    # Starts the supervisors as a launcher would, then stays around.
    starts = " ".join(
        f"PMI_RANK={r} PMI_SIZE={nprocs} {sys.executable} -m mpx.launch.rank -- "
        f"{sys.executable} -c 'raise SystemExit({code})' &"
        for r in range(nprocs)
    )
    return ["sh", "-c", f"{starts} wait; exec sleep 60"]


@pytest.mark.parametrize("nprocs", [1, 3])
def test_the_job_ends_when_every_rank_has_exited_0(tmp_path: Path, nprocs: int) -> None:
    key = new_key()
    env = dict(os.environ, MPX_STATUS_KEY=key)
    with (tmp_path / "stderr").open("wb") as sink:
        job = cli.Job(
            _lingering_launcher(nprocs, 0),
            env=env,
            stderr=sink,
            status_key=key,
            nprocs=nprocs,
            end_when_ranks_exit=True,
        )
        assert job.run(timeout=30) == 0
    assert not job.timed_out
    assert job.exited == dict.fromkeys(range(nprocs), 0)


def test_a_failed_rank_still_ends_the_job_with_its_code(tmp_path: Path) -> None:
    key = new_key()
    with (tmp_path / "stderr").open("wb") as sink:
        job = cli.Job(
            _lingering_launcher(2, 3),
            env=dict(os.environ, MPX_STATUS_KEY=key),
            stderr=sink,
            status_key=key,
            nprocs=2,
            end_when_ranks_exit=True,
        )
        job.run(timeout=30)
    assert not job.timed_out
    assert {f.code for f in job.failures} == {3}
