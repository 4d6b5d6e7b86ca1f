"""The errors mpx-collectives raises; all derive from :class:`MPXError`.

:class:`MPXError` is the root of every mpx package's errors; it is defined in
mpx-launch, the dependency-free bottom layer, and re-exported here: mpx-launch's
``LaunchError``, and the bases of mpx-quantize, mpx-mgrit, mpx-pipeline and
mpx-dataparallel all derive from it. A bad argument raises
:class:`MPXValueError` or :class:`MPXTypeError`, which are also the builtin
``ValueError`` / ``TypeError``, so ``except ValueError`` keeps working.

Example::

    try:
        allreduce(t, op="mean")
    except MPXError as error:      # also a ValueError
        print(error)               # op must be one of sum, avg, ..., got 'mean'
"""

from __future__ import annotations

from collections.abc import Sequence

from mpx.launch.errors import MPXError

__all__ = [
    "CollectiveTimeout",
    "CommunicatorBroken",
    "MPXError",
    "MPXTypeError",
    "MPXValueError",
    "MismatchError",
]


class MPXValueError(MPXError, ValueError):
    """An argument has the right type but a bad value; the message names it and the fix.

    Example::

        with pytest.raises(ValueError, match="root must be a rank"):
            broadcast(t, root=5)           # on 2 ranks
    """


class MPXTypeError(MPXError, TypeError):
    """An argument has the wrong type or dtype; the message names it and the fix.

    Example::

        with pytest.raises(TypeError, match="must be a torch.Tensor"):
            allreduce([1.0, 2.0])
    """


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
