"""A rank that raises during backward ends the whole job quickly (no hang)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

JOB = textwrap.dedent(
    """
    import torch
    from torch import nn
    import mpx.dataparallel as dp

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            if dp.rank() == 1:
                raise RuntimeError("injected failure in backward on rank 1")
            return g

    dp.init()
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    for step in range(3):
        opt.zero_grad()
        x = torch.randn(4, 8)
        model[1](Boom.apply(model[0](x))).sum().backward()
        opt.step()   # rank 0 waits here for rank 1's buckets
    print("finished", flush=True)
    """
)


def test_rank_failing_in_backward_stops_every_rank(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    mpxrun = Path(sys.executable).parent / "mpxrun"
    if not mpxrun.exists():
        pytest.fail(f"mpxrun not found next to {sys.executable}; pip install packages/launch")
    start = time.monotonic()
    done = subprocess.run(
        [str(mpxrun), "-n", "2", "--timeout", "120", "--", sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    elapsed = time.monotonic() - start
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "injected failure in backward on rank 1" in output
    assert "finished" not in output
    assert elapsed < 60, f"took {elapsed:.1f} s to stop"
