"""The process group's works: ``dist.Work`` objects over mpx handles, and their futures.

:class:`MPXWork` is what every operation of the ``"mpx"`` process group
returns (:mod:`mpx.collectives.torch.backend`); its futures are those of
:mod:`mpx.collectives.torch.futures`. Beside it, a result computed when
waited for (:class:`Deferred`), and a receive from any source run by the
registry's ``recv`` that names the rank its message came from
(:class:`AnySourceReceive`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from mpi4py import MPI

from mpx.collectives.base import (
    Backoff,
    CollectiveTimeout,
    Handle,
    MPXValueError,
    Pending,
    Requests,
    Steps,
    progress,
)
from mpx.collectives.torch.eager import called_from_cpp, run_eagerly
from mpx.collectives.torch.futures import COMPLETING, MPXFuture, tensor_list_future

__all__ = ["AnySourceReceive", "Deferred", "MPXWork", "in_turn"]


@run_eagerly
class MPXWork(dist.Work):
    """A ``dist.Work`` over mpx handles; ``then`` runs when they complete.

    Asynchronous as gloo's: the handles advance on mpx's progress thread,
    which also finishes the work (``then``, then the future) once they are
    done, so a future from :meth:`get_future` completes while the caller
    computes -- DDP chains its bucket hooks on it and overlaps the buckets'
    allreduce with the rest of the backward pass::

        backward: bucket 1 ready -> allreduce(async) -> future 1   (returns at once)
        backward continues            progress thread: ... bucket 1 done,
        backward: bucket 2 ready ...      write back, future 1 completed, hooks run
        finalize: future 1, 2 ... wait    (mostly done already)

    ``wait()``, ``is_completed()`` and ``result()`` finish it too (whichever
    comes first; a lock makes it happen once), and so does a wait on its
    future from any thread (:class:`~mpx.collectives.torch.futures.MPXFuture`):
    a callback that starts a collective and waits for it -- torch's PowerSGD
    hook -- drives it itself instead of waiting for the progress thread that
    may be running that very callback. An operation still unfinished
    at the group's timeout fails the work: ``wait()`` and the future raise
    :class:`CollectiveTimeout`. Without a progress thread
    (``MPX_PROGRESS_THREAD=0``, or MPI without ``MPI_THREAD_MULTIPLE``)
    :meth:`get_future` finishes the work before it returns.
    """

    def __init__(
        self,
        handles: Sequence[Handle[Any]],
        result: list[torch.Tensor],
        then: Callable[[], None] | None = None,
        source: Callable[[], int] | None = None,
        timeout: float | None = None,
        lists_for_cpp: bool = True,
        driven: bool = False,
        value: list[list[torch.Tensor]] | None = None,
    ) -> None:
        super().__init__()
        # The Python future's value where it is not ``result``: c10d's allgather of
        # several inputs gives one list per input, as gloo's future does.
        self._value = value
        self._lists_for_cpp = lists_for_cpp
        self._handles = list(handles)
        # The handles the progress thread advances itself (mpx handles of a
        # communicator with background_progress, as the group's are): it has
        # polled them just before it asks ready(), which then reads their state
        # instead of polling each a second time on every turn of the thread.
        self._driven = driven
        self._result = result
        self._then = then
        self._source = source
        self._timeout = timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._lock = threading.RLock()  # the caller and the progress thread may both finish
        self._finished = False
        self._error: BaseException | None = None
        self._future: MPXFuture[list[torch.Tensor]] | None = None  # for Python callers
        self._c10_future: torch.futures.Future[list[torch.Tensor]] | None = None  # for torch's C++
        self._watched = False  # handed to the progress thread
        # What completes the futures handed out and not yet completed; run by the
        # thread that finishes the work, outside the lock.
        self._unsettled: list[Callable[[], None]] = []

    def _finish(self, expired: bool = False) -> None:
        """Waits for the handles, runs ``then``, completes the futures; raises the work's error.

        Any thread may call it: the caller's ``wait()``, the progress thread,
        a wait on the work's future (:class:`MPXFuture`). The futures are
        completed outside the lock: their callbacks may wait on other works,
        and a thread waiting on this one must not hold them up meanwhile.
        """
        with self._lock:
            if not self._finished:
                try:
                    for handle in self._handles:
                        self._wait_for(handle, expired)
                    if self._then is not None:
                        self._then()
                except BaseException as error:
                    self._error = error
                self._finished = True
            settle, self._unsettled = self._unsettled, []
        with COMPLETING:  # a then() in a callback finishes its operation first
            for complete in settle:
                complete()
        if self._error is not None:
            raise self._error

    def _wait_for(self, handle: Handle[Any], expired: bool) -> None:
        try:
            # Past the group's deadline: one look, no wait (Handle.wait takes a
            # timeout > 0 only; a microsecond is as good as none).
            handle.wait(1e-6 if expired else None)
        except CollectiveTimeout as late:
            raise CollectiveTimeout(
                late.op,
                late.impl,
                self._timeout if self._timeout is not None else late.seconds,
                late.peers,
                "the process group's timeout (init_process_group/new_group "
                "timeout=) expired; every later operation of this group raises",
            ) from late

    def _complete_future(self) -> None:
        assert self._future is not None
        if self._error is None:
            value: Any = self._result if self._value is None else self._value
            self._future.set_result(value)
        else:
            self._future.set_exception(_as_exception(self._error))  # type: ignore[arg-type]  # (stub: the value type)

    # -- the progress thread's side (mpx.collectives.base.progress.Completion) ---------

    def _handles_done(self) -> bool:
        """Whether every handle is complete; polls only those the progress thread does not."""
        driven = self._driven
        for handle in self._handles:
            if driven and type(handle) is Handle:
                if not handle.completed:
                    return False
            elif not handle.done():
                return False
        return True

    def ready(self) -> bool:
        """Every handle done, or the group's timeout past (polled under mpx's LOCK)."""
        try:
            if self._handles_done():
                return True
        except BaseException:  # complete() meets it again and hands it to the future
            return True
        return self._deadline is not None and time.monotonic() > self._deadline

    def complete(self) -> None:
        """Finishes the work on the progress thread; an error goes to the future."""
        try:
            expired = not self._handles_done()
        except BaseException:  # _finish meets it again and hands it to the future
            expired = False
        # try, not contextlib.suppress: three Python calls fewer per work on this thread.
        try:  # noqa: SIM105
            self._finish(expired)
        except BaseException:  # the futures carry it; the progress thread lives on
            pass

    # -- torch's Work ---------------------------------------------------------------

    def is_completed(self) -> bool:
        """Non-blocking; True once the operation is done and its outputs written."""
        if not self._finished and all(handle.done() for handle in self._handles):
            with contextlib.suppress(BaseException):  # wait() and the future raise it
                self._finish()
        return self._finished

    def is_success(self) -> bool:
        self.wait()
        return True

    def exception(self) -> BaseException | None:
        return self._error

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._finish()
        return True

    def result(self) -> list[torch.Tensor]:
        self._finish()
        return self._result

    def _source_rank(self) -> int:
        self._finish()
        if self._source is None:
            raise MPXValueError(
                "_source_rank: only a recv from any source knows its source; this work is not one"
            )
        return self._source()

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        """A future completed (with the outputs, or the work's error) when the work finishes.

        To Python, an :class:`MPXFuture`: its ``wait()`` (and that of the
        futures chained on it) finishes the work in the waiting thread, so a
        callback may wait on another work at any depth. To torch's C++ (DDP's
        built-in hooks), a future whose value is a c10 tensor list
        (:func:`tensor_list_future`), which C++ reads as it reads gloo's --
        where the group has a C++ reader of lists (``lists_for_cpp``, see
        :meth:`~mpx.collectives.torch.group.GroupBase.cpp_reads_lists`); DDP's
        own reduction reads the Python future too, and it costs no inter-op hop.
        """
        if self._lists_for_cpp and called_from_cpp():
            return self._tensor_list_future()
        with self._lock:
            if self._future is None:
                self._future = MPXFuture(self._finish)
                self._unsettled.append(self._complete_future)
            future = self._future
        self._complete_when_done()
        return future

    def _tensor_list_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        with self._lock:
            if self._c10_future is None:
                self._c10_future, complete = tensor_list_future(self._result)
                self._unsettled.append(lambda: complete(self._error))
            future = self._c10_future
        self._complete_when_done()
        return future

    def _complete_when_done(self) -> None:
        """Completes the futures when the work finishes: now, on the progress thread, or soon."""
        with self._lock:
            finished, watched, self._watched = self._finished, self._watched, True
        # A finished work completes them now; an unfinished one, on the progress
        # thread or when waited for; without a progress thread, nobody would
        # later: finish it now.
        if finished or (not watched and not progress.when_ready(self)):
            with contextlib.suppress(BaseException):  # the futures carry it
                self._finish()


def _as_exception(error: BaseException) -> Exception:
    """torch's futures carry an Exception; a BaseException (KeyboardInterrupt) travels wrapped."""
    return error if isinstance(error, Exception) else RuntimeError(repr(error))


