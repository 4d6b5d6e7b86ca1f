"""``impl="mpi"``: the MPI library's own collectives.

Every call is MPI's non-blocking variant (``MPI_Iallreduce`` ...), waited on
by the handle: MPI does not match a blocking collective on one rank with a
non-blocking one on another, so sync and async calls must be the same call.
Tensors go to MPI as numpy views of their memory (no copy). Reductions of
float16 and bfloat16 run on a float32 copy, rounded back once (MPI has no
bfloat16, and MPICH's float16 sum is slow and rounds at every step:
:mod:`mpx.collectives.base.dtypes`). Floating ``max`` and ``min`` reduce with
numpy's NaN-propagating ``np.maximum``/``np.minimum`` (:func:`mpi_op`), not
MPI's own MAX/MIN. CUDA tensors are passed to MPI only when
the user declares the MPI CUDA-aware (``MPX_CUDA_AWARE=1``); otherwise the
``staged`` implementation carries them through host memory.
"""

from __future__ import annotations

from typing import Any

import torch
from mpi4py import MPI

from mpx.collectives.base import MPXValueError, Requests, Steps, mpi_reduces, numpy_view, wire_view
from mpx.collectives.core import Communicator, mpi_op
from mpx.collectives.core import current_policy as current

__all__ = [
    "allgather",
    "allreduce",
    "alltoall",
    "barrier",
    "broadcast",
    "cuda_aware",
    "recv",
    "reduce",
    "reduce_scatter",
    "send",
]


def cuda_aware() -> bool:
    """Whether CUDA buffers may be given to MPI (``MPX_CUDA_AWARE=1``, in the policy)."""
    return current().cuda_aware


def _buf(t: torch.Tensor) -> Any:
    if t.is_cuda:
        # MPI reads device memory outside torch's stream order.
        torch.cuda.current_stream(t.device).synchronize()
        return wire_view(t.detach())
    return numpy_view(t)


def _reducible(t: torch.Tensor, op: str) -> tuple[torch.Tensor, MPI.Op]:
    """What MPI reduces for ``t``, and with which op: ``t`` itself, or a float32 copy for
    the 16-bit floats (see ``mpi_reduces``); a CUDA tensor whose op is numpy's
    (:func:`mpi_op`) goes as a host copy, since numpy reads host memory only."""
    work = t if mpi_reduces(t.dtype) else t.to(torch.float32)
    mpi = mpi_op(op, work.dtype)
    if work.is_cuda and not mpi.is_predefined:
        work = work.cpu()
    return work, mpi


def _finish(t: torch.Tensor, work: torch.Tensor, op: str, size: int) -> torch.Tensor:
    if op == "avg":
        work.div_(size)
    if work is not t:
        t.copy_(work)
    return t


def allreduce(comm: Communicator, t: torch.Tensor, op: str) -> Steps[torch.Tensor]:
    work, mpi = _reducible(t, op)
    buf = _buf(work)
    yield Requests([comm.mpi.Iallreduce(MPI.IN_PLACE, buf, op=mpi)])
    return _finish(t, work, op, comm.size)


def broadcast(comm: Communicator, t: torch.Tensor, root: int) -> Steps[torch.Tensor]:
    buf = _buf(t)
    yield Requests([comm.mpi.Ibcast(buf, root=root)], peers=[root])
    return t


def reduce(comm: Communicator, t: torch.Tensor, root: int, op: str) -> Steps[torch.Tensor]:
    work, mpi = _reducible(t, op)
    buf = _buf(work)
    send, recv = (MPI.IN_PLACE, buf) if comm.rank == root else (buf, None)
    yield Requests([comm.mpi.Ireduce(send, recv, op=mpi, root=root)])
    return _finish(t, work, op, comm.size) if comm.rank == root else t


def allgather(comm: Communicator, t: torch.Tensor) -> Steps[torch.Tensor]:
    out = torch.empty((comm.size, *t.shape), dtype=t.dtype, device=t.device)
    send, recv = _buf(t), _buf(out)
    yield Requests([comm.mpi.Iallgather(send, recv)])
    return out


def reduce_scatter(comm: Communicator, t: torch.Tensor, op: str) -> Steps[torch.Tensor]:
    work, mpi = _reducible(t, op)
    shape = (t.shape[0] // comm.size, *t.shape[1:])
    out = torch.empty(shape, dtype=work.dtype, device=work.device)
    send, recv = _buf(work), _buf(out)
    yield Requests([comm.mpi.Ireduce_scatter_block(send, recv, op=mpi)])
    if op == "avg":
        out.div_(comm.size)
    return out.to(t.device, t.dtype)


def alltoall(comm: Communicator, t: torch.Tensor) -> Steps[torch.Tensor]:
    out = torch.empty_like(t)
    send, recv = _buf(t), _buf(out)
    yield Requests([comm.mpi.Ialltoall(send, recv)])
    return out


def send(comm: Communicator, t: torch.Tensor, dest: int, tag: int) -> Steps[None]:
    buf = _buf(t)
    yield Requests([comm.mpi.Isend(buf, dest=dest, tag=tag)], peers=[dest])


def truncated(error: MPI.Exception, t: torch.Tensor, where: str) -> Exception:
    """A receive's MPI ``error``, as the clear error it means where the message was
    longer than the buffer ``t`` (``where``: "rank 1, tag 3")."""
    if error.Get_error_class() != MPI.ERR_TRUNCATE:
        return error
    return MPXValueError(
        f"recv: the message from {where} is larger than the receive buffer "
        f"({str(t.dtype).replace('torch.', '')}{list(t.shape)}, {t.numel() * t.element_size()}"
        " bytes); receive into a tensor of the shape and dtype the sender sent"
    )


class _Receive(Requests):
    """A receive whose message is longer than its buffer raises a clear error, not MPI's."""

    __slots__ = ("tensor", "where")

    def __init__(self, request: MPI.Request, t: torch.Tensor, source: int, tag: int) -> None:
        super().__init__([request], peers=[source])
        self.tensor = t
        self.where = f"rank {source}, tag {tag}"

    def _truncated(self, error: MPI.Exception) -> Exception:
        return truncated(error, self.tensor, self.where)

    def test(self) -> bool:
        try:
            return super().test()
        except MPI.Exception as error:
            raise self._truncated(error) from None

    def wait(self) -> None:
        try:
            super().wait()
        except MPI.Exception as error:
            raise self._truncated(error) from None


def recv(comm: Communicator, t: torch.Tensor, source: int, tag: int) -> Steps[torch.Tensor]:
    buf = _buf(t)
    yield _Receive(comm.mpi.Irecv(buf, source=source, tag=tag), t, source, tag)
    return t


def barrier(comm: Communicator) -> Steps[None]:
    yield Requests([comm.mpi.Ibarrier()])
