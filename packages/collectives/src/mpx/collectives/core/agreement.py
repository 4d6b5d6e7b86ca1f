"""Agreeing across ranks: a :class:`~mpx.collectives.Communicator`'s collectives over Python values.

``agree`` and ``agreement`` make a failure on one rank raise on every rank;
``allgather_object`` gathers any picklable value. Each runs as one operation of
the communicator (:meth:`Communicator.run <mpx.collectives.Communicator.run>`):
ordered with its collectives and timed like them, over the messages of
:mod:`mpx.collectives.base.exchange`.

:class:`Agreement` is a base class of :class:`~mpx.collectives.Communicator`,
which provides ``mpi`` and ``run``; it is not used on its own.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from mpi4py import MPI

from mpx.collectives.base import RemoteError, gather_bytes, summarize

if TYPE_CHECKING:
    from mpx.collectives.base import Handle, Steps

__all__ = ["Agreement"]

T = TypeVar("T")


class Agreement:
    """The communicator's agreement and object gathering (see the module docstring)."""

    mpi: MPI.Intracomm

    if TYPE_CHECKING:

        def run(
            self, op: str, impl: str, steps: Steps[T], async_op: bool, timeout: float | None
        ) -> T | Handle[T]: ...

    def agree(
        self,
        error: BaseException | str | None,
        what: str = "failed",
        *,
        error_type: type[RemoteError] = RemoteError,
        timeout: float | None = None,
    ) -> None:
        """Raises the same error on every rank if any rank failed. Collective.

        Every rank says how its part went: None for "ok", or its exception (or
        a one-line summary of it). If any rank failed, every rank raises
        ``error_type`` naming the failed ranks and their messages; on a failed
        rank the exception passed in is chained as its cause. So no rank goes
        on into a collective that the failed ones will never reach.

        Ordered and timed like every operation of the communicator: when no
        rank failed it costs one small allgather, with a failure a second one
        carries the messages.

        Args:
            error: this rank's failure, or None.
            what: the failure as the message starts it, e.g.
                ``"save_checkpoint: could not write ckpt.pt"`` gives
                ``"save_checkpoint: could not write ckpt.pt on rank 0: OSError: ..."``.
            error_type: :class:`RemoteError` or a subclass of it (an upper
                package's, which also derives from that package's base error).
            timeout: seconds; the communicator's timeout when None.

        Raises:
            RemoteError: (``error_type``) on every rank, when some rank failed.
            CollectiveTimeout: the peers did not all arrive in time.

        Example::

            error = None
            try:
                load_my_shard()
            except OSError as exc:
                error = exc
            comm.agree(error, "could not load the data set")
        """
        message = b"" if error is None else summarize(error).encode("utf-8", "replace")
        every = self.run("agree", "mpi", gather_bytes(self.mpi, message), False, timeout)
        assert isinstance(every, list)
        failures = {r: text.decode("utf-8", "replace") for r, text in enumerate(every) if text}
        if not failures:
            return
        raised = error_type(what, failures)
        if isinstance(error, BaseException):
            raise raised from error
        raise raised

    @contextlib.contextmanager
    def agreement(
        self,
        what: str = "failed",
        *,
        error_type: type[RemoteError] = RemoteError,
        timeout: float | None = None,
    ) -> Iterator[None]:
        """A block that fails on every rank if it fails on any. Collective.

        An ``Exception`` raised inside is caught on this rank, then every rank
        agrees (:meth:`agree`) at the end of the block: all of them raise
        ``error_type`` naming the failed ranks, or all go on.

        Example::

            with comm.agreement("save_checkpoint: could not write ckpt.pt"):
                if comm.rank == 0:
                    torch.save(state, "ckpt.pt")      # an OSError here raises everywhere
        """
        try:
            yield
        except Exception as exc:
            self.agree(exc, what, error_type=error_type, timeout=timeout)
            raise  # not reached: agree raised
        self.agree(None, what, error_type=error_type, timeout=timeout)

    def allgather_object(self, obj: Any, timeout: float | None = None) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order. Collective.

        For small Python values of any size per rank (layouts, modules,
        messages); tensors go faster through :func:`mpx.collectives.allgather`.
        Ordered and timed like every operation of the communicator.

        Example::

            layers = comm.allgather_object(my_layers)   # [rank 0's, rank 1's, ...]
        """
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        every = self.run("allgather_object", "mpi", gather_bytes(self.mpi, data), False, timeout)
        assert isinstance(every, list)
        return [pickle.loads(part) for part in every]
