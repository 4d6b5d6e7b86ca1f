"""``synchronize(obj, root)``: make every rank's copy of ``obj`` equal to root's.

Anything that holds tensors is reduced to a *skeleton* (the structure and
every non-tensor leaf, pickled and broadcast by root) and a list of tensors,
broadcast in flat buckets grouped by dtype::

    root:      {"w": T0, "opt": [T1, 3, "adam"], "b": T2}
    skeleton:  {"w": #0, "opt": [#1, 3, "adam"], "b": #2}   (one pickled bcast)
    buckets:   float32: [ T0 | T2 ]   int64: [ T1 ]         (one bcast per bucket)

A receiving rank writes into its own tensor at the same place when shape and
dtype agree (in place: the parameters a module or optimizer refers to stay
the same objects); elsewhere it builds the object from the skeleton. Every
rank ends bit-identical to root (broadcast copies bytes; nothing is reduced).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from mpx.collectives import CommLike, Communicator, broadcast
from mpx.collectives.building_blocks import SUPPORTED_DTYPES
from mpx.dataparallel.errors import (
    DataParallelRemoteError,
    DataParallelTypeError,
    DataParallelValueError,
)
from mpx.dataparallel.runtime import default_comm, object_comm

__all__ = ["broadcast_tensors", "synchronize"]

T = TypeVar("T")

_DEFAULT_BUCKET_MB = 64.0


@dataclass(frozen=True)
class _Slot:
    """A tensor's place in the skeleton."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    device_type: str


def synchronize(
    obj: T,
    root: int | None = None,
    *,
    comm: CommLike | None = None,
    bucket_mb: float = _DEFAULT_BUCKET_MB,
    root_rank: int | None = None,
) -> T:
    """Makes ``obj`` on every rank equal to ``obj`` on ``root``. Collective.

    Args:
        obj: an ``nn.Module`` (parameters and buffers, in place), an optimizer
            (its state dict, state included, loaded on the other ranks), a
            tensor (in place), or nested lists, tuples and dicts of tensors
            and picklable values (e.g. a state dict).
        root: the rank whose values everyone gets (rank 0 when neither
            ``root`` nor ``root_rank`` is given).
        comm: the ranks taking part (world by default).
        bucket_mb: size of the flat buffers tensors travel in.
        root_rank: FluxMPI's name for ``root`` (``synchronize!(x; root_rank=0)``),
            so that ported code keeps its spelling; giving both is an error
            unless they name the same rank.

    Returns:
        The synchronized object: ``obj`` itself for modules, optimizers,
        tensors, lists and dicts (updated in place), a new tuple for tuples.

    Raises:
        DataParallelError: on every rank, when a rank's module or tensor has
            other shapes or dtypes than root's.

    Example::

        model = synchronize(model)             # parameters and buffers from rank 0
        optimizer = synchronize(optimizer)     # e.g. Adam's exp_avg and step
    """
    root = _root_of(root, root_rank)
    comm = default_comm(comm)
    if not isinstance(root, int) or not 0 <= root < comm.size:
        raise DataParallelValueError(
            f"synchronize: root must be a rank in [0, {comm.size}), got {root!r}"
        )
    if bucket_mb <= 0:
        raise DataParallelValueError(f"synchronize: bucket_mb must be positive, got {bucket_mb!r}")
    bucket_bytes = int(bucket_mb * (1 << 20))
    if isinstance(obj, nn.Module):
        tensors = [*obj.parameters(), *obj.buffers()]
        _check_same_layout("module", tensors, root, comm)
        broadcast_tensors(tensors, root, comm=comm, bucket_bytes=bucket_bytes)
        return obj
    if isinstance(obj, torch.optim.Optimizer):
        state = _sync_tree(
            obj.state_dict() if comm.rank == root else None, root, comm, bucket_bytes
        )
        with comm.agreement(
            "synchronize: could not load root's optimizer state", error_type=DataParallelRemoteError
        ):
            if comm.rank != root:
                obj.load_state_dict(state)
        return obj
    if isinstance(obj, torch.Tensor):
        _check_same_layout("tensor", [obj], root, comm)
        broadcast_tensors([obj], root, comm=comm, bucket_bytes=bucket_bytes)
        return obj
    if isinstance(obj, (list, tuple)) and any(
        isinstance(x, (nn.Module, torch.optim.Optimizer)) for x in obj
    ):
        items = [synchronize(x, root, comm=comm, bucket_mb=bucket_mb) for x in obj]
        if isinstance(obj, list):
            obj[:] = items
            return obj
        return type(obj)(items)
    return _sync_tree(obj, root, comm, bucket_bytes)  # type: ignore[no-any-return]


