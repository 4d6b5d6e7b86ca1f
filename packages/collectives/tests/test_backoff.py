"""Waits back off while nothing moves, and start again when an operation takes a step."""

from __future__ import annotations

import pytest

from mpx.collectives.base import handle as handle_module
from mpx.collectives.base.handle import Backoff, Handle, Pending, Steps


class ReadyAfter(Pending):
    """A step whose test() is true from its ``polls``-th poll on."""

    def __init__(self, polls: int) -> None:
        self.left = polls

    def test(self) -> bool:
        self.left -= 1
        return self.left <= 0

    def wait(self) -> None:
        self.left = 0


def _steps(count: int, polls: int) -> Steps[str]:
    for _ in range(count):
        yield ReadyAfter(polls)
    return "finished"


class Recorder(Backoff):
    """Backoff that pauses for nothing and counts what the wait does."""

    made = 0
    pauses = 0

    def __init__(self, spins: int = 50) -> None:
        super().__init__(spins)
        Recorder.made += 1

    def pause(self) -> None:
        Recorder.pauses += 1


def test_a_wait_starts_its_backoff_again_after_each_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An operation of many steps (shm's pieces, each a barrier) whose first
    # step was slow must not wait out long sleeps on every later step: DDP's
    # 25 MB buckets took 1.6x gloo's step time so.
    monkeypatch.setattr(handle_module, "Backoff", Recorder)
    Recorder.made = Recorder.pauses = 0
    steps, polls = 6, 3
    handle: Handle[str] = Handle("allreduce", "test", _steps(steps, polls), timeout=60.0)
    assert handle.wait() == "finished"
    # One backoff to begin with, and a fresh one after every step taken while waiting.
    assert Recorder.made >= steps
    assert Recorder.pauses >= steps * (polls - 1)


def test_backoff_spins_first_then_pauses() -> None:
    backoff = Backoff(spins=3)
    for _ in range(3):
        backoff.pause()  # free polls: no yield, no sleep
    assert backoff._polls == 3  # the count is the state under test
    backoff.pause()
    assert backoff._yield_until > 0.0  # the yield window has begun
