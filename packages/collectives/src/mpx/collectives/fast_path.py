"""Small blocking CPU collectives straight to MPI: no generator, no handle.

A 4 KiB allreduce costs MPI about 4.7 µs (``MPI_Iallreduce`` + wait). The
general path -- checks, ``auto`` selection, a generator driven by the
communicator -- adds about 4 µs of Python to that. A call that would end as
that one MPI call anyway takes this path instead::

    allreduce(t) / broadcast(t, root)
      blocking, no timeout=, no MPX_CHECK          no --> general path
      plain contiguous CPU tensor, MPI dtype,      no --> general path
        not requiring grad, not empty
      the policy chooses "mpi" for it              no --> general path
        (policy.choose: the same decision, cached)
      communicator: no deadline, nothing queued    no --> general path
      --> MPI_Iallreduce / MPI_Ibcast on the tensor's memory, wait

It makes the same non-blocking MPI call as ``impl="mpi"`` (MPI never matches a
blocking collective with a non-blocking one, so a rank on this path still
meets a rank that called with ``async_op=True``), in the same FIFO order.
Whatever it does not take, including every bad argument, goes to the general
path, which raises the errors.
"""

from __future__ import annotations

import torch
from mpi4py import MPI

from mpx.collectives.communicator import Communicator, world
from mpx.collectives.dtypes import SUPPORTED_DTYPES
from mpx.collectives.impl_mpi import MPI_OPS
from mpx.collectives.policy import choose, current

__all__ = ["allreduce", "broadcast"]

# Supported dtypes that MPI reduces natively, with their MPI datatypes
# (float16 and bfloat16 need the general path's float32 detour; the rest of
# torch's dtypes get the general path's error).
_MPI_TYPES: dict[torch.dtype, MPI.Datatype] = {
    dtype: kind
    for dtype, kind in (
        (torch.float32, MPI.FLOAT),
        (torch.float64, MPI.DOUBLE),
        (torch.int8, MPI.INT8_T),
        (torch.int32, MPI.INT32_T),
        (torch.int64, MPI.INT64_T),
        (torch.uint8, MPI.UINT8_T),
    )
    if dtype in SUPPORTED_DTYPES
}


def _spec(t: object) -> list[object] | None:
    """``[buffer, datatype]`` over ``t``'s memory, or None if the fast path can't take it."""
    if type(t) is not torch.Tensor or not t.is_cpu or t.requires_grad or not t.is_contiguous():
        return None
    kind = _MPI_TYPES.get(t.dtype)
    nbytes = t.nbytes
    if kind is None or nbytes == 0:
        return None
    return [MPI.buffer.fromaddress(t.data_ptr(), nbytes), kind]


def _eligible(op: str, comm: Communicator, nbytes: int, impl: str | None) -> bool:
    if current().check:
        return False
    return choose(op, False, nbytes, comm, impl).name == "mpi"


def allreduce(t: torch.Tensor, op: str, comm: Communicator | None, impl: str | None) -> bool:
    """Runs a small blocking allreduce; False (nothing done) if it is not one."""
    mpi_op = MPI_OPS.get(op)
    spec = _spec(t)
    if mpi_op is None or spec is None or (op == "avg" and not t.is_floating_point()):
        return False
    comm = world() if comm is None else comm
    if not _eligible("allreduce", comm, t.nbytes, impl):
        return False
    if not comm.run_now(lambda: comm.mpi.Iallreduce(MPI.IN_PLACE, spec, op=mpi_op)):
        return False
    if op == "avg":
        t.div_(comm.size)
    return True


def broadcast(t: torch.Tensor, root: int, comm: Communicator | None, impl: str | None) -> bool:
    """Runs a small blocking broadcast; False (nothing done) if it is not one."""
    spec = _spec(t)
    if spec is None or type(root) is not int:
        return False
    comm = world() if comm is None else comm
    if not 0 <= root < comm.size or not _eligible("broadcast", comm, t.nbytes, impl):
        return False
    return comm.run_now(lambda: comm.mpi.Ibcast(spec, root=root))
