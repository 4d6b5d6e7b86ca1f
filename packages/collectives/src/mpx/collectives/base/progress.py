"""A background thread that drives asynchronous operations forward.

MPI progresses non-blocking operations only inside MPI calls, and mpx's
shared-memory and ring algorithms advance only when their generator is
resumed. Without help, ``allreduce(bucket, async_op=True)`` started from a
gradient hook would sit idle until ``wait()``, and no communication would hide
behind the backward pass. The progress thread polls every operation in
flight::

    main thread                         progress thread
    -----------                         ---------------
    backward: hook -> allreduce(async)  wakes up (event set)
    backward continues (C++, no GIL)    poll under LOCK; yield, sleep 20 us..1 ms
    optimizer: handle.wait()            ... until nothing is in flight, then sleeps

It also completes what waits on those operations: a :class:`Completion`
(the torch backend's ``Work``, whose future DDP chains its bucket hooks on)
is polled with them, and its ``complete()`` runs on this thread, outside the
lock, once it is ready -- so a future completes without anyone waiting on it,
as gloo's worker threads complete theirs.

It starts on the first asynchronous operation, when MPI gives
``MPI_THREAD_MULTIPLE`` (mpi4py asks for it by default) and
``MPX_PROGRESS_THREAD`` is not ``0``. Polling and the caller's ``wait()``
share one lock (:data:`mpx.collectives.base.handle.LOCK`), so a generator is never
resumed by two threads at once.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
from typing import Any, Protocol

from mpi4py import MPI

from mpx.collectives import settings
from mpx.collectives.base.handle import LOCK, STEPS_TAKEN, Backoff, Handle, Queue

__all__ = ["Completion", "ProgressThread", "enabled", "watch", "when_ready"]


def enabled() -> bool:
    """``MPX_PROGRESS_THREAD`` is not 0 and MPI is fully thread-safe."""
    if not settings.PROGRESS_THREAD.get():
        return False
    return bool(MPI.Query_thread() == MPI.THREAD_MULTIPLE)


# Polls of the loop without a pause: none. A turn of it is a Python pass over
# everything in flight under LOCK (~15 us), so handle.py's 50 free spins
# cost ~1 ms of a core -- and of the GIL -- at every step an operation waits
# on, taken from the ranks and the backward that compute on a full node.
# A sched_yield returns at once where nothing else wants the core, so polling
# is as prompt; where something does, it runs. DDP on mpx, 2 ranks on 2 cores:
# this thread's CPU 24.6 -> 16.2 ms a step (helper's A/B in one job, load ~7).
_SPINS = 0


class Completion(Protocol):
    """Work to finish once the operations it waits on are done."""

    def ready(self) -> bool:
        """Polls (under LOCK, may make progress); True when ``complete()`` may run."""
        ...

    def complete(self) -> None:
        """Finishes the work (outside LOCK); reports its own errors, never raises."""
        ...


class ProgressThread:
    """Polls queues of collectives and point-to-point handles until they finish.

    Example::

        engine = ProgressThread()
        engine.watch(queue)              # or engine.watch(handle)
        handle.wait()                    # finds most of the work already done
    """

    def __init__(self) -> None:
        self._items: list[Queue | Handle[Any]] = []
        self._completions: list[Completion] = []
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="mpx-progress", daemon=True)
        self._thread.start()

    def watch(self, item: Queue | Handle[Any]) -> None:
        with LOCK:
            if not any(existing is item for existing in self._items):
                self._items.append(item)
        self._wake.set()

    def when_ready(self, completion: Completion) -> None:
        with LOCK:
            self._completions.append(completion)
        self._wake.set()

    def _busy(self) -> bool:
        """Polls everything once; True while something is in flight."""
        due = self._poll()
        # Outside LOCK: completing runs the caller's code (torch future
        # callbacks), which may itself start or wait for operations.
        for completion in due:
            # It reports its own errors; this thread must live on whatever happens.
            with contextlib.suppress(Exception):
                completion.complete()
        with LOCK:
            return bool(self._items) or bool(self._completions) or bool(due)

    def _poll(self) -> list[Completion]:
        """Advances every operation in flight (under LOCK); returns the completions now ready."""
        with LOCK:
            still: list[Queue | Handle[Any]] = []
            for item in self._items:
                if isinstance(item, Queue):
                    item.progress()
                    if len(item):
                        still.append(item)
                elif not item.done():
                    still.append(item)
            self._items = still
            due = [c for c in self._completions if c.ready()]
            if due:
                self._completions = [c for c in self._completions if not any(c is d for d in due)]
            return due

    def stop(self, timeout: float = 5.0) -> None:
        """Ends the loop at its next turn and waits up to ``timeout`` s for it."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    def _loop(self) -> None:
        backoff = Backoff(spins=_SPINS)
        while not self._stopping:
            seen = STEPS_TAKEN[0]
            if not self._busy():
                self._wake.wait()
                self._wake.clear()
                backoff = Backoff(spins=_SPINS)
                continue
            if STEPS_TAKEN[0] != seen:
                # An operation moved on: its next step may be ready at once
                # (shm's pieces); poll eagerly again before sleeping.
                backoff = Backoff(spins=_SPINS)
            backoff.pause()


_engine: list[ProgressThread] = []  # at most one, started on first use
_engine_lock = threading.Lock()


@atexit.register
def _stop_at_exit() -> None:
    # A daemon thread still inside a torch future's callbacks when Python
    # finalizes is ended by pthread_exit, and that unwind through torch's C++
    # aborts the process ('terminate called without an active exception')
    # after the program has finished. atexit runs before that: stop it here.
    with _engine_lock:
        engines = list(_engine)
    for engine in engines:
        engine.stop()


def _thread() -> ProgressThread | None:
    """The progress thread, started on first use; None if disabled."""
    if not enabled():
        return None
    with _engine_lock:
        if not _engine:
            _engine.append(ProgressThread())
    return _engine[0]


def watch(item: Queue | Handle[Any]) -> bool:
    """Hands ``item`` to the progress thread (started on first use); False if disabled."""
    thread = _thread()
    if thread is not None:
        thread.watch(item)
    return thread is not None


def when_ready(completion: Completion) -> bool:
    """Has the progress thread run ``completion.complete()`` once it is ready; False if disabled."""
    thread = _thread()
    if thread is not None:
        thread.when_ready(completion)
    return thread is not None
