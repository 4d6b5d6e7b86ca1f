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
``Pending.wait()``, so there is one code path for sync and async; it blocks
without holding the lock (the step it waits on is *claimed* instead), so the
progress thread keeps driving other communicators' operations meanwhile. On a
deadline the handle raises :class:`CollectiveTimeout` naming the peers it was
waiting for.

How a blocked rank waits depends on whether it has a core to itself. MPI's
own wait spins, which is the lowest latency when every rank has a core; when
a node's ranks outnumber its cores (``MPX_WAIT=auto``), a spinning rank takes
the core of a rank that computes, so blocking waits *yield* instead: they
poll the step, sleeping between polls (:func:`wait_yielding`)::

    MPI's wait (spin)        test test test test ...   ~65 % of a core each
    wait_yielding            test x50, then test + sched_yield for 0.5 ms,
                             then test + sleep 20 us .. 1 ms

Collectives on one communicator are matched by MPI in the order they are
issued, and the shared-memory slots are reused in call order, so every rank
must advance them in the same order whatever it polls first. A
:class:`Queue` per communicator therefore runs them strictly first in, first
out: a handle's generator starts only when every earlier collective of its
communicator has finished::

    allreduce(a, async_op=True)  -> queue [A]        A starts at once
    allreduce(b, async_op=True)  -> queue [A, B]     B waits for A
    hb.wait()                    -> drives A to the end, then B

Point-to-point operations match by source and tag, not by order, and a
receive posted before its send must not block that send: they bypass the
queue. All driving happens under one lock, so the progress thread
(:mod:`mpx.collectives.base.progress`) and the caller never advance a generator
at the same time.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any, Generic, TypeVar

from mpi4py import MPI

from mpx.collectives.base.checks import as_limit, check_timeout
from mpx.collectives.base.errors import CollectiveTimeout

__all__ = [
    "LOCK",
    "STEPS_TAKEN",
    "Backoff",
    "Done",
    "Handle",
    "Pending",
    "Queue",
    "Requests",
    "Steps",
    "drive",
    "wait_yielding",
]

# One lock for every generator of the process: the caller and the progress
# thread take turns (re-entrant: a step may start another operation).
LOCK = threading.RLock()

T = TypeVar("T")

# The yielding wait: a short spin keeps the latency of a peer that is nearly
# there. Then sched_yield for a while: it hands the core to any rank that is
# runnable on it (the peer we wait for, when ranks outnumber cores) and returns
# at once otherwise, so a peer that arrives soon is seen within a microsecond.
# A sleep cannot do that: on some kernels (this project's VMs) the shortest
# sleep is ~85 us, and a 3-rank allreduce on 2 cores waited through dozens.
# Past the window, sleeps growing to 1 ms keep a long wait off the core of a
# rank that computes (a peer arriving during a sleep waits at most that long).
_SPINS = 50

# Steps taken by every handle of this process (under LOCK). A wait whose
# operation moves on starts its backoff again: an operation of many steps
# (shm's pieces, each a barrier) would otherwise pay a sleep of up to 1 ms
# per step once one step took long, as DDP's 25 MB buckets did (2 ranks:
# DDP on mpx 1.07-1.09x gloo's step time, synchronous futures 1.3-1.6x).
STEPS_TAKEN = [0]
_YIELD_WINDOW_S = 500e-6
_MIN_SLEEP_S = 20e-6
_MAX_SLEEP_S = 1e-3


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
        if len(self.requests) == 1:  # the common case, without building an array
            return bool(self.requests[0].Test())
        return bool(MPI.Request.Testall(self.requests))

    def wait(self) -> None:
        if len(self.requests) == 1:
            self.requests[0].Wait()
        else:
            MPI.Request.Waitall(self.requests)


class Done(Pending):
    """Nothing to wait for (a step that completed synchronously)."""

    def test(self) -> bool:
        return True

    def wait(self) -> None:
        return None


