"""resume(): an interrupted-then-resumed run ends bitwise equal to an uninterrupted one."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from mpi4py import MPI
from torch import nn

import mpx.dataparallel as dp

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]

EPOCHS = 3
BATCH = 4


class _Stop(Exception):
    """Stands for a crash: the loop ends without any further save."""


def _shared_dir(tmp_path: Path) -> Path:
    """Root's tmp_path, the same directory on every rank (one machine)."""
    return Path(MPI.COMM_WORLD.bcast(str(tmp_path), root=0))


def _run(directory: Path, stop_at: tuple[int, int] | None) -> torch.Tensor:
    """Trains from scratch or from the newest checkpoint; raises _Stop at (epoch, batch)."""
    torch.manual_seed(0)
    random.seed(1 + MPI.COMM_WORLD.rank)
    np.random.seed(2 + MPI.COMM_WORLD.rank)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Tanh(), nn.Linear(8, 1)).double()
    dp.synchronize(model)
    opt = dp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), model)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(44, 4, generator=g, dtype=torch.float64)
    data = dp.DistributedDataContainer((x, x.sum(1, keepdim=True) ** 2), shuffle=True, seed=3)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH)
    point = dp.resume(directory, model, opt, scheduler, data)
    for epoch in range(point.epoch, EPOCHS):
        data.set_epoch(epoch)
        for i, (xb, yb) in point.batches(loader, epoch):
            if (epoch, i) == stop_at:
                raise _Stop
            opt.zero_grad()
            # Every RNG the loop draws from feeds the loss, so a wrong restore shows.
            noise = torch.randn(()) + float(np.random.rand()) + random.random()
            loss = nn.functional.mse_loss(model(xb), yb) * (1 + 1e-3 * noise)
            loss.backward()
            opt.step()
            dp.save_resumable(directory, model, opt, epoch=epoch, batch=i + 1, scheduler=scheduler)
        scheduler.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_an_interrupted_run_resumed_mid_epoch_ends_bitwise_equal(tmp_path: Path) -> None:
    base = _shared_dir(tmp_path)
    reference = _run(base / "straight", stop_at=None)
    with pytest.raises(_Stop):
        _run(base / "interrupted", stop_at=(1, 2))
    resumed = _run(base / "interrupted", stop_at=None)
    assert torch.equal(resumed, reference)


def test_a_damaged_newest_checkpoint_is_skipped_for_the_previous(tmp_path: Path) -> None:
    base = _shared_dir(tmp_path)
    reference = _run(base / "straight", stop_at=None)
    directory = base / "interrupted"
    with pytest.raises(_Stop):
        _run(directory, stop_at=(1, 2))
    newest = dp.latest_checkpoint(directory)
    assert newest is not None
    assert newest.name == "ckpt-e000001-b000000002.pt"
    MPI.COMM_WORLD.Barrier()
    if MPI.COMM_WORLD.rank == 0:
        # A copy cut short: the checksum no longer holds.
        newest.write_bytes(newest.read_bytes()[:-100])
    MPI.COMM_WORLD.Barrier()
    previous = dp.latest_checkpoint(directory)
    assert previous is not None
    assert previous.name == "ckpt-e000001-b000000001.pt"
    resumed = _run(directory, stop_at=None)
    assert torch.equal(resumed, reference)


def test_without_a_checkpoint_resume_starts_at_the_beginning(tmp_path: Path) -> None:
    directory = _shared_dir(tmp_path) / "empty"
    model = nn.Linear(2, 1).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    point = dp.resume(directory, model, opt)
    assert (point.epoch, point.batch, point.path) == (0, 0, None)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
