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


# [buffer, datatype] over a tensor's memory, by (address, bytes, datatype):
# a buffer object only names the memory, so one made for a tensor that has
# since died serves a new tensor at the same address as well. Bounded.
_SPECS: dict[tuple[int, int, torch.dtype], list[object]] = {}
_SPECS_LIMIT = 1024


def _spec(t: torch.Tensor, kind: MPI.Datatype, nbytes: int) -> list[object]:
    key = (t.data_ptr(), nbytes, t.dtype)
    spec = _SPECS.get(key)
    if spec is None:
        if len(_SPECS) >= _SPECS_LIMIT:
            _SPECS.clear()
        spec = _SPECS[key] = [MPI.buffer.fromaddress(key[0], nbytes), kind]
    return spec


# The fast path's plan for a call: the MPI datatype, and the MPI op (allreduce).
Plan = tuple[MPI.Datatype, "MPI.Op | None"]


def _plan(
    op: str, reduce_op: str, t: torch.Tensor, comm: Communicator, impl: str | None
) -> Plan | None:
    """What the fast path needs for this (op, dtype, size, impl) on ``comm``, or None.

    Decided once per communicator and policy (cached beside the policy's own
    decisions, so a reloaded policy drops it with them).
    """
    key = (reduce_op, t.dtype, t.nbytes, impl) if op == "allreduce" else (t.dtype, t.nbytes, impl)
    cache = comm.choices
    if cache.policy is current():
        cached: Plan | bool | None = cache.fast.get(key, False)
        if cached is not False and cached is not True:
            return cached
    kind = _MPI_TYPES.get(t.dtype)
    mpi_op = MPI_OPS.get(reduce_op) if op == "allreduce" else None
    plan: Plan | None = None
    if (
        kind is not None
        and t.nbytes > 0
        and (op != "allreduce" or mpi_op is not None)
        and not (reduce_op == "avg" and not t.is_floating_point())
        and not current().check
        and choose(op, False, t.nbytes, comm, impl) == "mpi"
    ):
        plan = (kind, mpi_op)
    cache = comm.choices  # choose() may have renewed it for a new policy
    cache.fast[key] = plan
    return plan


def _takes(t: object) -> bool:
    """A plain, contiguous CPU tensor not requiring grad (anything else: general path)."""
    return type(t) is torch.Tensor and t.is_cpu and not t.requires_grad and t.is_contiguous()


def allreduce(t: torch.Tensor, op: str, comm: Communicator | None, impl: str | None) -> bool:
    """Runs a small blocking allreduce; False (nothing done) if it is not one.

    The common case -- a plan and a buffer already cached -- is written out in
    this one function: each Python call it saves is a tenth of MPI's latency.
    """
    if type(t) is not torch.Tensor or not t.is_cpu or t.requires_grad or not t.is_contiguous():
        return False
    if comm is None:
        comm = world()
    nbytes = t.nbytes
    dtype = t.dtype
    cache = comm.choices
    plan = cache.fast.get((op, dtype, nbytes, impl), False) if cache.policy is current() else False
    if plan is False:
        plan = _plan("allreduce", op, t, comm, impl)
    if plan is None or plan is True:
        return False
    key = (t.data_ptr(), nbytes, dtype)
    spec = _SPECS.get(key)
    if spec is None:
        spec = _spec(t, plan[0], nbytes)
    if not comm.run_now(comm.mpi.Iallreduce, MPI.IN_PLACE, spec, plan[1]):
        return False
    if op == "avg":
        t.div_(comm.size)
    return True


def broadcast(t: torch.Tensor, root: int, comm: Communicator | None, impl: str | None) -> bool:
    """Runs a small blocking broadcast; False (nothing done) if it is not one."""
    if not _takes(t) or type(root) is not int:
        return False
    comm = world() if comm is None else comm
    if not 0 <= root < comm.size:
        return False
    cache = comm.choices
    plan = cache.fast.get((t.dtype, t.nbytes, impl), False) if cache.policy is current() else False
    if plan is False:
        plan = _plan("broadcast", "", t, comm, impl)
    if plan is None or plan is True:
        return False
    return comm.run_now(comm.mpi.Ibcast, _spec(t, plan[0], t.nbytes), root)
