"""``impl="shm"``: ranks of one node reduce straight in shared memory.

Each rank owns two slots of ``MPX_SHM_SLOT_MB`` in an MPI-3 shared window;
every rank can read every slot. Unset, a slot is 2 MiB when each of the node's
ranks has a core, so that a piece's copy in, reduction and copy out stay in the
cache (64 MiB on 2 ranks: 7.9 ms against 14.4 ms with 16 MiB slots), and 16 MiB
when ranks outnumber cores, where every barrier costs a context switch and
fewer pieces win (3 ranks on 2 cores: 30 ms against 38 ms). A tensor is processed in pieces of
one slot; piece k uses buffer k % 2, so a rank may fill the next buffer while
a slow peer still reads the last one (two barriers per piece, none extra)::

    window:  rank 0: [buf 0 | buf 1]  rank 1: [buf 0 | buf 1]  rank 2: [...]
    piece (P = 3), chunk j of the piece is owned by rank j:

    1. copy in    rank r writes the chunks it does NOT own into its slot
    2. barrier
    3. reduce     rank r: own chunk of its tensor + chunk r of every peer's
                  slot -> result into its own slot (chunk r) and its tensor
    4. barrier
    5. copy out   rank r copies chunk j of rank j's slot, for every j != r

Per rank that is one read of the peers' data and one copy in and out of the
chunks others own: no staging of the whole tensor. 16-bit floats accumulate
in float32. Broadcast and allgather use the same slots: the root (or every
rank) copies in, a barrier, everyone copies out.

Zero copy: a tensor allocated by :func:`mpx.collectives.empty_shared` is
itself readable by the peers, so step 1 is skipped and step 3 writes in place.
Before each piece's first barrier every rank *publishes* where its data is (a
slot, or a shared window and offset) in a small shared descriptor table, so
ranks with shared and ordinary tensors mix freely. A last barrier keeps a
rank from changing its (peer-readable) tensor before the peers have copied
its result out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, cast

import numpy as np
import torch
from mpi4py import MPI

from mpx.collectives import settings
from mpx.collectives.base import Pending, Requests, Steps, accumulation_dtype, combine, reduce_into
from mpx.collectives.core import Communicator, SharedBuffers
from mpx.collectives.core import current_policy as current
from mpx.collectives.node import shm_flags

__all__ = [
    "Slots",
    "Workspace",
    "allgather",
    "allreduce",
    "broadcast",
    "segment",
    "slot_bytes",
    "slotted_allreduce",
    "slotted_broadcast",
]

_ALIGN = 64
_CACHED_SLOT = 2 << 20  # a piece of each rank's share stays in L2/L3 through its three passes


def slot_bytes(oversubscribed: bool = True) -> int:
    """Bytes per slot: ``MPX_SHM_SLOT_MB`` where set; else 2 MiB, or the
    setting's default (16 MiB) where the host's ranks outnumber its cores
    (``oversubscribed``: the communicator waits yielding, ``Communicator.yielding``)."""
    chosen = settings.SHM_SLOT.get()
    if not settings.SHM_SLOT.is_set() and not oversubscribed:
        chosen = _CACHED_SLOT
    return chosen // _ALIGN * _ALIGN


class Workspace:
    """The shared window of one communicator: two slots per rank.

    Example::

        ws = yield from Workspace.ready(comm)   # inside an operation's steps
        mine = ws.slot(comm.rank, 0, torch.float32)
    """

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.bytes = slot_bytes(comm.yielding)
        self.win = MPI.Win.Allocate_shared(2 * self.bytes, 1, comm=comm.mpi)
        self._raw: list[torch.Tensor] = []
        for r in range(comm.size):
            buffer, _ = self.win.Shared_query(r)
            self._raw.append(torch.frombuffer(buffer, dtype=torch.uint8, count=2 * self.bytes))
        # Touch our own pages now, not inside the first timed collective.
        self._raw[comm.rank].zero_()
        # Descriptor table: [rank, buf] -> (shared window index or -1 for the slot, offset).
        self._table_win = MPI.Win.Allocate_shared(
            comm.size * 2 * 2 * 8 if comm.rank == 0 else 0, 8, comm=comm.mpi
        )
        table, _ = self._table_win.Shared_query(0)
        self._table = np.ndarray((comm.size, 2, 2), dtype=np.int64, buffer=cast(Any, table))
        self.shared = SharedBuffers.of(comm)
        self.calls = 0
        comm.mpi.Barrier()

    @classmethod
    def ready(cls, comm: Communicator) -> Steps[Workspace]:
        """The communicator's workspace; the first call creates it (collective).

        ``MPI.Win.Allocate_shared`` blocks until every rank has called it and
        cannot be timed out, so a peer that never arrives would hang the first
        ``shm`` call past its ``timeout=``. Every rank therefore first arrives
        at a non-blocking barrier, which the handle polls under the deadline
        (a timeout names the ranks that did not arrive); only then, with every
        rank known to be here, are the windows allocated.
        """
        found = comm.cached("shm")
        if isinstance(found, Workspace):
            return found
        yield Requests([comm.mpi.Ibarrier()])
        return comm.cache("shm", cls(comm))

    def slot(self, rank: int, buf: int, dtype: torch.dtype) -> torch.Tensor:
        """Rank ``rank``'s slot ``buf`` (0 or 1) viewed as ``dtype``."""
        raw = self._raw[rank][buf * self.bytes : (buf + 1) * self.bytes]
        return raw.view(dtype)

    def barrier(self) -> Requests:
        return Requests([self.comm.mpi.Ibarrier()])

    def local(self, x: torch.Tensor) -> torch.Tensor:
        return x  # host shared memory: readable in place

    def publish(self, rank: int, buf: int, piece: torch.Tensor) -> bool:
        """Records where ``piece`` (this rank's data) is; True if peers can read it in place."""
        found = self.shared.locate(piece)
        entry = self._table[rank, buf]
        if found is None:
            entry[0] = -1
            return False
        entry[0], entry[1] = found
        return True

    def source(self, rank: int, buf: int, dtype: torch.dtype, n: int) -> torch.Tensor:
        """The ``n`` elements that rank ``rank`` published for buffer ``buf``."""
        window, offset = (int(x) for x in self._table[rank, buf])
        if window < 0:
            return self.slot(rank, buf, dtype)[:n]
        nbytes = n * torch.empty(0, dtype=dtype).element_size()
        return self.shared.peer_bytes(window, rank)[offset : offset + nbytes].view(dtype)

    def free(self) -> None:
        self._raw.clear()
        self.win.Free()
        self._table_win.Free()


