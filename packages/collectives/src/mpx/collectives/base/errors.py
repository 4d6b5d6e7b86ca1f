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

from collections.abc import Mapping, Sequence
from typing import Any

from mpx.launch.errors import MPXError

__all__ = [
    "CollectiveTimeout",
    "CommunicatorBroken",
    "MPXError",
    "MPXTypeError",
    "MPXValueError",
    "MismatchError",
    "RemoteError",
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


class RemoteError(MPXError):
    """An operation failed on some ranks; every rank raises this, naming them.

    Raised by :meth:`Communicator.agree <mpx.collectives.Communicator.agree>`
    (and ``with comm.agreement(...)``) on every rank of the communicator alike,
    so that no rank goes on into a collective the failed ones never reach. On a
    rank that failed itself, the original exception is chained (``__cause__``).
    Upper packages raise subclasses that also derive from their own base class
    (``DataParallelRemoteError``, ``PipelineRemoteError``).

    Attributes:
        what: what failed, as the caller put it ("load_checkpoint: could not load x.pt").
        failures: rank -> summary of its exception ("ValueError: ..."), in rank order.

    Example::

        try:
            comm.agree(error, "could not read the data set")
        except RemoteError as err:
            print(err.ranks, err.failures)   # [2] {2: "FileNotFoundError: ..."}
    """

    def __init__(self, what: str, failures: Mapping[int, str]) -> None:
        self.what = what
        self.failures = dict(sorted(failures.items()))
        super().__init__(_describe_failures(what, self.failures))

    @property
    def ranks(self) -> list[int]:
        """The ranks that failed, ascending."""
        return list(self.failures)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.what, self.failures))


def _describe_failures(what: str, failures: Mapping[int, str]) -> str:
    """``what on rank 2: ValueError: x``; ranks with the same message share it."""
    ranks = list(failures)
    if not ranks:
        return f"{what} (no rank reported a failure)"
    if len(ranks) == 1:
        return f"{what} on rank {ranks[0]}: {failures[ranks[0]]}"
    names = ", ".join(map(str, ranks))
    if len(set(failures.values())) == 1:
        return f"{what} on ranks {names}: {failures[ranks[0]]}"
    return f"{what} on ranks {names}: " + "; ".join(f"rank {r}: {m}" for r, m in failures.items())
