"""``impl="staged"``: CUDA tensors carried through pinned host memory, in overlapped chunks.

MPI wheels are not CUDA-aware, so device data must visit the host. Staging
the whole tensor would serialise three long phases; instead the tensor is cut
into chunks of ``MPX_STAGED_CHUNK_MB`` (4 MiB) and each chunk's copies run on
a side stream while the host reduces its neighbour::

    chunk      0          1          2          3
    D2H      [===]      [===]      [===]      [===]
    host           [reduce 0] [reduce 1] [reduce 2] [reduce 3]
    H2D                  [===]      [===]      [===]      [===]

Two pinned buffers alternate; a buffer is refilled only after its previous
chunk has gone back to the device. The host step is the host implementation
``auto`` would pick for the chunk (shm on one node, hier or ring across
nodes, MPI's own for small chunks). The result is complete on the device when
the operation is: the caller's stream may use it at once.

Point-to-point (send/recv) and the remaining collectives go through one
pinned copy of the whole tensor, then MPI.
"""

from __future__ import annotations

from typing import Any

import torch

from mpx.collectives import settings
from mpx.collectives.base import MPXValueError, Pending, Steps
from mpx.collectives.core import Communicator, choose
from mpx.collectives.impl import hier as impl_hier
from mpx.collectives.impl import mpi as impl_mpi
from mpx.collectives.impl import ring as impl_ring
from mpx.collectives.impl import shm as impl_shm

__all__ = [
    "CudaEvent",
    "allgather",
    "allreduce",
    "alltoall",
    "broadcast",
    "chunk_bytes",
    "recv",
    "reduce",
    "reduce_scatter",
    "send",
]


def chunk_bytes() -> int:
    """Bytes per staged chunk (``MPX_STAGED_CHUNK_MB``, default 4 MiB)."""
    return settings.STAGED_CHUNK.get()


