"""``impl="ring"``: bandwidth-optimal ring algorithms on MPI Isend/Irecv.

Allreduce is a reduce-scatter followed by an allgather around the ring, each
rank moving 2(P-1)/P of the data. The flat tensor is cut into P segments, and
every segment into chunks of ``MPX_RING_CHUNK_BYTES`` (1 MiB) so that the
reduction of one chunk overlaps the transfer of the next::

    P = 3, segments a b c; step s: rank r sends segment r-s, receives r-s-1

    step        rank 0         rank 1         rank 2
    RS s=0      a ->  <- c     b ->  <- a     c ->  <- b     (add received)
    RS s=1      c ->  <- b     a ->  <- c     b ->  <- a     (add: now owns b / c / a)
    AG s=0..1   pass the owned, fully reduced segment on; copy what arrives

Broadcast is a chunked pipeline along the ring starting at the root.
Collectives of one communicator run one at a time, in the same order on
every rank (see :class:`mpx.collectives.base.handle.Queue`); their messages travel
on the communicator's private ``collective_mpi``, tagged with a count of the
collectives started, so they never meet the user's own send/recv.
"""

from __future__ import annotations

import torch
from mpi4py import MPI

from mpx.collectives import settings
from mpx.collectives.base import Requests, Steps, finish, numpy_view, reduce_into, working_copy
from mpx.collectives.core import Communicator

__all__ = ["allgather", "allreduce", "broadcast", "chunk_bytes", "reduce_scatter"]

_TAG_RANGE = 32767  # MPI guarantees at least this tag upper bound


def chunk_bytes() -> int:
    """Bytes per in-flight chunk (``MPX_RING_CHUNK_BYTES``, default 1 MiB)."""
    return settings.RING_CHUNK.get()


def _tag(comm: Communicator) -> int:
    """A fresh tag; called when the operation starts, in the same order on every rank."""
    comm.collective_count += 1
    return comm.collective_count % _TAG_RANGE


def _segment(n: int, parts: int, i: int) -> tuple[int, int]:
    return i * n // parts, (i + 1) * n // parts


def _chunks(lo: int, hi: int, step: int) -> list[tuple[int, int]]:
    return [(a, min(a + step, hi)) for a in range(lo, hi, step)] or [(lo, hi)]


def _reduce_scatter(
    comm: Communicator, x: torch.Tensor, op: str, shift: int, tag: int
) -> Steps[None]:
    """Ring reduce-scatter in place on flat ``x``; rank r ends owning segment (r+1+shift) % P."""
    p, rank, n = comm.size, comm.rank, x.numel()
    left, right = (rank - 1) % p, (rank + 1) % p
    per_chunk = max(1, chunk_bytes() // x.element_size())
    tmp = torch.empty(n // p + 1, dtype=x.dtype)
    xv, tv = numpy_view(x), numpy_view(tmp)
    for s in range(p - 1):
        s_lo, s_hi = _segment(n, p, (rank - s + shift) % p)
        r_lo, r_hi = _segment(n, p, (rank - s - 1 + shift) % p)
        recvs = [
            (a, b, comm.collective_mpi.Irecv(tv[a - r_lo : b - r_lo], source=left, tag=tag))
            for a, b in _chunks(r_lo, r_hi, per_chunk)
        ]
        sends = [
            comm.collective_mpi.Isend(xv[a:b], dest=right, tag=tag)
            for a, b in _chunks(s_lo, s_hi, per_chunk)
        ]
        for a, b, request in recvs:
            yield Requests([request], peers=[left])
            reduce_into(x[a:b], tmp[a - r_lo : b - r_lo], op)
        yield Requests(sends, peers=[right])


def _allgather_segments(comm: Communicator, x: torch.Tensor, shift: int, tag: int) -> Steps[None]:
    """Passes each rank's owned segment (r+1+shift) % P around until all have all."""
    p, rank, n = comm.size, comm.rank, x.numel()
    left, right = (rank - 1) % p, (rank + 1) % p
    per_chunk = max(1, chunk_bytes() // x.element_size())
    xv = numpy_view(x)
    for s in range(p - 1):
        s_lo, s_hi = _segment(n, p, (rank + 1 + shift - s) % p)
        r_lo, r_hi = _segment(n, p, (rank + shift - s) % p)
        requests = [
            comm.collective_mpi.Irecv(xv[a:b], source=left, tag=tag)
            for a, b in _chunks(r_lo, r_hi, per_chunk)
        ]
        requests += [
            comm.collective_mpi.Isend(xv[a:b], dest=right, tag=tag)
            for a, b in _chunks(s_lo, s_hi, per_chunk)
        ]
        yield Requests(requests, peers=[left, right])


def allreduce(comm: Communicator, t: torch.Tensor, op: str) -> Steps[torch.Tensor]:
    if comm.size == 1 or t.numel() == 0:
        return finish(t, t.reshape(-1), op, 1)
    tag = _tag(comm)
    work = working_copy(t, op)
    yield from _reduce_scatter(comm, work, op, 0, tag)
    yield from _allgather_segments(comm, work, 0, tag)
    return finish(t, work, op, comm.size)


def reduce_scatter(comm: Communicator, t: torch.Tensor, op: str) -> Steps[torch.Tensor]:
    rows = t.shape[0] // comm.size
    out_shape = (rows, *t.shape[1:])
    work = working_copy(t, op, copy=True)
    if comm.size > 1 and t.numel() > 0:
        # shift -1: rank r ends owning segment r, which is its block of rows.
        yield from _reduce_scatter(comm, work, op, -1, _tag(comm))
    lo, hi = _segment(work.numel(), comm.size, comm.rank)
    mine = work[lo:hi]
    if op == "avg":
        mine.div_(comm.size)
    return mine.to(t.dtype).view(out_shape)


def allgather(comm: Communicator, t: torch.Tensor) -> Steps[torch.Tensor]:
    out = torch.empty((comm.size, *t.shape), dtype=t.dtype)
    out[comm.rank].copy_(t)
    if comm.size > 1 and t.numel() > 0:
        # Segment r of the flat output is rank r's tensor: with shift -1 the
        # owned segment is our own block.
        yield from _allgather_segments(comm, out.view(-1), -1, _tag(comm))
    return out


def broadcast(comm: Communicator, t: torch.Tensor, root: int) -> Steps[torch.Tensor]:
    p = comm.size
    if p == 1 or t.numel() == 0:
        return t
    tag = _tag(comm)
    pos = (comm.rank - root) % p
    left, right = (comm.rank - 1) % p, (comm.rank + 1) % p
    flat = numpy_view(t.reshape(-1))
    per_chunk = max(1, chunk_bytes() // t.element_size())
    chunks = _chunks(0, t.numel(), per_chunk)
    sends: list[MPI.Request] = []
    if pos == 0:
        sends = [comm.collective_mpi.Isend(flat[a:b], dest=right, tag=tag) for a, b in chunks]
    else:
        recvs = [comm.collective_mpi.Irecv(flat[a:b], source=left, tag=tag) for a, b in chunks]
        for (a, b), request in zip(chunks, recvs, strict=True):
            yield Requests([request], peers=[left])
            if pos < p - 1:
                sends.append(comm.collective_mpi.Isend(flat[a:b], dest=right, tag=tag))
    yield Requests(sends, peers=[right])
    return t
