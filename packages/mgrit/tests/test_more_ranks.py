"""The fine split at 4 and 5 ranks, which CI's 1-3 rank runs of the mpi tests do not reach.

With blocks of a few steps, a rank's row 0 on a coarse level can be the last point of
a rank several blocks to the left, whose step is the first layer of the block after
that rank's: there the neighbours' carried layers (``mpx.mgrit.adjoint.halo``) are used, and
ranks outnumber the coarsest intervals. ParallelGRU's boundary steps (the edge rows one
layer shares with the next) change a result only from 5 ranks on. The selected mpi
tests run as one job of N ranks (``python -m pytest`` under mpxrun), size-agnostic as
always.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

HERE = Path(__file__).parent
SELECTION = [
    str(HERE / "test_layer_parallel.py"),
    str(HERE / "test_solver.py"),
    str(HERE / "test_model.py"),
    str(HERE / "test_gru_split.py"),
    "-k",
    "single_rank_network or any_split or boundary_steps or replay or more_ranks"
    " or on_all_ranks_equal_one_rank or beyond_the_coarsest",
]


@pytest.mark.parametrize("ranks", [4, 5])
def test_the_fine_split_at_more_ranks(
    ranks: int,
    run_job: Callable[..., subprocess.CompletedProcess[str]],
    fresh_job_environment: Callable[..., dict[str, str]],
) -> None:
    done = run_job(
        ranks,
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "mpi", *SELECTION],
        fresh_job_environment(),
        280,
    )
    assert " passed" in done.stdout, done.stdout[-2000:]
    assert "failed" not in done.stdout, done.stdout[-2000:]
