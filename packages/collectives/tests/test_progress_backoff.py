"""The progress thread's pauses: it yields the core from its first unsuccessful poll.

A turn of its loop is a Python pass under mpx's lock; the 50 free spins of a
caller's wait, paid at every step an operation waited on, took ~8 ms of a
core a step from DDP on mpx with 2 ranks on 2 cores. Run by one process,
with a progress thread of its own (no MPI job needed).
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from mpx.collectives.base.handle import Handle, Pending, Steps
from mpx.collectives.base.progress import ProgressThread


class _Late(Pending):
    """A step that is ready at its ``ready_at``-th poll; counts the polls."""

    def __init__(self, ready_at: int) -> None:
        self.polls = 0
        self.ready_at = ready_at
        self.done = threading.Event()

    def test(self) -> bool:
        self.polls += 1
        if self.polls >= self.ready_at:
            self.done.set()
            return True
        return False

    def wait(self) -> None:
        raise AssertionError("the progress thread polls; nobody waits here")


def _steps(pending: Pending) -> Steps[None]:
    yield pending


@pytest.mark.timeout(60)
def test_every_unsuccessful_poll_of_the_thread_is_followed_by_a_pause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pauses = [0]
    real_yield, real_sleep = os.sched_yield, time.sleep

    def counted_yield() -> None:
        pauses[0] += 1
        real_yield()

    def counted_sleep(seconds: float) -> None:
        pauses[0] += 1
        real_sleep(seconds)

    monkeypatch.setattr(os, "sched_yield", counted_yield)
    monkeypatch.setattr(time, "sleep", counted_sleep)
    pending = _Late(ready_at=30)
    handle: Handle[None] = Handle("allreduce", "test", _steps(pending))
    engine = ProgressThread()
    try:
        engine.watch(handle)
        assert pending.done.wait(30), "the progress thread never polled the step to the end"
    finally:
        engine.stop()
    assert handle.done()
    # 29 polls came back False: a pause after each (one more may follow the
    # last, before the thread sees nothing left in flight).
    assert pauses[0] >= pending.ready_at - 1, (pauses[0], pending.polls)
