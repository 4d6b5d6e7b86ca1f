"""Ghost rows between neighbouring time blocks: the one exchange MGRIT's relaxation needs."""

from __future__ import annotations

from typing import Any

import torch
from mpi4py import MPI

from mpx.collectives import Channel, Communicator, MPXValueError
from mpx.mgrit.errors import MGRITError

__all__ = ["Ghosts", "Shift", "mismatch"]


class Ghosts:
    """Ghost rows from the neighbouring time blocks, on a :class:`mpx.collectives.Channel`.

    Each rank posts its last point of a level to the next rank that owns points
    on that level, which keeps it as the ghost row 0 of its block: a C-point as
    soon as it changed, an F-point once the F-relaxation made it final (an
    interval that crosses ranks is relaxed as a chain). One ``Ghosts`` per level,
    one tag per level; the receive is posted before the relaxation that does not
    need it; CUDA states travel through the channel (MPI need not be CUDA-aware)::

        rank r-1: [g | ... F F C F]  --- last point --->  rank r: [g | F C F F C ... ]
                                                                  ^ ghost row 0

    Example::

        ghosts = Ghosts(comm, left=layout.left, right=layout.right)
        shift = ghosts.start(u[-1], u[0], tag=level)   # u[0] <- left neighbour's last row
        relax_all_but_the_first_interval(); shift.finish(); relax_the_first_interval()
    """

    def __init__(
        self,
        comm: Communicator,
        left: int | None,
        right: int | None,
        channel: Channel | None = None,
    ) -> None:
        # One channel may serve every level (each its own tag): its buffers are shared.
        self.channel = Channel(comm) if channel is None else channel
        self.left, self.right = left, right

    def start(self, last: torch.Tensor | None, ghost: torch.Tensor | None, tag: int) -> Shift:
        """Starts posting ``last`` right (if given and there is a right neighbour) and
        receiving the left neighbour's into ``ghost`` (likewise); returns at once."""
        incoming, sent = None, None
        if ghost is not None and self.left is not None:
            like = [(ghost.shape, ghost.dtype)]
            incoming = self.channel.expect(self.left, tag, like, device=ghost.device)
        if last is not None and self.right is not None:
            sent = self.channel.post(self.right, tag, last)  # ``last`` is kept until finish()
        return Shift(self, incoming, sent, ghost)


class Shift:
    """An exchange in flight: :meth:`finish` waits for it and fills the ghost row."""

    def __init__(
        self, ghosts: Ghosts, incoming: Any, sent: Any, ghost: torch.Tensor | None
    ) -> None:
        self.ghosts, self.incoming, self.sent, self.ghost = ghosts, incoming, sent, ghost

    @property
    def receives(self) -> bool:
        """Whether the ghost row will change (there is a left neighbour)."""
        return self.incoming is not None

    def finish(self) -> None:
        """Waits for the exchange.

        Raises:
            MGRITError: the message did not fit (the ranks are out of step).
            CollectiveTimeout: the neighbour did not arrive in time (``MPX_TIMEOUT``).
        """
        channel = self.ghosts.channel
        try:
            if self.incoming is not None:
                assert self.ghost is not None
                message = channel.receive(self.incoming)
                self.ghost.copy_(message.tensors[0])
                channel.release(message.tensors)
                self.incoming = None
            if self.sent is not None:
                channel.wait(self.sent)
                self.sent = None
        except (MPXValueError, MPI.Exception) as err:
            shape = () if self.ghost is None else tuple(self.ghost.shape)
            raise mismatch((self.ghosts.left, self.ghosts.right), shape, err) from err


def mismatch(
    peers: tuple[int | None, int | None], shape: tuple[int, ...], err: Exception
) -> MGRITError:
    """The error of an exchange whose message did not fit: the ranks are out of step."""
    return MGRITError(
        f"MGRIT boundary exchange with neighbours (left, right) = {peers} failed for a state of "
        f"shape {shape} ({err}). Every rank of the communicator must call solve() (or the "
        "network's forward and backward) in the same order with states of the same shape."
    )