def _root_of(root: int | None, root_rank: int | None) -> int:
    """The one root of ``root`` and FluxMPI's ``root_rank`` (0 when neither is given).

    Every rank passes the same arguments, so a conflict raises on every rank.
    """
    if root is not None and root_rank is not None and root != root_rank:
        raise DataParallelValueError(
            f"synchronize: root={root!r} and root_rank={root_rank!r} name different ranks; "
            "root_rank is FluxMPI's name for root: pass one of them"
        )
    if root is not None:
        return root
    return 0 if root_rank is None else root_rank


# -- tensors in buckets ---------------------------------------------------------


def _wire(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` itself, or its bytes when the collectives do not take its dtype."""
    return flat if flat.dtype in SUPPORTED_DTYPES else flat.view(torch.uint8)


def _buckets(tensors: list[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``tensors`` grouped by dtype, each group cut at ``bucket_bytes``."""
    groups: dict[torch.dtype, list[list[int]]] = {}
    sizes: dict[torch.dtype, int] = {}
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        chunks = groups.setdefault(t.dtype, [[]])
        if chunks[-1] and sizes[t.dtype] + nbytes > bucket_bytes:
            chunks.append([])
            sizes[t.dtype] = 0
        chunks[-1].append(i)
        sizes[t.dtype] = sizes.get(t.dtype, 0) + nbytes
    # Same order on every rank: dtypes in first-seen order, which the layout fixes.
    return [chunk for chunks in groups.values() for chunk in chunks if chunk]


def broadcast_tensors(
    tensors: Iterable[torch.Tensor],
    root: int = 0,
    *,
    comm: CommLike | None = None,
    bucket_bytes: int = int(_DEFAULT_BUCKET_MB * (1 << 20)),
) -> None:
    """Copies root's values into ``tensors`` on every rank, in flat buckets. Collective.

    Every rank passes tensors of the same shapes and dtypes in the same order;
    they may live on any device and need not be contiguous.
    """
    comm = default_comm(comm)
    tensors = list(tensors)
    if comm.size == 1 or not tensors:
        return
    plan = _buckets(tensors, bucket_bytes)
    flats: list[torch.Tensor] = []
    handles = []
    for chunk in plan:
        members = [tensors[i] for i in chunk]
        flat = torch.empty(sum(t.numel() for t in members), dtype=members[0].dtype)
        if comm.rank == root:
            offset = 0
            for t in members:
                flat[offset : offset + t.numel()].copy_(t.detach().reshape(-1))
                offset += t.numel()
        flats.append(flat)
        # All buckets in flight at once: MPI pipelines them.
        handles.append(broadcast(_wire(flat), root, comm=comm, async_op=True))
    for handle in handles:
        handle.wait()
    if comm.rank == root:
        return
    with torch.no_grad():
        for chunk, flat in zip(plan, flats, strict=True):
            offset = 0
            for i in chunk:
                t = tensors[i]
                t.copy_(flat[offset : offset + t.numel()].view(t.shape))
                offset += t.numel()


def _check_same_layout(
    what: str, tensors: list[torch.Tensor], root: int, comm: Communicator
) -> None:
    """Raises on every rank if this rank's shapes/dtypes differ from root's."""
    if comm.size == 1:
        return
    mine = [(tuple(t.shape), str(t.dtype)) for t in tensors]
    theirs = object_comm(comm).bcast(mine if comm.rank == root else None, root=root)
    problem = _first_difference(mine, theirs)
    comm.agree(
        f"{problem}; every rank must build the same model (same constructor arguments) "
        "before synchronize"
        if problem
        else None,
        f"synchronize: the {what} differs from root {root}'s",
        error_type=DataParallelRemoteError,
    )


def _first_difference(
    mine: list[tuple[tuple[int, ...], str]], theirs: list[tuple[tuple[int, ...], str]]
) -> str:
    if len(mine) != len(theirs):
        return f"it has {len(mine)} tensors, root has {len(theirs)}"
    for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        if a != b:
            return f"tensor {i} is {a[0]} {a[1]}, root's is {b[0]} {b[1]}"
    return ""


# -- nested containers ----------------------------------------------------------


def _strip(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """The skeleton of ``obj``; its tensors are appended to ``tensors``."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _Slot(len(tensors) - 1, tuple(obj.shape), obj.dtype, obj.device.type)
    if isinstance(obj, dict):
        return type(obj)((k, _strip(v, tensors)) for k, v in obj.items())
    if isinstance(obj, list):
        return [_strip(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        items = [_strip(v, tensors) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, (nn.Module, torch.optim.Optimizer)):
        raise DataParallelTypeError(
            f"synchronize: a {type(obj).__name__} nested inside a container is not supported; "
            "synchronize it on its own (or pass a list of modules and optimizers)"
        )
    return obj


def _targets(own: Any, skeleton: Any, out: list[torch.Tensor | None]) -> None:
    """Finds this rank's tensor for every slot of root's skeleton (None: make one)."""
    if isinstance(skeleton, _Slot):
        fits = (
            isinstance(own, torch.Tensor)
            and tuple(own.shape) == skeleton.shape
            and own.dtype == skeleton.dtype
        )
        out[skeleton.index] = own if fits else None
    elif isinstance(skeleton, dict):
        for k, v in skeleton.items():
            _targets(own.get(k) if isinstance(own, dict) else None, v, out)
    elif isinstance(skeleton, (list, tuple)):
        same = isinstance(own, (list, tuple)) and len(own) == len(skeleton)
        for i, v in enumerate(skeleton):
            _targets(own[i] if same else None, v, out)


def _rebuild(own: Any, skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(skeleton, _Slot):
        return tensors[skeleton.index]
    if isinstance(skeleton, dict):
        values = {
            k: _rebuild(own.get(k) if isinstance(own, dict) else None, v, tensors)
            for k, v in skeleton.items()
        }
        if isinstance(own, dict):
            own.clear()
            own.update(values)
            return own
        return type(skeleton)(values.items())
    if isinstance(skeleton, (list, tuple)):
        same = isinstance(own, (list, tuple)) and len(own) == len(skeleton)
        items = [_rebuild(own[i] if same else None, v, tensors) for i, v in enumerate(skeleton)]
        if isinstance(skeleton, list):
            if isinstance(own, list):
                own[:] = items
                return own
            return items
        return type(skeleton)(*items) if hasattr(skeleton, "_fields") else type(skeleton)(items)
    return skeleton


def _fresh(slot: _Slot) -> torch.Tensor:
    device = "cuda" if slot.device_type == "cuda" and torch.cuda.is_available() else "cpu"
    return torch.empty(slot.shape, dtype=slot.dtype, device=device)


def _sync_tree(obj: Any, root: int, comm: Communicator, bucket_bytes: int) -> Any:
    if comm.size == 1:
        _strip(obj, [])  # the same checks as with more ranks
        return obj
    tensors: list[torch.Tensor] = []
    message: tuple[str, Any] = ("", None)
    if comm.rank == root:
        try:
            message = ("", _strip(obj, tensors))
        except TypeError as error:  # raised on every rank below, not on root alone
            message = (str(error), None)
    problem, skeleton = object_comm(comm).bcast(message, root=root)
    if problem:
        raise DataParallelTypeError(problem)
    if comm.rank == root:
        broadcast_tensors(tensors, root, comm=comm, bucket_bytes=bucket_bytes)
        return obj
    slots: list[_Slot] = []
    _collect_slots(skeleton, slots)
    found: list[torch.Tensor | None] = [None] * len(slots)
    _targets(obj, skeleton, found)
    targets = [t if t is not None else _fresh(s) for t, s in zip(found, slots, strict=True)]
    broadcast_tensors(targets, root, comm=comm, bucket_bytes=bucket_bytes)
    return _rebuild(obj, skeleton, targets)


def _collect_slots(skeleton: Any, slots: list[_Slot]) -> None:
    """Every slot, in index order (the order _strip numbered them)."""
    if isinstance(skeleton, _Slot):
        slots.append(skeleton)
    elif isinstance(skeleton, dict):
        for v in skeleton.values():
            _collect_slots(v, slots)
    elif isinstance(skeleton, (list, tuple)):
        for v in skeleton:
            _collect_slots(v, slots)