class AnySourceReceive:
    """A receive from any source, run by the registry's ``recv`` as every receive is.

    mpx's ``recv`` names its source; torch's ``recv(src=None)`` does not. The
    implementation the policy chooses for ``recv`` (``mpi``, or ``staged``
    through pinned memory for a CUDA tensor) posts it with ``MPI.ANY_SOURCE``,
    beside mpx's sends on the same communicator, and :attr:`steps` run it
    (``Communicator.run``: the group's timeout, the progress thread). Its MPI
    receive is looked at with a status first (``MPI_Request_get_status``,
    which leaves the request to its step), so :meth:`source` can name the rank
    the message came from.
    """

    def __init__(self, steps: Steps[Any]) -> None:
        self._status = MPI.Status()
        self._receive: _Sourced | None = None
        self.steps: Steps[Any] = self._sourced(steps)

    def _sourced(self, steps: Steps[Any]) -> Steps[Any]:
        try:
            step = next(steps)
            while True:
                # The receive: the first step of one MPI request.
                if isinstance(step, Requests) and len(step.requests) == 1 and not self._receive:
                    self._receive = step = _Sourced(step, self._status)
                yield step
                step = next(steps)
        except StopIteration as stop:
            return stop.value
        finally:
            steps.close()

    def source(self) -> int:
        """The rank whose message was received (once the steps have run)."""
        if self._receive is None:
            raise MPXValueError(
                "recv from any source: the recv implementation posted no MPI receive, so "
                "its source is unknown; run it with the 'mpi' or 'staged' implementation"
            )
        return int(self._status.Get_source())


