"""Resuming a training loop mid-epoch from the newest complete checkpoint of a directory.

A loop that checkpoints with :func:`save_resumable` and starts with
:func:`resume` continues where the last complete checkpoint left it, bit for
bit: model, optimizer, LR scheduler, every rank's RNG states (torch, numpy,
Python) and the data position (epoch of the ``DistributedDataContainer``,
batches done in it)::

    point = resume("ckpts", model, opt, scheduler, data)   # epoch 0, batch 0 if none
    for epoch in range(point.epoch, epochs):
        data.set_epoch(epoch)
        for i, (x, y) in point.batches(loader, epoch):     # skips the batches done
            ...; opt.step(); scheduler.step()
            save_resumable("ckpts", model, opt, epoch=epoch, batch=i + 1, scheduler=scheduler)

Files are ``ckpt-e<epoch>-b<batch>.pt`` (zero-padded, so names sort by
position), each written atomically and checksummed by :func:`save_checkpoint`.
:func:`latest_checkpoint` skips a newest file that is damaged (a crash of the
disk, a copy cut short) for the previous complete one; that is why
``keep`` defaults to 2. A save killed mid-write leaves only a temporary file
(``*.pt.tmp-<pid>``), which no name pattern here matches.

``sharded=True`` is for models whose ranks hold different parts or states
(pipeline stages, the 2-D mode, layer-parallel networks): every rank's model,
optimizer and scheduler state is gathered into the one file (so all stages
always resume from the same step) and each rank gets its own back. A
``DistributedOptimizer`` with compression also saves every rank's
``compression_state`` (the stochastic rounding), sharded or not.
"""

from __future__ import annotations

import io
import itertools
import os
import random
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn

from mpx.collectives import CommLike
from mpx.dataparallel.checkpoints.checkpoint import (
    _read_synchronized,
    _read_verified,
    save_checkpoint,
)
from mpx.dataparallel.errors import (
    DataParallelError,
    DataParallelRemoteError,
    DataParallelValueError,
)
from mpx.dataparallel.runtime import default_comm
from mpx.dataparallel.synchronous import DistributedDataContainer

__all__ = ["ResumePoint", "latest_checkpoint", "resume", "save_resumable"]

T = TypeVar("T")

_NAME = re.compile(r"^ckpt-e(\d+)-b(\d+)\.pt$")


def _name(epoch: int, batch: int) -> str:
    return f"ckpt-e{epoch:06d}-b{batch:09d}.pt"


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed loop starts: ``batch`` batches of ``epoch`` are done.

    Attributes:
        epoch: the epoch to continue (0 when there was no checkpoint).
        batch: batches of ``epoch`` already done.
        path: the checkpoint loaded, None if none.
        extra: the keyword values given to :func:`save_resumable`.
    """

    epoch: int = 0
    batch: int = 0
    path: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def batches(self, loader: Iterable[T], epoch: int) -> Iterator[tuple[int, T]]:
        """``enumerate(loader)``, less the batches of ``epoch`` done before the restart."""
        if epoch != self.epoch:
            return enumerate(loader)
        # A DataLoader draws its base seed from torch's RNG when its iterator
        # is made: the interrupted run made it at the epoch's start, before the
        # RNG state that was saved, so here it must not draw again.
        saved = torch.get_rng_state()
        batches = iter(loader)
        torch.set_rng_state(saved)
        # The skipped batches are still drawn: a loader's order is only
        # reproducible by walking it.
        return itertools.islice(enumerate(batches), self.batch, None)


def _candidates(directory: Path) -> list[Path]:
    found = [p for p in directory.iterdir() if _NAME.match(p.name)] if directory.is_dir() else []
    return sorted(found, key=lambda p: p.name, reverse=True)


def _complete(path: Path) -> bool:
    try:
        payload = _read_verified(os.fspath(path))
        torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except (DataParallelError, OSError, RuntimeError, EOFError, ValueError):
        return False
    return True


def latest_checkpoint(
    directory: str | os.PathLike[str], *, root: int = 0, comm: CommLike | None = None
) -> Path | None:
    """The newest checkpoint of ``directory`` whose checksum and contents hold. Collective.

    Root looks (its file system is the one checkpoints are written to); every
    rank gets its answer. None when there is none.
    """
    comm = default_comm(comm)
    found: str | None = None
    with comm.agreement(
        f"latest_checkpoint: could not list {directory}", error_type=DataParallelRemoteError
    ):
        if comm.rank == root:
            found = next((os.fspath(p) for p in _candidates(Path(directory)) if _complete(p)), None)
    chosen = comm.allgather_object(found)[root]
    return None if chosen is None else Path(chosen)


def _rng_state() -> dict[str, Any]:
    # Plain lists and tuples: torch.load(weights_only=True) refuses numpy arrays.
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": (kind, [int(k) for k in keys], pos, has_gauss, gauss),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _compression_state(optimizer: torch.optim.Optimizer) -> Any:
    """A DistributedOptimizer's QuantizeState (its stochastic rounding), else None."""
    return getattr(optimizer, "compression_state", None)


