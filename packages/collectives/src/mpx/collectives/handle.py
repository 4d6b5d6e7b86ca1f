"""Handles of asynchronous collectives, and the steps they are made of.

Every implementation writes an operation as a generator of *steps*: it starts
some non-blocking work, yields a :class:`Pending` for it, and continues when
that is complete. A :class:`Handle` drives the generator::

    impl generator          Handle.done() / wait(timeout)
    --------------          -----------------------------
    post Isend/Irecv   -->  Pending.test() until True (or the deadline)
    yield Pending           |
    reduce a chunk     <--  resume the generator
    yield Pending      -->  ...
    return result      -->  done; wait() returns it

A blocking call without a timeout drives the same generator with
``Pending.wait()``, so there is one code path for sync and async. On a
deadline the handle raises :class:`CollectiveTimeout` naming the peers it was
waiting for.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from typing import Any, Generic, TypeVar

from mpi4py import MPI

from mpx.collectives.errors import CollectiveTimeout

__all__ = ["Done", "Handle", "Pending", "Requests", "Steps"]

T = TypeVar("T")


class Pending:
    """Something a step waits for."""

    peers: Sequence[int] = ()

    def test(self) -> bool:
        raise NotImplementedError

    def wait(self) -> None:
        raise NotImplementedError


class Requests(Pending):
    """MPI requests; ``peers`` names the ranks they wait on, if known."""

    __slots__ = ("peers", "requests")

    def __init__(self, requests: Sequence[MPI.Request], peers: Sequence[int] = ()) -> None:
        self.requests = list(requests)
        self.peers = peers

    def test(self) -> bool:
        return bool(MPI.Request.Testall(self.requests))

    def wait(self) -> None:
        MPI.Request.Waitall(self.requests)


class Done(Pending):
    """Nothing to wait for (a step that completed synchronously)."""

    def test(self) -> bool:
        return True

    def wait(self) -> None:
        return None


Steps = Generator[Pending, None, T]


class Handle(Generic[T]):
    """An operation in flight; ``wait()`` returns its result.

    Example::

        handle = allreduce(grad, async_op=True)
        loss = compute_something_else()
        grad = handle.wait(timeout=30)
    """

    def __init__(
        self,
        op: str,
        impl: str,
        steps: Steps[T],
        *,
        timeout: float | None = None,
        behind: Callable[[], list[int]] | None = None,
        on_timeout: Callable[[], None] | None = None,
    ) -> None:
        self.op, self.impl = op, impl
        self._steps = steps
        self._timeout = timeout
        self._behind = behind
        self._on_timeout = on_timeout
        self._pending: Pending | None = None
        self._finished = False
        self._result: Any = None
        self._advance()

    def _advance(self) -> None:
        try:
            self._pending = next(self._steps)
        except StopIteration as stop:
            self._pending = None
            self._finished = True
            self._result = stop.value

    def done(self) -> bool:
        """Makes progress; True once the operation is complete."""
        while not self._finished:
            assert self._pending is not None
            if not self._pending.test():
                return False
            self._advance()
        return True

    def wait(self, timeout: float | None = None) -> T:
        """Blocks until complete; returns the result.

        Args:
            timeout: seconds; the communicator's timeout (``MPX_TIMEOUT``)
                when None, no limit if that is unset too.

        Raises:
            CollectiveTimeout: not complete in time; names the peers waited for.
        """
        limit = self._timeout if timeout is None else timeout
        if limit is None:
            while not self._finished:
                assert self._pending is not None
                self._pending.wait()
                self._advance()
            return self._result  # type: ignore[no-any-return]
        deadline = time.monotonic() + limit
        spins = 0
        while not self.done():
            if time.monotonic() > deadline:
                self._expire(limit)
            # Spin briefly for latency, then yield the core to other ranks.
            spins += 1
            if spins > 200:
                time.sleep(min(1e-3, 1e-5 * (spins - 200)))
        return self._result  # type: ignore[no-any-return]

    def _expire(self, limit: float) -> None:
        peers = list(self._pending.peers) if self._pending is not None else []
        if not peers and self._behind is not None:
            peers = self._behind()
        if self._on_timeout is not None:
            self._on_timeout()
        raise CollectiveTimeout(self.op, self.impl, limit, peers)