Steps = Generator[Pending, None, T]


class Backoff:
    """Pauses between polls of a wait: free polls, then sched_yield, then sleeps.

    ``spins`` polls go by without a pause; then for the yield window each pause
    is a ``sched_yield``; after it, sleeps growing from 20 us to 1 ms.
    """

    __slots__ = ("_polls", "_sleep", "_spins", "_yield_until")

    def __init__(self, spins: int = _SPINS) -> None:
        self._spins = spins
        self._polls = 0
        self._sleep = _MIN_SLEEP_S
        self._yield_until = 0.0

    def pause(self) -> None:
        self._polls += 1
        if self._polls <= self._spins:
            return
        now = time.monotonic()
        if self._polls == self._spins + 1:
            self._yield_until = now + _YIELD_WINDOW_S
        if now < self._yield_until:
            os.sched_yield()
        else:
            time.sleep(self._sleep)
            self._sleep = min(_MAX_SLEEP_S, self._sleep * 1.5)


def wait_yielding(pending: Pending) -> None:
    """Waits for ``pending`` by polling it, yielding the core between polls."""
    backoff = Backoff()
    while not pending.test():
        backoff.pause()


def drive(steps: Steps[T], yielding: bool = False) -> T:
    """Runs ``steps`` to the end, blocking in each (no handle, no deadline).

    Args:
        yielding: wait with :func:`wait_yielding` instead of MPI's spinning wait.
    """
    try:
        pending = next(steps)
        while True:
            if yielding:
                wait_yielding(pending)
            else:
                pending.wait()
            pending = next(steps)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]


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
        queue: Queue | None = None,
        yielding: bool = False,
    ) -> None:
        self.op, self.impl = op, impl
        self._yielding = yielding  # wait() without a deadline: wait_yielding, not MPI's
        self._steps = steps
        self._timeout = timeout
        self._behind = behind
        self._on_timeout = on_timeout
        self._queue = queue
        self._pending: Pending | None = None
        self._started = False
        self._finished = False
        # True while a thread blocks in MPI on this handle's step without
        # holding LOCK: nobody else may test or advance it meanwhile.
        self._claimed = False
        self._result: Any = None
        self._error: BaseException | None = None
        with LOCK:
            if queue is None:
                self._advance()
            else:
                queue.append(self)

    # -- driving (always under LOCK) -------------------------------------------

    def _advance(self) -> None:
        self._started = True
        STEPS_TAKEN[0] += 1
        try:
            self._pending = next(self._steps)
        except StopIteration as stop:
            self._pending = None
            self._finished = True
            self._result = stop.value
        except BaseException as error:  # kept for wait(): the driver may be another thread
            self._fail(error)

    def _fail(self, error: BaseException) -> None:
        """Finished, with ``error`` for ``wait()`` to raise."""
        self._pending, self._finished, self._error = None, True, error

    def _poll(self) -> bool:
        """Advances as far as possible without blocking; True once finished."""
        if not self._started:
            self._advance()
        while not self._finished:
            assert self._pending is not None
            try:
                ready = self._pending.test()
            except BaseException as error:
                self._fail(error)
                break
            if not ready:
                return False
            self._advance()
        return True

    def _progress(self) -> None:
        if self._queue is not None:
            self._queue.progress()
        else:
            self._poll()

    def _result_or_raise(self) -> T:
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[no-any-return]

    # -- public ------------------------------------------------------------------

    @property
    def completed(self) -> bool:
        """True once complete; unlike :meth:`done`, makes no progress itself."""
        return self._finished

    def done(self) -> bool:
        """Makes progress; True once the operation is complete."""
        if not self._finished:
            with LOCK:
                if not self._claimed:
                    self._progress()
        return self._finished

    def wait(self, timeout: float | None = None) -> T:
        """Blocks until complete; returns the result.

        Args:
            timeout: seconds (> 0; ``math.inf``: no limit); the
                communicator's timeout (``MPX_TIMEOUT``) when None, no limit
                if that is unset too. To look without waiting, call ``done()``.

        Raises:
            CollectiveTimeout: not complete in time; names the peers waited for.
            MPXValueError, MPXTypeError: ``timeout`` is 0 or less, NaN, or
                not a number (the operation goes on: wait for it again).
        """
        if timeout is not None:
            timeout = check_timeout(timeout, f"{self.op}: Handle.wait")
        limit = as_limit(self._timeout if timeout is None else timeout)
        if limit is None:
            self._wait_unbounded()
            return self._result_or_raise()
        deadline = time.monotonic() + limit
        # Spin briefly for latency, then yield the core to other ranks; again
        # from the start whenever a step was taken (ours, or one ahead of us).
        backoff = Backoff(spins=200)
        seen = STEPS_TAKEN[0]
        while not self.done():
            if time.monotonic() > deadline:
                self._expire(limit)
            if STEPS_TAKEN[0] != seen:
                seen = STEPS_TAKEN[0]
                backoff = Backoff(spins=200)
            backoff.pause()
        return self._result_or_raise()

    def _wait_unbounded(self) -> None:
        """Blocks in MPI until finished, without holding LOCK while blocked.

        Holding it would stop the progress thread from driving the operations
        of other communicators, which a peer may need to finish before it
        ever joins this one: a deadlock. The step being waited on is claimed
        instead, so that nobody else touches it meanwhile.
        """
        while True:
            with LOCK:
                if self._queue is not None:
                    self._queue.progress()
                    target = self._queue.head() if not self._finished else None
                else:
                    target = None if self._finished or self._poll() else self
                if target is None:
                    return
                busy = target._claimed or target._pending is None
                if not busy:
                    pending = target._pending
                    target._claimed = True
            if busy:  # another thread blocks on it: let that thread finish it
                time.sleep(1e-5)
                continue
            assert pending is not None
            try:
                if self._yielding:
                    wait_yielding(pending)
                else:
                    pending.wait()
            except BaseException as error:
                with LOCK:
                    target._fail(error)
            finally:
                with LOCK:
                    target._claimed = False

    def _expire(self, limit: float) -> None:
        with LOCK:
            blocking = self._queue.head() if self._queue is not None else self
            pending = blocking._pending if blocking is not None else None
            peers = list(pending.peers) if pending is not None else []
        if not peers and self._behind is not None:
            peers = self._behind()
        if self._on_timeout is not None:
            self._on_timeout()
        raise CollectiveTimeout(self.op, self.impl, limit, peers)


