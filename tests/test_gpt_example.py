"""The GPT example (examples/train_gpt.py) learns, as a user runs it under mpxrun.

A small configuration (2 blocks, width 64, 40 steps) on 4 ranks = 2 stages x
2 data-parallel replicas with the async schedule, and on 2 ranks (2 stages,
1f1b). The bounds come from the serial run (``python examples/train_gpt.py``
with the same flags, one process): after 40 steps its training loss was 2.53
and its validation loss 2.44 nats/char, from 4.56 for a uniform guess; the
bounds leave room for a different Python's standard library as the corpus and
for async's staleness (the 4-rank run measured 2.54 and 2.45).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_gpt.py"
MPXRUN = shutil.which("mpxrun", path=os.path.dirname(sys.executable)) or "mpxrun"
SMALL = ["--steps", "40", "--log-every", "10", "--width", "64", "--blocks", "2"]
SMALL += ["--context", "32", "--batch", "16", "--corpus-chars", "300000"]
FINAL = re.compile(r"final: train loss ([\d.]+), validation loss ([\d.]+)")
TRAIN_BOUND, VALIDATION_BOUND = 2.8, 2.7


@pytest.mark.parametrize(
    ("ranks", "layout", "schedule"),
    [
        (4, "2 stage(s) x 2 replica(s)", "async"),
        # Another rank count and schedule of the same job: nox -s tests-extended.
        pytest.param(2, "2 stage(s) x 1 replica(s)", "1f1b", marks=pytest.mark.extended),
    ],
    ids=["4-ranks-async", "2-ranks-1f1b"],
)
def test_gpt_learns_under_mpxrun(
    tmp_path: Path, user_environment: dict[str, str], ranks: int, layout: str, schedule: str
) -> None:
    proc = subprocess.run(
        [MPXRUN, "-n", str(ranks), "--timeout", "250", "--", sys.executable, str(EXAMPLE),
         *SMALL, "--schedule", schedule],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
        cwd=tmp_path,
        env=user_environment,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"{ranks} rank(s) = {layout}" in proc.stdout
    assert f", {schedule}," in proc.stdout
    # Progress lines from rank 0 only: one per 10 steps, not one per rank.
    assert len(re.findall(r"^step +\d+/40 +loss", proc.stdout, re.MULTILINE)) == 4
    found = FINAL.search(proc.stdout)
    assert found, proc.stdout[-2000:]
    train, validation = float(found[1]), float(found[2])
    assert train < TRAIN_BOUND, proc.stdout
    assert validation < VALIDATION_BOUND, proc.stdout
    assert (tmp_path / "gpt_loss.png").stat().st_size > 10_000
