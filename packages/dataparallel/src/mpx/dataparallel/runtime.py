"""Start-up and the rank queries of FluxMPI's API.

``init()`` creates the world communicator (collective, once) and, when CUDA is
available, pins this process to GPU ``local_rank() % device_count()``: the
round robin TorchMPI and FluxMPI use, so ranks of one node never share a
device unless there are more ranks than devices.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from mpi4py import MPI

from mpx.collectives import CommLike, Communicator, as_communicator, world
from mpx.dataparallel.errors import DataParallelValueError

__all__ = ["default_comm", "init", "is_root", "local_rank", "object_comm", "rank", "world_size"]

_OBJECT_COMM = "mpx.dataparallel.objects"


def init(pin_device: bool = True, gpu_devices: Sequence[int] | None = None) -> Communicator:
    """Initialises MPI and returns the world communicator. Collective.

    Args:
        pin_device: set the current CUDA device by local rank (when CUDA exists).
        gpu_devices: the CUDA devices this node's ranks take in turn (FluxMPI's
            ``Init(; gpu_devices)``): local rank r gets ``gpu_devices[r % len]``.
            Default: all devices.

    Raises:
        DataParallelValueError: ``gpu_devices`` names a device that does not
            exist, or CUDA is not available.

    Example::

        comm = mpx.dataparallel.init(gpu_devices=[0, 1])   # ranks alternate between two GPUs
        if mpx.dataparallel.is_root():
            print(f"{mpx.dataparallel.world_size()} ranks")
    """
    comm = world()
    if gpu_devices is not None:
        devices = list(gpu_devices)
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        bad = [
            d
            for d in devices
            if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < count
        ]
        if not devices or bad:
            raise DataParallelValueError(
                f"init: gpu_devices={devices!r} must list CUDA devices of this node "
                f"(0 to {count - 1}); this node has {count} CUDA device(s)"
                + ("" if count else ": pass gpu_devices=None to run on the CPU")
            )
        if pin_device:
            torch.cuda.set_device(devices[comm.node_rank % len(devices)])
        return comm
    if pin_device and torch.cuda.is_available():
        torch.cuda.set_device(comm.node_rank % torch.cuda.device_count())
    return comm


def default_comm(comm: CommLike | None) -> Communicator:
    """``comm`` (an mpx or mpi4py communicator), or the world communicator when None.

    Anything else is passed through as it is: a stand-in with ``rank`` and
    ``size`` serves the parts that only need those (the data container).
    """
    if comm is None or isinstance(comm, MPI.Intracomm):
        return as_communicator(comm)
    return comm


def object_comm(comm: Communicator) -> MPI.Intracomm:
    """A private duplicate of ``comm`` for small pickled messages (layouts, skeletons).

    Blocking mpi4py collectives never share a communicator with mpx's own
    operations, which may be in flight (or queued) on ``comm.mpi``. Collective
    on first use for ``comm``.
    """
    found = comm.cached(_OBJECT_COMM)
    if found is None:
        found = comm.cache(_OBJECT_COMM, comm.mpi.Dup())
    return found  # type: ignore[no-any-return]


def rank() -> int:
    """This process's rank in the world communicator."""
    return world().rank


def local_rank() -> int:
    """This process's rank among the ranks of its node (torch's ``LOCAL_RANK``).

    FluxMPI's ``local_rank()`` is the rank in the world instead: that is
    :func:`rank` here, and :func:`mpx.dataparallel.fluxmpi.local_rank`.
    """
    return world().node_rank


def world_size() -> int:
    """The number of ranks."""
    return world().size


def is_root(root: int = 0) -> bool:
    """True on rank ``root`` (0 by default): the rank that logs and writes files."""
    return world().rank == root
