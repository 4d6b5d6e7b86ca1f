"""Checkpoints every rank agrees on: root writes atomically, everyone loads root's.

Saving::

    root:   remove "<path>.tmp-<pid>" files of processes that are gone (crashed saves)
            write "MPXCKPT1 <sha256> <bytes>\n" + torch.save(state) to "<path>.tmp-<pid>"
            fsync the file, os.replace(tmp, path), fsync the directory
    all:    agree on root's outcome (an error on root raises on every rank)

A crash while writing leaves the previous checkpoint whole (``os.replace`` is
atomic on POSIX, and both fsyncs make the rename durable in order); the
temporary it leaves is removed by the next save. Loading: root checks the
SHA-256 of the payload (a flipped byte raises on every rank, naming both
digests), reads it and broadcasts the state with :func:`synchronize`, so
every rank resumes from the same bits (other ranks need not see root's file
system). Files of the earlier format (no header, no checksum) still load.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mpx.collectives import CommLike, Communicator
from mpx.dataparallel.errors import (
    DataParallelRemoteError,
    DataParallelTypeError,
    DataParallelValueError,
)
from mpx.dataparallel.runtime import default_comm
from mpx.dataparallel.synchronous import synchronize

__all__ = ["load_checkpoint", "save_checkpoint"]

_FORMAT = "mpx.dataparallel/1"
# The file: this magic, the payload's SHA-256 and length on one line, the payload.
_MAGIC = b"MPXCKPT1"


def _remove_stale_temporaries(path: str) -> None:
    """Deletes ``<path>.tmp-<pid>`` files whose process is gone (a save that crashed)."""
    target = Path(path)
    for tmp in target.parent.glob(f"{target.name}.tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except PermissionError:
            pass  # alive, someone else's


def _write_durably(path: str, payload: bytes) -> None:
    """Writes ``header + payload`` to a temporary, fsyncs it, renames it, fsyncs the directory."""
    digest = hashlib.sha256(payload).hexdigest()
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(_MAGIC + f" {digest} {len(payload)}\n".encode())
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def _read_verified(path: str) -> bytes:
    """The payload of a checkpoint file, after checking its SHA-256 (old files: as they are)."""
    with open(path, "rb") as f:
        data = f.read()
    if not data.startswith(_MAGIC + b" "):
        return data  # the earlier format: a bare torch.save, no checksum
    header, _, payload = data.partition(b"\n")
    try:
        _, digest, length = header.decode().split(" ")
        expected = int(length)
    except ValueError:
        raise DataParallelValueError(
            f"its header {header[:80]!r} is damaged; restore an earlier checkpoint"
        ) from None
    actual = hashlib.sha256(payload).hexdigest()
    if len(payload) != expected or actual != digest:
        raise DataParallelValueError(
            f"it is corrupt: {len(payload)} bytes with SHA-256 {actual}, but it was written "
            f"as {expected} bytes with SHA-256 {digest}; restore an earlier checkpoint"
        )
    return payload


def save_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    root: int = 0,
    comm: CommLike | None = None,
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
            _remove_stale_temporaries(os.fspath(path))
            buffer = io.BytesIO()
            torch.save(state, buffer)
            _write_durably(os.fspath(path), buffer.getvalue())


def load_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    root: int = 0,
    comm: CommLike | None = None,
) -> dict[str, Any]:
    """Loads root's file into ``model`` (and ``optimizer``) on every rank. Collective.

    Returns:
        The ``extra`` values given to :func:`save_checkpoint`, the same on every rank.

    Raises:
        DataParallelError: on every rank when root cannot read the file or it is
            not an mpx checkpoint.
    """
    comm = default_comm(comm)
    state = _read_synchronized(path, root, comm)
    if optimizer is not None and state["optimizer"] is None:  # the same on every rank
        raise DataParallelValueError(
            f"load_checkpoint: could not load {path}: it holds no optimizer state (saved "
            "with optimizer=None); load it with optimizer=None"
        )
    with comm.agreement(
        f"load_checkpoint: could not load {path} into the model or optimizer",
        error_type=DataParallelRemoteError,
    ):
        model.load_state_dict(state["model"])
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
    return dict(state["extra"])


def _read_synchronized(path: str | os.PathLike[str], root: int, comm: Communicator) -> Any:
    """Root's checkpoint file, verified, as the same dict on every rank. Collective."""
    state: Any = None
    with comm.agreement(
        f"load_checkpoint: could not load {path}", error_type=DataParallelRemoteError
    ):
        if comm.rank == root:
            payload = _read_verified(os.fspath(path))
            state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
            if not isinstance(state, dict) or state.get("format") != _FORMAT:
                raise DataParallelValueError(
                    "not a checkpoint written by mpx.dataparallel.save_checkpoint"
                )
    return synchronize(state, root, comm=comm)
