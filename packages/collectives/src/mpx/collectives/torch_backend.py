"""mpx as a ``torch.distributed`` backend: ``dist.init_process_group("mpx")``.

A Python subclass of ``dist.ProcessGroup`` forwards torch's collectives to
mpx's (so ``impl="auto"`` chooses shm/ring/mpi for them) and wraps each
:class:`Handle` in a ``dist.Work``::

    DistributedDataParallel ── dist.all_reduce(bucket) ── MPXProcessGroup.allreduce
                                                              └─ mpx allreduce(async_op=True)
                                                                   └─ MPXWork(handle).wait()

The ranks come from MPI, not from a rendezvous: :func:`init_process_group`
needs no MASTER_ADDR and works under any MPI launcher. This module is the one
place that relies on torch's ProcessGroup extension points (subclassing
``dist.ProcessGroup`` and ``dist.Work`` in Python).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mpx.collectives import ops
from mpx.collectives.communicator import Communicator, world
from mpx.collectives.errors import MPXValueError
from mpx.collectives.handle import Handle

__all__ = [
    "BACKEND_NAME",
    "MPXProcessGroup",
    "MPXWork",
    "init_process_group",
    "register_torch_backend",
]

BACKEND_NAME = "mpx"

_REDUCE_OPS = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.AVG: "avg",
    dist.ReduceOp.MAX: "max",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.PRODUCT: "prod",
}


def _op_name(reduce_op: Any) -> str:
    for key, name in _REDUCE_OPS.items():
        if reduce_op == key:
            return name
    raise MPXValueError(
        f"reduce op {reduce_op} is not supported by the mpx backend; "
        "use SUM, AVG, MAX, MIN or PRODUCT"
    )


class MPXWork(dist.Work):
    """A ``dist.Work`` over mpx handles; ``then`` runs when they complete."""

    def __init__(
        self, handles: list[Handle[Any]], result: list[torch.Tensor], then: Any = None
    ) -> None:
        super().__init__()
        self._handles = handles
        self._result = result
        self._then = then
        self._finished = False

    def _finish(self) -> None:
        if not self._finished:
            for handle in self._handles:
                handle.wait()
            if self._then is not None:
                self._then()
            self._finished = True

    def is_completed(self) -> bool:
        return self._finished or all(handle.done() for handle in self._handles)

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._finish()
        return True

    def result(self) -> list[torch.Tensor]:
        self._finish()
        return self._result

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        # No progress thread yet: the future is completed here, so work
        # chained on it (DDP's bucket hooks) sees the reduced tensors.
        self._finish()
        future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        future.set_result(self._result)
        return future


class MPXProcessGroup(dist.ProcessGroup):
    """The ``"mpx"`` process group: torch collectives on an mpx :class:`Communicator`.

    Example::

        init_process_group()                       # or dist.init_process_group("mpx")
        model = DistributedDataParallel(model)     # gradients averaged by mpx
        dist.all_reduce(t)
    """

    def __init__(self, comm: Communicator) -> None:
        super().__init__(comm.rank, comm.size)  # type: ignore[call-arg]
        self.comm = comm

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> MPXWork:  # type: ignore[override]
        op = _op_name(opts.reduceOp) if opts is not None else "sum"
        handles = [ops.allreduce(t, op, comm=self.comm, async_op=True) for t in tensors]
        return MPXWork(handles, tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> MPXWork:  # type: ignore[override]
        root = opts.rootRank if opts is not None else 0
        handles = [ops.broadcast(t, root, comm=self.comm, async_op=True) for t in tensors]
        return MPXWork(handles, tensors)

    def allgather(  # type: ignore[override]
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> MPXWork:
        handles = [ops.allgather(t, comm=self.comm, async_op=True) for t in inputs]

        def scatter_rows() -> None:
            for handle, outputs in zip(handles, output_lists, strict=True):
                stacked = handle.wait()
                for row, out in zip(stacked, outputs, strict=True):
                    out.copy_(row)

        return MPXWork(handles, [t for outs in output_lists for t in outs], scatter_rows)

    def _allgather_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> MPXWork:
        handle = ops.allgather(input, comm=self.comm, async_op=True)
        return MPXWork([handle], [output], lambda: output.view(-1).copy_(handle.wait().view(-1)))

    def reduce_scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> MPXWork:
        op = _op_name(opts.reduceOp) if opts is not None else "sum"
        handles = [
            ops.reduce_scatter(torch.stack(inputs), op, comm=self.comm, async_op=True)
            for inputs in input_lists
        ]

        def copy_out() -> None:
            for handle, out in zip(handles, outputs, strict=True):
                out.copy_(handle.wait()[0])

        return MPXWork(handles, outputs, copy_out)

    def barrier(self, opts: Any = None) -> MPXWork:
        return MPXWork([ops.barrier(comm=self.comm, async_op=True)], [])


def _create(store: Any, rank: int, world_size: int, timeout: timedelta) -> MPXProcessGroup:
    comm = world()
    if (rank, world_size) != (comm.rank, comm.size):
        raise MPXValueError(
            f"torch asked for rank {rank} of {world_size}, but MPI says rank {comm.rank} of "
            f"{comm.size}; start the job with mpxrun/mpiexec and let mpx.collectives."
            "init_process_group() pass MPI's rank and size"
        )
    return MPXProcessGroup(comm)


def register_torch_backend() -> None:
    """Registers ``"mpx"`` with ``torch.distributed`` (idempotent)."""
    if BACKEND_NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu", "cuda"])


def init_process_group(init_method: str | None = None) -> None:
    """``dist.init_process_group("mpx")`` with MPI's rank and size.

    Args:
        init_method: None for a process-local store (no TCP rendezvous needed;
            enough for every collective on the default group), or
            ``"env://"`` when other groups (``dist.new_group(backend="gloo")``)
            must rendezvous too (see ``mpx.launch.init_torch_env``).
    """
    register_torch_backend()
    comm = world()
    if init_method is None:
        dist.init_process_group(
            BACKEND_NAME,
            rank=comm.rank,
            world_size=comm.size,
            store=dist.HashStore(),  # type: ignore[attr-defined]
        )
    else:
        dist.init_process_group(
            BACKEND_NAME, init_method=init_method, rank=comm.rank, world_size=comm.size
        )
