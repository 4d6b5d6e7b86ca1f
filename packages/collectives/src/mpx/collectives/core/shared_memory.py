"""Tensors in node-shared memory: the zero-copy path of ``shm``.

A tensor made by :func:`empty_shared` lives in an MPI-3 shared window, so the
other ranks of the node can read it where it is. ``impl="shm"`` (and ``auto``)
then skips the copy into its staging slots: peers read the chunks they
reduce straight from this rank's tensor, and the owner writes its reduced
chunk in place::

    rank 0 tensor (shared)   [ chunk 0 | chunk 1 ]     rank 1 reads chunk 1 here
    rank 1 tensor (shared)   [ chunk 0 | chunk 1 ]     rank 0 reads chunk 0 here
    reduce in place, barrier, copy the other chunk from its owner, barrier

Per rank that moves 2.5 x the tensor's bytes through memory instead of 4.5 x.
Allocation is collective and symmetric: every rank of the communicator's node
allocates the same number of bytes, in the same order, so a tensor has the
same window and offset on every rank. Ranks that pass ordinary tensors still
work with ranks that pass shared ones (each rank publishes where its data is).
"""

from __future__ import annotations

from typing import Any

import torch
from mpi4py import MPI

from mpx.collectives.base import MismatchError, MPXValueError
from mpx.collectives.core.communicator import CommLike, Communicator, as_communicator

__all__ = ["SharedBuffers", "empty_shared", "free_shared"]


class SharedBuffers:
    """The shared windows allocated for one communicator's node, in creation order.

    Example::

        buffers = SharedBuffers.of(comm)
        t = buffers.allocate(1 << 20, torch.float32)   # collective
        window, offset = buffers.locate(t)
    """

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.windows: list[MPI.Win | None] = []  # None: given back (free_shared)
        self.raw: list[list[torch.Tensor]] = []  # [window][rank] -> uint8 view
        self._bases: list[tuple[int, int]] = []  # this rank's (address, bytes) per window

    @classmethod
    def of(cls, comm: Communicator) -> SharedBuffers:
        found = comm.cached("shared_buffers")
        return (
            found if isinstance(found, SharedBuffers) else comm.cache("shared_buffers", cls(comm))
        )

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        comm = self.comm
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        sizes = comm.mpi.allgather(nbytes)
        if len(set(sizes)) != 1:
            raise MismatchError(
                f"empty_shared: ranks asked for different sizes ({sizes} bytes by rank); "
                "every rank must allocate the same shape and dtype, in the same order"
            )
        # At least one byte: a zero-sized window has no address to share.
        win = MPI.Win.Allocate_shared(max(nbytes, 1), 1, comm=comm.mpi)
        raw = []
        for r in range(comm.size):
            buffer, _ = win.Shared_query(r)
            raw.append(torch.frombuffer(buffer, dtype=torch.uint8, count=max(nbytes, 1)))
        self.windows.append(win)
        self.raw.append(raw)
        self._bases.append((raw[comm.rank].data_ptr(), nbytes))
        comm.mpi.Barrier()
        return raw[comm.rank][:nbytes].view(dtype)

    def locate(self, t: torch.Tensor) -> tuple[int, int] | None:
        """(window index, byte offset) of ``t``'s memory, or None if not shared."""
        if t.device.type != "cpu":
            return None
        address, nbytes = t.data_ptr(), t.numel() * t.element_size()
        for index, (base, size) in enumerate(self._bases):
            if size and base <= address and address + nbytes <= base + size:
                return index, address - base
        return None

    def peer_bytes(self, window: int, rank: int) -> torch.Tensor:
        return self.raw[window][rank]

    def release(self, t: torch.Tensor) -> None:
        """Frees the window ``t`` starts; collective over the node, in the same order on
        every rank. The other windows keep their index (peers name them by it)."""
        comm = self.comm
        found = self.locate(t)
        index = found[0] if found is not None and found[1] == 0 else -1
        every = comm.mpi.allgather(index)
        if -1 in every:
            bad = [r for r, i in enumerate(every) if i == -1]
            raise MPXValueError(
                f"free_shared: ranks {bad} passed a tensor that does not start a block of "
                "this communicator's shared memory; pass the tensor empty_shared returned "
                "(on the same comm), on every rank, once"
            )
        if len(set(every)) != 1:
            raise MismatchError(
                f"free_shared: the ranks freed different blocks (their indices by rank: {every}); "
                "free them in the same order on every rank, as they were allocated"
            )
        win = self.windows[index]
        assert win is not None  # locate() finds live windows only
        self.windows[index] = None
        self.raw[index] = []
        self._bases[index] = (0, 0)
        win.Free()

    def free(self) -> None:
        self.raw.clear()
        self._bases.clear()
        for win in self.windows:
            if win is not None:
                win.Free()
        self.windows.clear()


def empty_shared(
    *shape: Any, dtype: torch.dtype = torch.float32, comm: CommLike | None = None
) -> torch.Tensor:
    """An uninitialised CPU tensor in node-shared memory; collective over ``comm``'s node.

    ``shm`` allreduces of it (or of any slice of it) run without staging
    copies. Every rank must call it with the same shape and dtype, in the
    same order; the memory lives as long as the communicator.

    Example::

        bucket = empty_shared(25 << 18)             # 25 MiB of float32, on every rank
        bucket.copy_(flat_grads); allreduce(bucket)  # zero-copy shm
    """
    comm = as_communicator(comm)
    if not comm.single_node:
        raise MPXValueError(
            f"empty_shared: the communicator spans {comm.num_nodes} nodes; shared memory is "
            "per node: allocate on comm.node(), or use ordinary tensors"
        )
    dims = tuple(
        int(d) for d in (shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape)
    )
    if any(d < 0 for d in dims):
        raise MPXValueError(
            f"empty_shared: negative dimension in shape {dims}; every dimension must be >= 0"
        )
    numel = 1
    for d in dims:
        numel *= d
    return SharedBuffers.of(comm).allocate(numel, dtype).view(dims)


def free_shared(t: torch.Tensor, comm: CommLike | None = None) -> None:
    """Gives back the node-shared memory of ``t``, a tensor :func:`empty_shared` returned
    on ``comm``; collective over ``comm``'s node, in the same order on every rank.

    ``t`` and every view of it must not be used afterwards (the memory is
    gone: copy out what you keep first). Without it the memory lives as long
    as the communicator, and each block holds one of MPI's windows (MPICH has
    about 2000 of them a process).

    Example::

        bucket = empty_shared(1 << 20)
        ...
        free_shared(bucket)
    """
    comm = as_communicator(comm)
    buffers = comm.cached("shared_buffers")
    if not isinstance(buffers, SharedBuffers):
        raise MPXValueError(
            "free_shared: this communicator has no shared memory; pass the comm the tensor "
            "was allocated on by empty_shared(..., comm=comm)"
        )
    buffers.release(t)
