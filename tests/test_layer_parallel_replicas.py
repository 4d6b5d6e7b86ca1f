"""Layer parallel x data parallel (mpx-mgrit with mpx-dataparallel): a 4-rank job.

tests/lp_dp_job.py trains R replicas of a P-rank LayerParallel for every R x P = 4
(4 x 1, 2 x 2, 1 x 4) with DistributedOptimizer, full precision and compressed, and
checks each against one process on the whole batch (see its docstring). The packages'
own multi-rank tests cannot: mpx-mgrit does not depend on mpx-dataparallel.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

JOB = Path(__file__).with_name("lp_dp_job.py")


def test_replicas_of_a_layer_parallel_network_train_as_one_process(
    fresh_job_environment: Callable[[], dict[str, str]],
    run_job: Callable[..., subprocess.CompletedProcess[str]],
) -> None:
    done = run_job(4, [str(JOB)], fresh_job_environment(), 240)
    lines = [line for line in done.stdout.splitlines() if line.startswith("replicas=")]
    assert [line.split(":")[0] for line in lines] == [
        "replicas=4 layer_size=1",
        "replicas=2 layer_size=2",
        "replicas=1 layer_size=4",
    ], done.stdout