def segment(n: int, parts: int, i: int) -> tuple[int, int]:
    """Bounds of part ``i`` of ``n`` elements cut into ``parts`` near-equal parts."""
    return i * n // parts, (i + 1) * n // parts


class Slots(Protocol):
    """What the slot algorithms need of a workspace (host shared memory, or CUDA IPC)."""

    bytes: int
    calls: int

    def slot(self, rank: int, buf: int, dtype: torch.dtype) -> torch.Tensor: ...

    def barrier(self) -> Pending: ...

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (a peer's slot) where this rank can compute with it."""
        ...

    def publish(self, rank: int, buf: int, piece: torch.Tensor) -> bool: ...

    def source(self, rank: int, buf: int, dtype: torch.dtype, n: int) -> torch.Tensor: ...


def slotted_allreduce(
    ws: Slots,
    rank: int,
    size: int,
    t: torch.Tensor,
    op: str,
    across: Callable[[torch.Tensor], Steps[torch.Tensor]] | None = None,
    divisor: int | None = None,
) -> Steps[torch.Tensor]:
    """The allreduce of the module docstring over any workspace of slots.

    Args:
        across: run on this rank's reduced chunk before it is published (the
            hierarchical implementation reduces it across nodes there); reduces
            in place.
        divisor: what ``avg`` divides by (the number of ranks, ``size`` by default).
    """
    p, me = size, rank
    flat = t.reshape(-1)
    acc_dtype = accumulation_dtype(t.dtype)
    per_piece = ws.bytes // t.element_size()
    for start in range(0, flat.numel(), per_piece):
        piece = flat[start : start + per_piece]
        n = piece.numel()
        buf = ws.calls % 2
        ws.calls += 1
        in_place = ws.publish(me, buf, piece)
        mine = piece if in_place else ws.slot(me, buf, t.dtype)
        if not in_place:
            for j in range(p):
                if j != me:
                    lo, hi = segment(n, p, j)
                    mine[lo:hi].copy_(piece[lo:hi])
        yield ws.barrier()
        lo, hi = segment(n, p, me)
        peers = [ws.local(ws.source(j, buf, t.dtype, n)[lo:hi]) for j in range(p) if j != me]
        if acc_dtype == t.dtype:
            # Reduce straight into the published place: own chunk (op) first peer, one pass.
            acc = mine[lo:hi]
            combine(piece[lo:hi], peers[0], op, out=acc)
        else:
            acc = piece[lo:hi].to(acc_dtype)
            reduce_into(acc, peers[0], op)
        for other in peers[1:]:
            reduce_into(acc, other, op)
        if across is not None and acc.numel():
            acc = yield from across(acc)
        if op == "avg":
            acc.div_(divisor or p)
        if acc_dtype != t.dtype:
            mine[lo:hi].copy_(acc)
        if not in_place:
            piece[lo:hi].copy_(mine[lo:hi])
        yield ws.barrier()
        for j in range(p):
            if j != me:
                lo, hi = segment(n, p, j)
                piece[lo:hi].copy_(ws.source(j, buf, t.dtype, n)[lo:hi])
    # Peers may still be copying our result out of our (possibly shared) tensor.
    yield ws.barrier()
    return t


def slotted_broadcast(ws: Slots, rank: int, t: torch.Tensor, root: int) -> Steps[torch.Tensor]:
    """Root publishes each piece (its slot, or its shared tensor in place); everyone copies it."""
    flat = t.reshape(-1)
    per_piece = ws.bytes // t.element_size()
    for start in range(0, flat.numel(), per_piece):
        piece = flat[start : start + per_piece]
        buf = ws.calls % 2
        ws.calls += 1
        if rank == root and not ws.publish(root, buf, piece):
            ws.slot(root, buf, t.dtype)[: piece.numel()].copy_(piece)
        yield ws.barrier()
        if rank != root:
            piece.copy_(ws.source(root, buf, t.dtype, piece.numel()))
    # The root's tensor may be read in place: it must outlive the peers' copies.
    yield ws.barrier()
    return t


def allreduce(comm: Communicator, t: torch.Tensor, op: str) -> Steps[torch.Tensor]:
    if comm.size == 1 or t.numel() == 0:
        return t.div_(1) if op == "avg" else t
    limit = current().flag_bytes
    if shm_flags.takes(comm.size, comm.single_node, t.dtype, op, t.nbytes, limit):
        # A small sum: flags, one wait (shm_flags; the fast path runs the same protocol)
        return (yield from shm_flags.allreduce(comm, t, op))
    ws = yield from Workspace.ready(comm)
    return (yield from slotted_allreduce(ws, comm.rank, comm.size, t, op))


def broadcast(comm: Communicator, t: torch.Tensor, root: int) -> Steps[torch.Tensor]:
    ws = yield from Workspace.ready(comm)
    return (yield from slotted_broadcast(ws, comm.rank, t, root))


def allgather(comm: Communicator, t: torch.Tensor) -> Steps[torch.Tensor]:
    ws = yield from Workspace.ready(comm)
    out = torch.empty((comm.size, *t.shape), dtype=t.dtype)
    flat, outs = t.reshape(-1), out.view(comm.size, -1)
    outs[comm.rank].copy_(flat)
    per_piece = ws.bytes // t.element_size()
    for start in range(0, flat.numel(), per_piece):
        stop = min(start + per_piece, flat.numel())
        buf = ws.calls % 2
        ws.calls += 1
        ws.slot(comm.rank, buf, t.dtype)[: stop - start].copy_(flat[start:stop])
        yield ws.barrier()
        for j in range(comm.size):
            if j != comm.rank:
                outs[j, start:stop].copy_(ws.slot(j, buf, t.dtype)[: stop - start])
    return out
