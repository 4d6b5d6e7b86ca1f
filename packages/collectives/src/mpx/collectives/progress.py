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
    backward continues (C++, no GIL)    poll queues under LOCK, sleep 20 us..1 ms
    optimizer: handle.wait()            ... until nothing is in flight, then sleeps

It starts on the first asynchronous operation, when MPI gives
``MPI_THREAD_MULTIPLE`` (mpi4py asks for it by default) and
``MPX_PROGRESS_THREAD`` is not ``0``. Polling and the caller's ``wait()``
share one lock (:data:`mpx.collectives.handle.LOCK`), so a generator is never
resumed by two threads at once.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from mpi4py import MPI

from mpx.collectives import settings
from mpx.collectives.handle import LOCK, Handle, Queue

__all__ = ["ProgressThread", "enabled", "watch"]

_MIN_SLEEP_S = 20e-6
_MAX_SLEEP_S = 1e-3


def enabled() -> bool:
    """``MPX_PROGRESS_THREAD`` is not 0 and MPI is fully thread-safe."""
    if not settings.PROGRESS_THREAD.get():
        return False
    return bool(MPI.Query_thread() == MPI.THREAD_MULTIPLE)


class ProgressThread:
    """Polls queues of collectives and point-to-point handles until they finish.

    Example::

        engine = ProgressThread()
        engine.watch(queue)              # or engine.watch(handle)
        handle.wait()                    # finds most of the work already done
    """

    def __init__(self) -> None:
        self._items: list[Queue | Handle[Any]] = []
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mpx-progress", daemon=True)
        self._thread.start()

    def watch(self, item: Queue | Handle[Any]) -> None:
        with LOCK:
            if not any(existing is item for existing in self._items):
                self._items.append(item)
        self._wake.set()

    def _busy(self) -> bool:
        """Polls everything once (under LOCK); True while something is in flight."""
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
            return bool(still)

    def _loop(self) -> None:
        sleep = _MIN_SLEEP_S
        while True:
            if not self._busy():
                self._wake.wait()
                self._wake.clear()
                sleep = _MIN_SLEEP_S
                continue
            time.sleep(sleep)
            sleep = min(_MAX_SLEEP_S, sleep * 1.5)


_engine: list[ProgressThread] = []  # at most one, started on first use
_engine_lock = threading.Lock()


def watch(item: Queue | Handle[Any]) -> bool:
    """Hands ``item`` to the progress thread (started on first use); False if disabled."""
    if not enabled():
        return False
    with _engine_lock:
        if not _engine:
            _engine.append(ProgressThread())
    _engine[0].watch(item)
    return True
