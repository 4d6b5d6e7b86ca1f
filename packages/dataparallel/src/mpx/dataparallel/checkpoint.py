"""Checkpoints every rank agrees on: root writes atomically, everyone loads root's.

Saving::

    root:   torch.save(state, "<path>.tmp-<pid>") -> os.replace(tmp, path)
    all:    agree on root's outcome (an error on root raises on every rank)

A crash while writing leaves the previous checkpoint whole: ``os.replace`` is
atomic on POSIX. Loading: root reads the file and broadcasts the state with
:func:`synchronize`, so every rank resumes from the same bits (other ranks
need not see root's file system).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from mpx.collectives import Communicator
from mpx.dataparallel.errors import (
    DataParallelRemoteError,
    DataParallelTypeError,
    DataParallelValueError,
)
from mpx.dataparallel.runtime import default_comm
from mpx.dataparallel.synchronize import synchronize

__all__ = ["load_checkpoint", "save_checkpoint"]

_FORMAT = "mpx.dataparallel/1"


def save_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    root: int = 0,
    comm: Communicator | None = None,
    **extra: Any,
) -> None:
    """Writes the model, optimizer and ``extra`` values (root's) to ``path``. Collective.

    Args:
        path: the file; its directory must exist on root.
        model: its ``state_dict()`` is saved.
        optimizer: its ``state_dict()`` is saved (a DistributedOptimizer's is the inner one's).
        extra: more values to save (epoch, step, RNG states...): tensors and plain Python.

    Raises:
        DataParallelError: on every rank when root could not write the file.

    Example::

        save_checkpoint("ckpt.pt", model, opt, epoch=epoch)
        extra = load_checkpoint("ckpt.pt", model, opt); start = extra["epoch"] + 1
    """
    comm = default_comm(comm)
    if not isinstance(model, nn.Module):
        raise DataParallelTypeError(
            f"save_checkpoint: model must be an nn.Module, got {type(model).__name__}"
        )
    # A failure on root raises on every rank (as DataParallelRemoteError).
    with comm.agreement(
        f"save_checkpoint: could not write {path}", error_type=DataParallelRemoteError
    ):
        if comm.rank == root:
            state = {
                "format": _FORMAT,
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict() if optimizer is not None else None,
                "extra": extra,
            }
            tmp = f"{os.fspath(path)}.tmp-{os.getpid()}"
            try:
                torch.save(state, tmp)
                os.replace(tmp, path)
            except Exception:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise


def load_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    root: int = 0,
    comm: Communicator | None = None,
) -> dict[str, Any]:
    """Loads root's file into ``model`` (and ``optimizer``) on every rank. Collective.

    Returns:
        The ``extra`` values given to :func:`save_checkpoint`, the same on every rank.

    Raises:
        DataParallelError: on every rank when root cannot read the file or it is
            not an mpx checkpoint.
    """
    comm = default_comm(comm)
    state: Any = None
    with comm.agreement(
        f"load_checkpoint: could not load {path}", error_type=DataParallelRemoteError
    ):
        if comm.rank == root:
            state = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(state, dict) or state.get("format") != _FORMAT:
                raise DataParallelValueError(
                    "not a checkpoint written by mpx.dataparallel.save_checkpoint"
                )
            if optimizer is not None and state["optimizer"] is None:
                raise DataParallelValueError(
                    "it holds no optimizer state (saved with optimizer=None); "
                    "load it with optimizer=None"
                )
    state = synchronize(state, root, comm=comm)
    with comm.agreement(
        f"load_checkpoint: could not load {path} into the model or optimizer",
        error_type=DataParallelRemoteError,
    ):
        model.load_state_dict(state["model"])
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
    return dict(state["extra"])
