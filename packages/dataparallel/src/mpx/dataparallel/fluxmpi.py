"""FluxMPI.jl's names, with FluxMPI's meanings, for code ported from Julia.

The package's own API follows PyTorch (``mpx.dataparallel.init``,
``local_rank()`` = the rank within the node, torch's ``LOCAL_RANK``). FluxMPI
differs in one name that matters: its ``local_rank()`` is the rank in the
world communicator, so "log when ``local_rank() == 0``" logs once per job.
This module keeps that meaning, so such a line keeps logging once::

    from mpx.dataparallel import fluxmpi as FluxMPI

    FluxMPI.Init()
    if FluxMPI.local_rank() == 0:          # FluxMPI's meaning: world rank 0
        print("once per job")
    FluxMPI.fluxmpi_println("every rank, prefixed with its rank")

==========================  ================================================
FluxMPI.jl                  here
==========================  ================================================
``FluxMPI.Init(; gpu_devices)``  :func:`Init` (= ``init(gpu_devices=...)``)
``local_rank()``            :func:`local_rank`: the WORLD rank (FluxMPI's)
``total_workers()``         :func:`total_workers`
``synchronize!(x; root_rank)``  :func:`synchronize` (``synchronize(x, root_rank=0)``;
                            returns ``x`` synchronized)
``allreduce_gradients(gs)`` :func:`allreduce_gradients`
``DistributedOptimiser``    :class:`DistributedOptimiser`
``DistributedDataContainer``  :class:`DistributedDataContainer`
``fluxmpi_print(...)``,     :func:`fluxmpi_print`, :func:`fluxmpi_println`:
``fluxmpi_println(...)``    ``print`` prefixed with the rank and world size
==========================  ================================================
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mpx.collectives import CommLike
from mpx.dataparallel.runtime import init, rank, world_size
from mpx.dataparallel.synchronous import DistributedDataContainer as _Container
from mpx.dataparallel.synchronous import DistributedOptimizer as DistributedOptimiser
from mpx.dataparallel.synchronous import allreduce_gradients, synchronize

__all__ = [
    "DistributedDataContainer",
    "DistributedOptimiser",
    "Init",
    "allreduce_gradients",
    "fluxmpi_print",
    "fluxmpi_println",
    "local_rank",
    "synchronize",
    "total_workers",
]


class DistributedDataContainer(_Container):
    """FluxMPI's ``DistributedDataContainer(data)``: this rank's contiguous block of
    ``ceil(N / size)`` samples, disjoint from the others' (the last rank's shorter,
    trailing ranks empty when N is small), as FluxMPI splits; ``uneven="ceil"`` of
    :class:`mpx.dataparallel.DistributedDataContainer`, whose default pads instead.
    """

    def __init__(
        self,
        dataset: Any,
        shuffle: bool = False,
        seed: int = 0,
        uneven: str = "ceil",
        *,
        comm: CommLike | None = None,
    ) -> None:
        super().__init__(dataset, shuffle, seed, uneven, comm=comm)


def Init(gpu_devices: Sequence[int] | None = None) -> None:
    """FluxMPI's ``Init``: starts MPI and pins this rank's GPU (see :func:`init`)."""
    init(gpu_devices=gpu_devices)


def local_rank() -> int:
    """FluxMPI's ``local_rank()``: this process's rank in the WORLD (torch: ``rank()``)."""
    return rank()


def total_workers() -> int:
    """FluxMPI's ``total_workers()``: the number of ranks."""
    return world_size()


def fluxmpi_print(*args: Any, **kwargs: Any) -> None:
    """``print`` prefixed with ``[rank / size]``, no newline (FluxMPI's ``fluxmpi_print``)."""
    kwargs.setdefault("end", "")
    print(f"[{rank()} / {world_size()}]", *args, **kwargs)


def fluxmpi_println(*args: Any, **kwargs: Any) -> None:
    """``print`` prefixed with ``[rank / size]`` (FluxMPI's ``fluxmpi_println``)."""
    print(f"[{rank()} / {world_size()}]", *args, **kwargs, flush=True)