def save_resumable(
    directory: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    epoch: int,
    batch: int,
    scheduler: Any = None,
    keep: int = 2,
    sharded: bool = False,
    root: int = 0,
    comm: CommLike | None = None,
    **extra: Any,
) -> Path:
    """Checkpoints the loop after ``batch`` batches of ``epoch``; keeps the newest ``keep``.

    Collective. Creates ``directory`` on root if need be. Saves root's model,
    optimizer and scheduler (every rank's with ``sharded=True``), every rank's
    RNG states and compression state, and ``extra``. Returns the file written.
    """
    comm = default_comm(comm)
    if keep < 1 or epoch < 0 or batch < 0:
        raise DataParallelValueError(
            f"save_resumable: keep must be >= 1 and epoch, batch >= 0, got keep={keep}, "
            f"epoch={epoch}, batch={batch}"
        )
    directory = Path(directory)
    compression = _compression_state(optimizer)
    mine: dict[str, Any] = {
        "rng": _rng_state(),
        "compression": compression.state_dict() if compression is not None else None,
    }
    if sharded:
        mine["shard"] = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
        }
    ranks = comm.allgather_object(mine)
    path = directory / _name(epoch, batch)
    with comm.agreement(
        f"save_resumable: could not create {directory}", error_type=DataParallelRemoteError
    ):
        if comm.rank == root:
            directory.mkdir(parents=True, exist_ok=True)
    save_checkpoint(
        path,
        # Sharded: the shards hold every model; root's need not be there twice.
        nn.Module() if sharded else model,
        None if sharded else optimizer,
        root=root,
        comm=comm,
        resume={
            "epoch": epoch,
            "batch": batch,
            "scheduler": scheduler.state_dict() if scheduler is not None and not sharded else None,
            "rng": [r["rng"] for r in ranks],
            "compression": [r["compression"] for r in ranks],
            "shards": [r["shard"] for r in ranks] if sharded else None,
        },
        **extra,
    )
    with comm.agreement(
        f"save_resumable: could not remove old checkpoints of {directory}",
        error_type=DataParallelRemoteError,
    ):
        if comm.rank == root:
            for old in [p for p in _candidates(directory) if p != path][keep - 1 :]:
                old.unlink(missing_ok=True)
    return path


def resume(
    directory: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    data: DistributedDataContainer | None = None,
    *,
    root: int = 0,
    comm: CommLike | None = None,
) -> ResumePoint:
    """Restores the newest complete checkpoint of ``directory``; where to continue. Collective.

    Loads model, optimizer and scheduler (root's on every rank, or this rank's
    own from a ``sharded`` checkpoint), this rank's RNG states and compression
    state, and sets ``data`` to the saved epoch. Without a checkpoint nothing
    changes and the point is epoch 0, batch 0.

    Raises:
        DataParallelValueError: on every rank when the checkpoint was written
            by a different number of ranks (the RNG states are per rank).
    """
    comm = default_comm(comm)
    path = latest_checkpoint(directory, root=root, comm=comm)
    if path is None:
        return ResumePoint()
    state = _read_synchronized(path, root, comm)
    extra = dict(state["extra"])
    saved = extra.pop("resume")
    rng = saved["rng"]
    if len(rng) != comm.size:  # the same on every rank
        raise DataParallelValueError(
            f"resume: {path} was written by {len(rng)} ranks, this job has {comm.size}; "
            "resume with the same number of ranks"
        )
    shards = saved.get("shards")
    own = (
        shards[comm.rank]
        if shards is not None
        else {
            "model": state["model"],
            "optimizer": state["optimizer"],
            "scheduler": saved["scheduler"],
        }
    )
    compression = _compression_state(optimizer)
    with comm.agreement(
        f"resume: could not load {path} into the model, optimizer or scheduler",
        error_type=DataParallelRemoteError,
    ):
        model.load_state_dict(own["model"])
        optimizer.load_state_dict(own["optimizer"])
        if scheduler is not None and own["scheduler"] is not None:
            scheduler.load_state_dict(own["scheduler"])
        saved_compression = saved.get("compression")
        if compression is not None and saved_compression and saved_compression[comm.rank]:
            compression.load_state_dict(saved_compression[comm.rank])
    _set_rng_state(rng[comm.rank])
    if data is not None:
        data.set_epoch(saved["epoch"])
    return ResumePoint(saved["epoch"], saved["batch"], path, extra)
