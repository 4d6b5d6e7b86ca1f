"""Real jobs under mpxrun: a failing rank ends the job fast; a crashed job resumes exactly."""

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


RESUME_JOB = textwrap.dedent(
    """
    import os, sys
    import torch
    from torch import nn
    import mpx.dataparallel as dp

    mode, ckpt, out = sys.argv[1], sys.argv[2], sys.argv[3]
    dp.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    opt = dp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), model)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(48, 4, generator=g, dtype=torch.float64)
    data = dp.DistributedDataContainer((x, x.sin().sum(1, keepdim=True)), shuffle=True)
    start = 0
    if mode == "resume":
        start = dp.load_checkpoint(ckpt, model, opt)["epoch"] + 1
    for epoch in range(start, 4):
        data.set_epoch(epoch)
        for i, (xb, yb) in enumerate(torch.utils.data.DataLoader(data, batch_size=4)):
            if mode == "crash" and epoch == 2 and i == 1:
                os._exit(17)  # killed mid-epoch, after a partial epoch of updates
            opt.zero_grad()
            nn.functional.mse_loss(model(xb), yb).backward()
            opt.step()
        if mode == "crash":
            dp.save_checkpoint(ckpt, model, opt, epoch=epoch)
    if dp.is_root():
        torch.save([p.detach() for p in model.parameters()], out)
    """
)


def _job(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    mpxrun = Path(sys.executable).parent / "mpxrun"
    command = [str(mpxrun), "-n", "2", "--timeout", "120", "--", sys.executable, str(script)]
    return subprocess.run(
        [*command, *args], capture_output=True, text=True, timeout=150, check=False
    )


def test_a_crashed_job_resumes_to_the_uninterrupted_result(tmp_path: Path) -> None:
    import torch

    script = tmp_path / "resume.py"
    script.write_text(RESUME_JOB)
    ckpt = str(tmp_path / "ckpt.pt")
    straight = _job(script, "straight", ckpt, str(tmp_path / "straight.pt"))
    assert straight.returncode == 0, straight.stderr
    crashed = _job(script, "crash", ckpt, str(tmp_path / "never.pt"))
    assert crashed.returncode != 0
    assert not (tmp_path / "never.pt").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if "ckpt" in p.name) == ["ckpt.pt"]
    resumed = _job(script, "resume", ckpt, str(tmp_path / "resumed.pt"))
    assert resumed.returncode == 0, resumed.stderr
    want = torch.load(tmp_path / "straight.pt")
    got = torch.load(tmp_path / "resumed.pt")
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
