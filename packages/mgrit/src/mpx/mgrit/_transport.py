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
from mpi4py import MPI

from mpx.collectives import Communicator, Handle, recv, send
from mpx.mgrit.errors import MGRITError

__all__ = ["Neighbours", "Shift", "mismatch"]


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

    def start_shift(self, last: torch.Tensor, ghost: torch.Tensor, tag: int) -> Shift:
        """Starts sending ``last`` right and receiving the left neighbour's into ``ghost``."""
        return Shift(
            self.start_recv(ghost, tag), self.start_send(last, tag), ghost, (self.left, self.right)
        )

    def shift_right(self, last: torch.Tensor, ghost: torch.Tensor, tag: int) -> None:
        """Sends ``last`` right and receives the left neighbour's into ``ghost``, both at once."""
        self.start_shift(last, ghost, tag).finish()


class Shift:
    """An exchange in flight: :meth:`finish` waits for it and fills the ghost row.

    Example::

        shift = neighbours.start_shift(u[-1], u[0], tag=0)
        relax_all_but_the_first_interval(); shift.finish(); relax_the_first_interval()
    """

    def __init__(
        self,
        incoming: tuple[Handle[torch.Tensor], torch.Tensor] | None,
        outgoing: tuple[Handle[None], torch.Tensor] | None,
        ghost: torch.Tensor,
        peers: tuple[int | None, int | None] = (None, None),
    ) -> None:
        self.incoming, self.outgoing, self.ghost = incoming, outgoing, ghost
        self.peers = peers

    @property
    def receives(self) -> bool:
        """Whether the ghost row will change (there is a left neighbour)."""
        return self.incoming is not None

    def finish(self) -> None:
        try:
            if self.incoming is not None:
                handle, buf = self.incoming
                handle.wait()
                self.ghost.copy_(buf)
                self.incoming = None
            if self.outgoing is not None:
                self.outgoing[0].wait()
                self.outgoing = None
        except MPI.Exception as err:
            raise mismatch(self.peers, tuple(self.ghost.shape), err) from err


def mismatch(
    peers: tuple[int | None, int | None], shape: tuple[int, ...], err: Exception
) -> MGRITError:
    """The error of an exchange whose message did not fit: the ranks are out of step."""
    return MGRITError(
        f"MGRIT boundary exchange with neighbours (left, right) = {peers} failed for a state of "
        f"shape {shape} ({err}). Every rank of the communicator must call solve() (or the "
        "network's forward and backward) in the same order with states of the same shape."
    )