class CudaEvent(Pending):
    """Waits for work queued on a CUDA stream up to an event."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def test(self) -> bool:
        return bool(self.event.query())  # type: ignore[no-untyped-call]

    def wait(self) -> None:
        self.event.synchronize()


# The host algorithms a staged chunk may take (the policy picks among them).
_HOST = {"mpi": impl_mpi, "shm": impl_shm, "hier": impl_hier, "ring": impl_ring}


def _host_impl(
    op: str, comm: Communicator, nbytes: int, dtype: torch.dtype, reduce_op: str = ""
) -> Any:
    """The host algorithm for one staged chunk: what the policy picks for a CPU tensor
    (of the chunk's dtype and reduce op: one whose declarations decline it is passed by)."""
    return _HOST.get(choose(op, False, nbytes, comm, None, dtype, reduce_op), impl_mpi)


class _Stager:
    """Pinned host buffers and a copy stream for one device (cached per communicator)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self.bytes = chunk_bytes()
        self.buffers = [torch.empty(self.bytes, dtype=torch.uint8).pin_memory() for _ in range(2)]

    @classmethod
    def of(cls, comm: Communicator, device: torch.device) -> _Stager:
        key = f"staged:{device}"
        found = comm.cached(key)
        return found if isinstance(found, _Stager) else comm.cache(key, cls(device))

    def record(self) -> torch.cuda.Event:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self.stream)
        return event


def _check_cuda(t: torch.Tensor, op: str) -> None:
    if not t.is_cuda:
        raise MPXValueError(
            f"{op}: impl='staged' takes CUDA tensors, got one on {t.device}; "
            "use impl='auto' for other tensors"
        )


def _chunked(
    comm: Communicator, t: torch.Tensor, host_step: Any, copy_in: bool, copy_out: bool
) -> Steps[torch.Tensor]:
    """The pipeline of the module docstring; ``host_step(host_chunk)`` is a Steps generator."""
    stager = _Stager.of(comm, t.device)
    flat = t.reshape(-1)
    per_chunk = stager.bytes // t.element_size()
    bounds = [(a, min(a + per_chunk, flat.numel())) for a in range(0, flat.numel(), per_chunk)]
    host = [b[: stager.bytes].view(t.dtype) for b in stager.buffers]
    copied_in: list[torch.cuda.Event | None] = [None] * len(bounds)
    copied_out: list[torch.cuda.Event | None] = [None] * len(bounds)
    # The side stream must see everything the caller queued before this call.
    stager.stream.wait_stream(torch.cuda.current_stream(t.device))

    def start_copy_in(i: int) -> None:
        a, b = bounds[i]
        with torch.cuda.stream(stager.stream):
            if copy_in:
                host[i % 2][: b - a].copy_(flat[a:b], non_blocking=True)
            copied_in[i] = stager.record()

    start_copy_in(0)
    for i, (a, b) in enumerate(bounds):
        if i + 1 < len(bounds):
            if i >= 1:  # buffer (i+1) % 2 held chunk i-1: it must be back on the device
                done = copied_out[i - 1]
                assert done is not None
                yield CudaEvent(done)
            start_copy_in(i + 1)
        event = copied_in[i]
        assert event is not None
        yield CudaEvent(event)
        yield from host_step(host[i % 2][: b - a])
        with torch.cuda.stream(stager.stream):
            if copy_out:
                flat[a:b].copy_(host[i % 2][: b - a], non_blocking=True)
            copied_out[i] = stager.record()
    if bounds:
        last = copied_out[-1]
        assert last is not None
        yield CudaEvent(last)
    torch.cuda.current_stream(t.device).wait_stream(stager.stream)
    return t


def allreduce(comm: Communicator, t: torch.Tensor, op: str) -> Steps[torch.Tensor]:
    _check_cuda(t, "allreduce")
    if comm.size == 1 or t.numel() == 0:
        return t.div_(1) if op == "avg" else t
    nbytes = min(t.numel() * t.element_size(), chunk_bytes())
    impl = _host_impl("allreduce", comm, nbytes, t.dtype, op)
    return (yield from _chunked(comm, t, lambda h: impl.allreduce(comm, h, op), True, True))


def broadcast(comm: Communicator, t: torch.Tensor, root: int) -> Steps[torch.Tensor]:
    _check_cuda(t, "broadcast")
    if comm.size == 1 or t.numel() == 0:
        return t
    nbytes = min(t.numel() * t.element_size(), chunk_bytes())
    impl = _host_impl("broadcast", comm, nbytes, t.dtype)
    is_root = comm.rank == root
    return (
        yield from _chunked(
            comm, t, lambda h: impl.broadcast(comm, h, root), copy_in=is_root, copy_out=not is_root
        )
    )


# -- whole-tensor staging for the rest ---------------------------------------------


def _to_host(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype).pin_memory()
    host.copy_(t)  # synchronous w.r.t. the current stream
    return host


def allgather(comm: Communicator, t: torch.Tensor) -> Steps[torch.Tensor]:
    _check_cuda(t, "allgather")
    out = yield from impl_mpi.allgather(comm, _to_host(t))
    return out.to(t.device)


def reduce(comm: Communicator, t: torch.Tensor, root: int, op: str) -> Steps[torch.Tensor]:
    _check_cuda(t, "reduce")
    host = yield from impl_mpi.reduce(comm, _to_host(t), root, op)
    if comm.rank == root:
        t.copy_(host)
    return t


def reduce_scatter(comm: Communicator, t: torch.Tensor, op: str) -> Steps[torch.Tensor]:
    _check_cuda(t, "reduce_scatter")
    out = yield from impl_mpi.reduce_scatter(comm, _to_host(t), op)
    return out.to(t.device)


def alltoall(comm: Communicator, t: torch.Tensor) -> Steps[torch.Tensor]:
    _check_cuda(t, "alltoall")
    out = yield from impl_mpi.alltoall(comm, _to_host(t))
    return out.to(t.device)


def send(comm: Communicator, t: torch.Tensor, dest: int, tag: int) -> Steps[None]:
    _check_cuda(t, "send")
    yield from impl_mpi.send(comm, _to_host(t), dest, tag)


def recv(comm: Communicator, t: torch.Tensor, source: int, tag: int) -> Steps[torch.Tensor]:
    _check_cuda(t, "recv")
    host = torch.empty(t.shape, dtype=t.dtype).pin_memory()
    yield from impl_mpi.recv(comm, host, source, tag)
    t.copy_(host)
    return t
