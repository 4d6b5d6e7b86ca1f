"""End to end: rank 1 SIGKILLed mid-epoch under ``mpxrun --max-restarts 1`` resumes bitwise.

The job trains a float64 data-parallel model, checkpointing after every batch
with ``mpx.dataparallel.save_resumable``; on attempt 0 (``MPX_RESTART_COUNT``)
rank 1 kills itself at a chosen step. mpxrun restarts the job, which resumes
with ``mpx.dataparallel.resume``; its final parameters must equal those of a
run that was never interrupted, bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

MPXRUN = os.path.join(os.path.dirname(sys.executable), "mpxrun")
JOB_TIMEOUT_S = 240

# argv: checkpoint dir, output file, the global step at which rank 1 dies ("-1": never).
PROGRAM = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    from torch import nn
    import mpx.dataparallel as dp
    from mpx.launch.settings import RESTART_COUNT

    directory, out, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Tanh(), nn.Linear(8, 1)).double()
    dp.synchronize(model)
    opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model)
    x = torch.randn(36, 4, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    data = dp.DistributedDataContainer((x, x.sum(1, keepdim=True)), shuffle=True, seed=1)
    loader = torch.utils.data.DataLoader(data, batch_size=3)
    point = dp.resume(directory, model, opt, data=data)
    for epoch in range(point.epoch, 3):
        data.set_epoch(epoch)
        for i, (xb, yb) in point.batches(loader, epoch):
            step = epoch * len(loader) + i
            victim = dp.rank() == min(1, dp.world_size() - 1)
            if step == kill_at and RESTART_COUNT.get() == 0 and victim:
                os.kill(os.getpid(), signal.SIGKILL)
            opt.zero_grad()
            nn.functional.mse_loss(model(xb), yb).backward()
            opt.step()
            dp.save_resumable(directory, model, opt, epoch=epoch, batch=i + 1)
    if dp.rank() == 0:
        torch.save([p.detach() for p in model.parameters()], out)
    """
)


def _train(tmp_path: Path, name: str, nprocs: int, kill_at: int) -> torch.Tensor:
    script = tmp_path / "train.py"
    script.write_text(PROGRAM)
    out = tmp_path / f"{name}.pt"
    restarts = ["--max-restarts", "1"] if kill_at >= 0 else []
    proc = subprocess.run(
        [
            MPXRUN,
            "-n",
            str(nprocs),
            "--timeout",
            str(JOB_TIMEOUT_S),
            *restarts,
            str(script),
            str(tmp_path / name),
            str(out),
            str(kill_at),
        ],
        capture_output=True,
        text=True,
        timeout=2 * JOB_TIMEOUT_S + 60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    if kill_at >= 0:
        assert "was killed by SIGKILL" in proc.stderr, proc.stderr
        assert "Restart 1 of 1" in proc.stderr
    params: list[torch.Tensor] = torch.load(out, weights_only=True)
    return torch.cat([p.reshape(-1) for p in params])


@pytest.mark.timeout(4 * JOB_TIMEOUT_S)
@pytest.mark.parametrize("nprocs", [2, 3])
def test_a_rank_killed_mid_epoch_resumes_to_the_uninterrupted_result(
    tmp_path: Path, nprocs: int
) -> None:
    reference = _train(tmp_path, "straight", nprocs, kill_at=-1)
    # Step 7: in the middle of the first or second epoch for every rank count.
    restarted = _train(tmp_path, "restarted", nprocs, kill_at=7)
    assert torch.equal(restarted, reference)
