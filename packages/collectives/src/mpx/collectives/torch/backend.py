"""mpx as a ``torch.distributed`` backend: ``dist.init_process_group("mpx")``.

A Python subclass of ``dist.ProcessGroup`` forwards torch's collectives to
mpx's (so ``impl="auto"`` chooses shm/ring/mpi for them) and wraps each
:class:`Handle` in a ``dist.Work``::

    DistributedDataParallel ── dist.all_reduce(bucket) ── MPXProcessGroup.allreduce
                                                              └─ mpx allreduce(async_op=True)
                                                                   └─ MPXWork(handle).get_future()
                                                                        completed by mpx's
                                                                        progress thread

The work is asynchronous as gloo's: the progress thread advances the handle
and completes the work's future, so DDP's bucket allreduces overlap backward.

Every c10d operation is here: the reductions (all_reduce, reduce,
reduce_scatter and their tensor/coalesced forms), the data movers (broadcast,
all_gather, gather, scatter, all_to_all, uneven splits included) and
point-to-point (send/recv/isend/irecv, from any source, batch_isend_irecv).
Dtypes and ReduceOps mpx has no kernel for travel in the forms of
:mod:`mpx.collectives.torch.forms`; what still cannot work raises an mpx
error naming the op.

The ranks come from MPI, not from a rendezvous: :func:`init_process_group`
needs no MASTER_ADDR and works under any MPI launcher. Every group
(``dist.new_group([0, 1])`` in a 3-rank job too) gets an MPI communicator of
its own, made by its members alone (``MPI_Comm_create_group``) and freed by
``destroy_process_group``. The
``timeout`` given to ``init_process_group``/``new_group`` bounds every
operation of the group (:class:`CollectiveTimeout` after it, as gloo
raises).

This module registers the backend and starts the default group; the rest is
in modules of one job each, which rely on torch's ProcessGroup extension
points (subclassing ``dist.ProcessGroup`` and ``dist.Work`` in Python)::

    torch_process_group  MPXProcessGroup: every c10d collective mapped onto mpx's
    torch_group          its base: name, backend, shutdown, works, point to point
    torch_work           MPXWork and the steps the group waits on
    torch_futures        the works' futures (Python's, and C++'s tensor lists)
    torch_forms          the dtypes and ReduceOps mpx has no kernel for
    torch_eager          the classes run eagerly under torch.compile
"""

from __future__ import annotations

import gc
import secrets
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from mpx.collectives.core import ops, world
from mpx.collectives.torch.group import BACKEND_NAME, note_builtin_hooks
from mpx.collectives.torch.process_group import MPXProcessGroup
from mpx.collectives.torch.work import MPXWork

__all__ = [
    "BACKEND_NAME",
    "MPXProcessGroup",
    "MPXWork",
    "init_process_group",
    "register_torch_backend",
]


def _create(options: Any, backend_options: Any = None) -> MPXProcessGroup:
    return MPXProcessGroup.create(options, backend_options)


def register_torch_backend() -> None:
    """Registers ``"mpx"`` with ``torch.distributed`` (idempotent)."""
    if BACKEND_NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(
            BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"]
        )
    note_builtin_hooks()


def init_process_group(init_method: str | None = None, timeout: timedelta | None = None) -> None:
    """``dist.init_process_group("mpx")`` with MPI's rank and size.

    Args:
        init_method: None for a process-local store (no TCP rendezvous needed;
            enough for every collective on the default group), or
            ``"env://"`` when other groups (``dist.new_group(backend="gloo")``)
            must rendezvous too (see ``mpx.launch.init_torch_env``).
        timeout: bounds every operation of the group (torch's default when None).
    """
    register_torch_backend()
    comm = world()
    extra: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    if init_method is None:
        dist.init_process_group(
            BACKEND_NAME,
            rank=comm.rank,
            world_size=comm.size,
            store=dist.HashStore(),  # type: ignore[attr-defined]
            **extra,
        )
    else:
        # Every rank must be done with the previous group before any rank
        # meets the store: a rank that connects while rank 0 still serves the
        # old group's store on the same MASTER_PORT counts itself there, and
        # rank 0's new store then waits for it until its timeout (a CI hang).
        # The previous group's store and gloo pairs may outlive it in reference
        # cycles (DDP's reducer, a work's callbacks): collected first, on every
        # rank, so that nobody finds the old group's keys or sockets.
        gc.collect()
        ops.barrier(comm=comm, timeout=None if timeout is None else timeout.total_seconds())
        # Some old groups cannot be collected (cycles through torch's C++, such
        # as a future's callbacks), and torch hands a new env:// store the old
        # TCPStore server of the same port while one is alive, keys included:
        # a new gloo group named like an old one ("1" again after destroy)
        # then read rank 0's old address and connected to its old listener (a
        # CI hang). Each world gets its own key space, named by rank 0.
        token = comm.allgather_object(secrets.token_hex(8) if comm.rank == 0 else None)[0]
        store, _, _ = next(
            dist.rendezvous(  # type: ignore[attr-defined]
                init_method, rank=comm.rank, world_size=comm.size, **extra
            )
        )
        dist.init_process_group(
            BACKEND_NAME,
            store=dist.PrefixStore(f"mpx-world-{token}", store),  # type: ignore[attr-defined]
            rank=comm.rank,
            world_size=comm.size,
            **extra,
        )
