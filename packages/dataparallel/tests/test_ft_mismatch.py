"""Replica groups that cannot average together fail at once, saying why: a group whose
model (its gradients' size or dtype) or ``compression=`` differs from another's is
refused by the lighthouse, every rank of it raises, and ``mpxrun`` fails the job
instead of discarding every step for ever."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from mpx.dataparallel import DataParallelError
from mpx.dataparallel.errors import DataParallelMismatchError
from mpx.dataparallel.recovery.lighthouse_client import LighthouseClient, describe_gradients
from mpx.launch.recovery import Lighthouse
from mpx.quantize import CompressionConfig


def test_a_refused_rank_raises_naming_both_groups_values_and_the_fix() -> None:
    with Lighthouse(expected=2, heartbeat_timeout=60.0) as lh:
        plain = describe_gradients(10, torch.float32, None)
        first = LighthouseClient(lh.address, 0, 0, 1, "a", ("127.0.0.1", 1), lh.key, plain)
        try:
            four_bits = describe_gradients(10, torch.float32, CompressionConfig(bits=4))
            with pytest.raises(DataParallelMismatchError) as refused:
                LighthouseClient(lh.address, 1, 0, 1, "b", ("127.0.0.1", 2), lh.key, four_bits)
        finally:
            first.close()
    assert isinstance(refused.value, DataParallelError)
    message = str(refused.value)
    assert "group 1 rank 0 averages 10 trainable elements of dtype torch.float32, " in message
    assert "compression=CompressionConfig(bits=4, bucket_size=512, stochastic=True)" in message
    assert "group 0 rank 0 averages 10 trainable elements of dtype torch.float32, " in message
    assert "compression=None" in message
    assert "Every group must build the same model and pass the same compression=" in message


PROGRAM = textwrap.dedent(
    """
    import os, sys
    import torch
    from torch import nn
    import mpx.dataparallel as dp
    from mpi4py import MPI

    group, rank = int(os.environ["MPX_REPLICA_GROUP"]), MPI.COMM_WORLD.Get_rank()
    differs = sys.argv[1]
    # Group 1 differs: a wider model on every rank, or compression on its rank 1 only
    # (every rank of the refused group must still raise).
    model = nn.Linear(4, 3 if differs == "model" and group == 1 else 2)
    compression = None
    if differs == "compression" and group == 1 and rank == 1:
        from mpx.quantize import CompressionConfig
        compression = CompressionConfig(bits=4)
    try:
        ft = dp.FaultTolerantOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model, compression=compression
        )
    except dp.DataParallelError as error:
        print(f"group {group} rank {rank} raised {type(error).__name__}", file=sys.stderr,
              flush=True)
        raise
    for _ in range(3):
        ft.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        ft.step()
    ft.close()
    """
)


@pytest.mark.parametrize(("differs", "nprocs"), [("model", 1), ("compression", 2)])
def test_groups_that_cannot_average_together_fail_the_job_at_once(
    tmp_path: Path, differs: str, nprocs: int
) -> None:
    """Before the lighthouse checked, such a job discarded every step for ever over TCP
    (a frame of another length is a lost peer), or mixed compressions in shared memory."""
    script = tmp_path / "job.py"
    script.write_text(PROGRAM)
    mpxrun = Path(sys.executable).parent / "mpxrun"
    start = time.monotonic()
    done = subprocess.run(
        [str(mpxrun), "--replica-groups", "2", "-n", str(nprocs), "--max-restarts", "2",
         "--timeout", "60", "--", sys.executable, str(script), differs],
        capture_output=True, text=True, timeout=90, check=False,
        env={**os.environ, "MPX_FT_HEARTBEAT_TIMEOUT": "20"},
    )  # fmt: skip
    took = time.monotonic() - start
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert took < 50, (took, out)  # --timeout 60 would say a hang
    assert "ran past --timeout" not in out, out
    assert "Restart 1 of" not in out, out  # a permanent failure: no restart
    assert "no group is restarted and the others are stopped" in out, out
    assert "Every group must build the same model and pass the same compression=" in out, out
    if differs == "model":
        assert "averages 15 trainable elements" in out, out
        assert "averages 10 trainable elements" in out, out
    else:
        assert "bits=4, bucket_size=512, stochastic=True" in out
        assert "compression=None" in out
    # Every rank of the refused group raised (which group is refused is whichever said
    # hello second at a rank index; here group 1 unless group 0 was slower to start).
    refused = set(re.findall(r"group (\d) rank (\d) raised DataParallelMismatchError", out))
    groups = {g for g, _ in refused}
    assert len(groups) == 1, out
    assert refused == {(g, str(r)) for g in groups for r in range(nprocs)}, out