class Queue:
    """The collectives of one communicator, run first in, first out.

    Example::

        queue = Queue()
        handle = Handle("allreduce", "shm", steps, queue=queue)   # starts if first
        queue.progress()                                          # advances the head
    """

    def __init__(self) -> None:
        self._handles: collections.deque[Handle[Any]] = collections.deque()

    def append(self, handle: Handle[Any]) -> None:
        self._handles.append(handle)
        if len(self._handles) == 1:
            self.progress()

    def head(self) -> Handle[Any] | None:
        return self._handles[0] if self._handles else None

    def __len__(self) -> int:
        return len(self._handles)

    def __bool__(self) -> bool:
        return bool(self._handles)

    def abandon(self, error: BaseException) -> None:
        """Fails every queued operation no thread is blocked in (its communicator is freed).

        A timed-out operation stays at the head of its queue, and the progress
        thread would go on polling it -- in memory the communicator's free()
        has given back (a crash) -- so free() abandons them first.
        """
        for handle in self._handles:
            if not handle._finished and not handle._claimed:
                handle._fail(error)
        self._handles.clear()

    def progress(self) -> None:
        """Advances the oldest operations as far as they go without blocking."""
        while self._handles and not self._handles[0]._claimed and self._handles[0]._poll():
            self._handles.popleft()
