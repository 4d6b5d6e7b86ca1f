"""The errors mpx-collectives raises; all derive from :class:`MPXError`."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["CollectiveTimeout", "CommunicatorBroken", "MPXError", "MismatchError"]


class MPXError(Exception):
    """Base class of every error raised by ``mpx.collectives``."""


class CollectiveTimeout(MPXError, TimeoutError):
    """A collective did not complete within its timeout.

    Attributes:
        op: the operation (``"allreduce"``, ``"recv"``, ...).
        impl: the implementation that ran it.
        seconds: the timeout that expired.
        peers: ranks known to be behind (not yet in the operation, or the
            point-to-point peer being waited for); empty if unknown.
    """

    def __init__(
        self, op: str, impl: str, seconds: float, peers: Sequence[int], detail: str = ""
    ) -> None:
        self.op, self.impl, self.seconds, self.peers = op, impl, seconds, list(peers)
        who = (
            f"waiting for rank(s) {', '.join(map(str, self.peers))}"
            if self.peers
            else "the peers that are behind could not be determined"
        )
        text = f"{op} (impl={impl!r}) did not complete within {seconds:g} s; {who}"
        super().__init__(f"{text}{'; ' + detail if detail else ''}")


class MismatchError(MPXError, ValueError):
    """Ranks called a collective with different shapes, dtypes, ops or roots (``MPX_CHECK=1``)."""


class CommunicatorBroken(MPXError):
    """A collective on this communicator timed out earlier; its state is unknown."""
