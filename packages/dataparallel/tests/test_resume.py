"""resume(): an interrupted-then-resumed run ends bitwise equal to an uninterrupted one."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

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


def _run(
    directory: Path,
    stop_at: tuple[int, int] | None,
    compression: Any = None,
    sharded: bool = False,
) -> torch.Tensor:
    """Trains from scratch or from the newest checkpoint; raises _Stop at (epoch, batch).

    ``sharded``: every rank trains its own model (as a pipeline stage holds its
    own layers), saved and resumed with ``sharded=True``.
    """
    torch.manual_seed(0)
    random.seed(1 + MPI.COMM_WORLD.rank)
    np.random.seed(2 + MPI.COMM_WORLD.rank)
    # mpx-quantize compresses float32 (and half) gradients; float64 travels exact.
    dtype = torch.float64 if compression is None else torch.float32
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Tanh(), nn.Linear(8, 1)).to(dtype)
    opt: torch.optim.Optimizer
    if sharded:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * MPI.COMM_WORLD.rank)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    else:
        dp.synchronize(model)
        inner = torch.optim.Adam(model.parameters(), lr=0.01)
        opt = dp.DistributedOptimizer(inner, model, compression=compression)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(44, 4, generator=g, dtype=torch.float64).to(dtype)
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
            dp.save_resumable(
                directory,
                model,
                opt,
                epoch=epoch,
                batch=i + 1,
                scheduler=scheduler,
                sharded=sharded,
            )
        scheduler.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_an_interrupted_run_resumed_mid_epoch_ends_bitwise_equal(tmp_path: Path) -> None:
    base = _shared_dir(tmp_path)
    reference = _run(base / "straight", stop_at=None)
    with pytest.raises(_Stop):
        _run(base / "interrupted", stop_at=(1, 2))
    resumed = _run(base / "interrupted", stop_at=None)
    assert torch.equal(resumed, reference)


def test_compressed_gradients_resume_with_the_same_stochastic_rounding(tmp_path: Path) -> None:
    from mpx.quantize import CompressionConfig

    # Stochastic 2-bit rounding of every weight matrix: a generator restarted
    # from its seed after the restart rounds differently from the straight run.
    config = CompressionConfig(bits=2, bucket_size=8, minimal_size=0)
    base = _shared_dir(tmp_path)
    reference = _run(base / "straight", stop_at=None, compression=config)
    with pytest.raises(_Stop):
        _run(base / "interrupted", stop_at=(1, 2), compression=config)
    resumed = _run(base / "interrupted", stop_at=None, compression=config)
    assert torch.equal(resumed, reference)


def test_sharded_checkpoints_give_every_rank_its_own_model_back(tmp_path: Path) -> None:
    base = _shared_dir(tmp_path)
    reference = _run(base / "straight", stop_at=None, sharded=True)
    with pytest.raises(_Stop):
        _run(base / "interrupted", stop_at=(1, 2), sharded=True)
    resumed = _run(base / "interrupted", stop_at=None, sharded=True)
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