class _Sourced(Pending):
    """A one-request step whose completion also fills ``status`` (the message's source)."""

    __slots__ = ("_request", "_status", "_step")

    def __init__(self, step: Requests, status: MPI.Status) -> None:
        self._step, self._request, self._status = step, step.requests[0], status
        # No peer to name at a timeout (the step's is MPI.ANY_SOURCE, no rank).
        self.peers = ()

    def test(self) -> bool:
        # The status first, without completing the request; the step's own test
        # then completes it (and turns a truncation into mpx's error).
        if not self._request.Get_status(self._status):
            return False
        return self._step.test()

    def wait(self) -> None:
        # Polled, not MPI_Wait: MPI_Wait would free the request before its status is read.
        backoff = Backoff()
        while not self.test():
            backoff.pause()


class Deferred:
    """A handle whose result is computed from another's when it is waited for."""

    def __init__(self, inner: Handle[Any], compute: Callable[[], torch.Tensor]) -> None:
        self._inner, self._compute = inner, compute
        self._value: torch.Tensor | None = None

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        if self._value is None:
            self._inner.wait(timeout)
            self._value = self._compute()
        return self._value

    def done(self) -> bool:
        return self._inner.done()


def in_turn(calls: Sequence[Callable[[], object]]) -> Callable[[], None]:
    """One completion step that runs each of ``calls`` in order."""

    def run() -> None:
        for call in calls:
            call()

    return run
