"""``allreduce_gradients``: average the gradients of a model once, after backward.

FluxMPI's standalone call, for loops that manage their own optimizer (or
accumulate gradients in their own way). :class:`DistributedOptimizer` does the
same while backward runs and is faster; this one is one call at the end::

    loss.backward()
    allreduce_gradients(model)     # every rank now holds the average
    opt.step()

Gradients are fused into one flat buffer per dtype and device (one allreduce
each, in a fixed order every rank shares). A parameter without a gradient
contributes zeros and receives the average, so every rank reduces the same
layout (as DDP does for a parameter some ranks did not use).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from mpx.collectives import CommLike, allreduce
from mpx.dataparallel.errors import DataParallelTypeError
from mpx.dataparallel.runtime import default_comm

__all__ = ["allreduce_gradients"]


def allreduce_gradients(
    model: nn.Module | Iterable[torch.Tensor],
    *,
    average: bool = True,
    comm: CommLike | None = None,
) -> None:
    """Averages (or sums) the ``.grad`` of every parameter that requires grad, across ranks.

    Args:
        model: a module, or its parameters.
        average: the mean over ranks (True) or the sum.
        comm: the ranks taking part (world by default; an mpi4py communicator too).

    Example::

        loss_fn(model(x), y).backward()
        allreduce_gradients(model)
        optimizer.step()
    """
    params: list[torch.Tensor]
    if isinstance(model, nn.Module):
        params = [p for p in model.parameters() if p.requires_grad]
    elif isinstance(model, Iterable):
        params = [p for p in model if isinstance(p, torch.Tensor) and p.requires_grad]
    else:
        raise DataParallelTypeError(
            f"allreduce_gradients takes an nn.Module or its parameters, got {type(model).__name__}"
        )
    communicator = default_comm(comm)
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault((p.dtype, p.device), []).append(p)
    op = "avg" if average else "sum"
    with torch.no_grad():
        for (dtype, device), members in groups.items():
            flat = torch.cat(
                [
                    (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                    for p in members
                ]
            ).to(dtype)
            host = flat if device.type == "cpu" else flat.cpu()
            allreduce(host, op, comm=communicator)
            if host is not flat:
                flat.copy_(host)
            offset = 0
            for p in members:
                n = p.numel()
                value = flat[offset : offset + n].view_as(p)
                if p.grad is None:
                    p.grad = value.clone()
                else:
                    p.grad.copy_(value)
                offset += n
