"""``DistributedOptimizer``'s buckets: which parameters, in which bucket, in what memory.

Parameters are packed into buckets in reverse registration order (the order
backward produces their gradients), one dtype and device per bucket, about
``bucket_mb`` each (the first one small, so communication starts early); see
:mod:`mpx.dataparallel.synchronous.optimizer` for how the buckets travel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from mpx.collectives import Communicator
from mpx.collectives.building_blocks import empty_shared, free_shared, small_bytes, usable_cores
from mpx.dataparallel.errors import DataParallelValueError
from mpx.dataparallel.synchronous.reduction import Waitable

__all__ = [
    "FIRST_BUCKET_MB",
    "Bucket",
    "free_buckets",
    "make_buckets",
    "overlap_pays",
    "parameters",
]

FIRST_BUCKET_MB = 1.0


@dataclass
class Bucket:
    """Parameters reduced together, and their flat buffer."""

    dtype: torch.dtype
    device: torch.device
    params: list[nn.Parameter] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # positions in the used map
    offsets: list[int] = field(default_factory=list)
    numel: int = 0
    flat: torch.Tensor | None = None
    views: list[torch.Tensor] = field(default_factory=list)  # p.grad aliases (CPU buckets)
    shared: bool = False  # flat is node-shared memory (empty_shared): close() gives it back
    arrived: int = 0
    handle: Waitable | None = None

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


def overlap_pays(buckets: list[Bucket], comm: Communicator) -> bool:
    """``overlap="auto"``: whether reducing during backward can use idle hardware.

    GPU buckets (the device computes, the host communicates) and several nodes
    (the network carries the data) always gain. CPU buckets on one node are
    reduced by the CPU itself: that gains only while some core is idle.
    """
    if comm.size == 1:
        return False  # nothing to communicate
    if any(b.device.type != "cpu" for b in buckets) or not comm.single_node:
        return True
    return usable_cores() > comm.node_size * torch.get_num_threads()


def parameters(
    optimizer: torch.optim.Optimizer, model: nn.Module | None
) -> tuple[list[nn.Parameter], dict[int, str]]:
    """The parameters to reduce (each once, registration order) and their names by id."""
    if model is not None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    else:
        flat = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        named = [(f"param_groups[..][{i}]", p) for i, p in enumerate(flat)]
    seen: set[int] = set()
    params: list[nn.Parameter] = []
    names: dict[int, str] = {}
    for name, p in named:
        if id(p) not in seen:
            seen.add(id(p))
            params.append(p)
            names[id(p)] = name
    if not params:
        raise DataParallelValueError(
            "DistributedOptimizer: no parameter requires grad; wrap an optimizer over "
            "parameters with requires_grad=True"
        )
    return params, names


def make_buckets(
    params: list[nn.Parameter], cap: int, comm: Communicator, shared: bool
) -> tuple[list[Bucket], dict[int, tuple[int, int]]]:
    """The buckets, and where each parameter is in them: ``{id(p): (bucket, position)}``.

    ``shared``: the reduction chosen reads node-shared memory in place (see
    :func:`_allocate`).
    """
    buckets: list[Bucket] = []
    open_: dict[tuple[torch.dtype, torch.device], int] = {}
    where: dict[int, tuple[int, int]] = {}
    first_cap = min(cap, int(FIRST_BUCKET_MB * (1 << 20)))
    for pid in reversed(range(len(params))):
        p = params[pid]
        key = (p.dtype, p.device)
        index = open_.get(key)
        nbytes = p.numel() * p.element_size()
        if index is not None:
            limit = first_cap if index == 0 else cap
            if buckets[index].nbytes + nbytes > limit:
                index = None
        if index is None:
            index = len(buckets)
            buckets.append(Bucket(p.dtype, p.device))
            open_[key] = index
        bucket = buckets[index]
        where[id(p)] = (index, len(bucket.params))
        bucket.params.append(p)
        bucket.ids.append(pid)
        bucket.offsets.append(bucket.numel)
        bucket.numel += p.numel()
    for bucket in buckets:
        bucket.flat = _allocate(bucket, comm, shared)
        if bucket.device.type == "cpu":
            bucket.views = [
                bucket.flat[o : o + p.numel()].view(p.shape)
                for p, o in zip(bucket.params, bucket.offsets, strict=True)
            ]
    return buckets, where


def _allocate(bucket: Bucket, comm: Communicator, shared: bool) -> torch.Tensor:
    """The bucket's flat buffer: in node-shared memory where ``shm`` will reduce it.

    A CPU bucket on a one-node job, large enough for ``auto`` to pick the
    shared-memory allreduce, is allocated by ``mpx.collectives.empty_shared``:
    the peers then read it in place (no staging copies). Collective, and
    identical on every rank, as the buckets are.
    """
    if (
        shared
        and bucket.device.type == "cpu"
        and comm.size > 1
        and comm.single_node
        and bucket.nbytes >= small_bytes()
    ):
        bucket.shared = True
        return empty_shared(bucket.numel, dtype=bucket.dtype, comm=comm).zero_()
    return torch.zeros(bucket.numel, dtype=bucket.dtype)


def free_buckets(buckets: list[Bucket], comm: Communicator) -> None:
    """Gives back the node-shared memory of ``buckets`` (collective, in the same order on
    every rank). A gradient that still aliases it is copied out first: the wrapped
    optimizer keeps working on its parameters after ``close()``."""
    for bucket in buckets:
        if not bucket.shared or bucket.flat is None:
            continue
        storage = bucket.flat.untyped_storage().data_ptr()
        with torch.no_grad():
            for p in bucket.params:
                if p.grad is not None and p.grad.untyped_storage().data_ptr() == storage:
                    p.grad = p.grad.clone()
        free_shared(bucket.flat, comm=comm)
        bucket.flat, bucket.views, bucket.shared = None, [], False
