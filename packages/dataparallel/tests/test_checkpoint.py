"""Checkpoints: a round trip restores every rank bit-identically; resuming == not stopping."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from mpi4py import MPI
from torch import nn

import mpx.dataparallel as dp
from mpx.dataparallel.errors import DataParallelError

pytestmark = pytest.mark.mpi


def _shared_dir(tmp_path: Path) -> Path:
    """Root's tmp_path, the same directory on every rank (one machine)."""
    return Path(MPI.COMM_WORLD.bcast(str(tmp_path), root=0))


def _setup(seed: int) -> tuple[nn.Module, dp.DistributedOptimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1)).double()
    dp.synchronize(model)
    opt = dp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), model)
    return model, opt


def _data() -> dp.DistributedDataContainer:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(60, 4, generator=g, dtype=torch.float64)
    return dp.DistributedDataContainer((x, x.sum(1, keepdim=True) ** 2), shuffle=True, seed=3)


def _epoch(
    model: nn.Module, opt: dp.DistributedOptimizer, data: dp.DistributedDataContainer, epoch: int
) -> None:
    data.set_epoch(epoch)
    loader = torch.utils.data.DataLoader(data, batch_size=5)
    for x, y in loader:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([v.detach().reshape(-1).double() for v in model.state_dict().values()])


def test_resume_after_a_crash_reproduces_the_uninterrupted_run(tmp_path: Path) -> None:
    path = _shared_dir(tmp_path) / "ckpt.pt"
    data = _data()
    model, opt = _setup(seed=0)
    for epoch in range(4):
        _epoch(model, opt, data, epoch)
    uninterrupted, uninterrupted_params = _flat(model), _params(model)

    model, opt = _setup(seed=0)
    for epoch in range(2):
        _epoch(model, opt, data, epoch)
    dp.save_checkpoint(path, model, opt, epoch=1, note="half way")
    del model, opt  # the crash: everything in memory is lost
    model, opt = _setup(seed=123)  # a fresh start, different weights
    extra = dp.load_checkpoint(path, model, opt)
    assert extra == {"epoch": 1, "note": "half way"}
    for epoch in range(extra["epoch"] + 1, 4):
        _epoch(model, opt, data, epoch)
    # Parameters (and Adam's state behind them) match on every rank; buffers
    # (BatchNorm statistics) are each rank's own, so the checkpoint holds
    # root's, and the full state matches on root.
    assert torch.equal(_params(model), uninterrupted_params)
    if dp.is_root():
        assert torch.equal(_flat(model), uninterrupted)


def test_round_trip_is_identical_on_every_rank(tmp_path: Path) -> None:
    path = _shared_dir(tmp_path) / "round.pt"
    model, opt = _setup(seed=0)
    _epoch(model, opt, _data(), 0)
    saved = MPI.COMM_WORLD.bcast(_flat(model), root=0)  # buffers are per rank: root's
    saved_state = {k: v.clone() for k, v in opt.state[next(model.parameters())].items()}
    dp.save_checkpoint(path, model, opt, step=torch.tensor(5))
    assert sorted(os.listdir(path.parent)) == ["round.pt"]  # no temporary left behind
    torch.manual_seed(dp.rank())
    model2, opt2 = _setup(seed=99)
    extra = dp.load_checkpoint(path, model2, opt2)
    assert int(extra["step"]) == 5
    assert torch.equal(_flat(model2), saved)
    for key, value in opt2.state[next(model2.parameters())].items():
        assert torch.equal(value, saved_state[key]), key
    for other in MPI.COMM_WORLD.allgather(_flat(model2)):
        assert torch.equal(other, saved)


def test_errors_reach_every_rank(tmp_path: Path) -> None:
    root_dir = _shared_dir(tmp_path)
    model, opt = _setup(seed=0)
    with pytest.raises(DataParallelError, match="could not write"):
        dp.save_checkpoint(root_dir / "no-such-dir" / "c.pt", model, opt)
    with pytest.raises(DataParallelError, match="could not load"):
        dp.load_checkpoint(root_dir / "missing.pt", model, opt)
    torch.save({"something": 1}, root_dir / f"foreign-{dp.rank()}.pt")
    with pytest.raises(DataParallelError, match="not a checkpoint written by"):
        dp.load_checkpoint(root_dir / "foreign-0.pt", model)
    dp.save_checkpoint(root_dir / "model-only.pt", model)
    with pytest.raises(DataParallelError, match="no optimizer state"):
        dp.load_checkpoint(root_dir / "model-only.pt", model, opt)
    # A model that does not match the file fails on every rank, naming the ranks.
    with pytest.raises(DataParallelError, match=r"could not load .*model-only\.pt.* on ranks? \d"):
        dp.load_checkpoint(root_dir / "model-only.pt", nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"model must be an nn\.Module"):
        dp.save_checkpoint(root_dir / "x.pt", opt)  # type: ignore[arg-type]


def test_a_flipped_byte_is_caught_on_every_rank(tmp_path: Path) -> None:
    path = _shared_dir(tmp_path) / "ckpt.pt"
    model, opt = _setup(0)
    dp.save_checkpoint(path, model, opt, epoch=1)
    if dp.rank() == 0:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01  # inside the tensor data
        path.write_bytes(bytes(data))
    MPI.COMM_WORLD.Barrier()
    with pytest.raises(DataParallelError, match=r"corrupt: .* SHA-256 [0-9a-f]{64}, but it was"):
        dp.load_checkpoint(path, model, opt)


def test_a_crashed_save_leaves_nothing_behind_after_the_next(tmp_path: Path) -> None:
    folder = _shared_dir(tmp_path)
    path = folder / "ckpt.pt"
    model, opt = _setup(0)
    if dp.rank() == 0:
        gone = folder / "ckpt.pt.tmp-999999999"  # a pid no process has
        gone.write_bytes(b"half a checkpoint")
        alive = folder / f"ckpt.pt.tmp-{os.getppid()}"  # a running process's save
        alive.write_bytes(b"in progress")
    MPI.COMM_WORLD.Barrier()
    dp.save_checkpoint(path, model, opt, step=3)
    if dp.rank() == 0:
        left = sorted(p.name for p in folder.iterdir())
        assert left == sorted(["ckpt.pt", f"ckpt.pt.tmp-{os.getppid()}"]), left
    assert dp.load_checkpoint(path, model, opt) == {"step": 3}


def test_the_file_and_its_directory_are_fsynced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _shared_dir(tmp_path) / "ckpt.pt"
    synced: list[str] = []
    real = os.fsync

    def recording(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    model, _ = _setup(0)
    dp.save_checkpoint(path, model)
    if dp.rank() == 0:
        assert len(synced) == 2, synced
        assert synced[0].startswith(str(path) + ".tmp-")  # the file, before the rename
        assert synced[1] == str(path.parent)  # the directory, after it
    else:
        assert synced == []
