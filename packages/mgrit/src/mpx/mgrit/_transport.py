"""Boundary exchange between neighbouring time blocks.

Only C-point values cross ranks: after C-points change, each rank sends its last
point (always a C-point of the level) to the rank on its right, which keeps it
as the ghost row 0 of its block. The values go through small CPU staging
buffers, so device tensors work with an MPI that is not CUDA-aware.

::

    rank r-1: [g | ... F F C]  --- last C-point --->  rank r: [g | F F C ... ]
                                                              ^ ghost row 0
"""

from __future__ import annotations

import torch

from mpx.collectives import Communicator, Handle, recv, send

__all__ = ["Neighbours"]


class Neighbours:
    """The nearest ranks on either side that hold time points (None at the ends).

    Example::

        nb = Neighbours(comm, left=comm.rank - 1 if comm.rank else None, right=None)
        nb.shift_right(u[-1], u[0], tag=level)   # u[0] <- left neighbour's last row
    """

    def __init__(self, comm: Communicator, left: int | None, right: int | None) -> None:
        self.comm = comm
        self.left = left
        self.right = right

    def start_send(self, value: torch.Tensor, tag: int) -> tuple[Handle[None], torch.Tensor] | None:
        """Starts sending ``value`` to the right neighbour (None without one).

        Returns the handle and the staging buffer, which must outlive the request.
        """
        if self.right is None:
            return None
        buf = value.detach().to("cpu", copy=True).contiguous()
        handle: Handle[None] = send(buf, self.right, tag, comm=self.comm, async_op=True)
        return handle, buf

    def start_recv(
        self, like: torch.Tensor, tag: int
    ) -> tuple[Handle[torch.Tensor], torch.Tensor] | None:
        """Starts receiving a value shaped like ``like`` from the left neighbour."""
        if self.left is None:
            return None
        buf = torch.empty(like.shape, dtype=like.dtype)
        handle: Handle[torch.Tensor] = recv(buf, self.left, tag, comm=self.comm, async_op=True)
        return handle, buf

    def shift_right(self, last: torch.Tensor | None, ghost: torch.Tensor, tag: int) -> None:
        """Sends ``last`` right and receives the left neighbour's into ``ghost``, both at once."""
        incoming = self.start_recv(ghost, tag)
        outgoing = self.start_send(last, tag) if last is not None else None
        if incoming is not None:
            handle, buf = incoming
            handle.wait()
            ghost.copy_(buf)
        if outgoing is not None:
            outgoing[0].wait()
