"""The torch backend's works as the progress thread sees them (one process, no job needed)."""

from __future__ import annotations

import torch

from mpx.collectives.base.handle import Handle, Pending, Steps
from mpx.collectives.torch.backend import MPXWork


class _Never(Pending):
    """A step that is never ready; counts how often it is polled."""

    def __init__(self) -> None:
        self.tests = 0

    def test(self) -> bool:
        self.tests += 1
        return False

    def wait(self) -> None:
        raise AssertionError("never waited for in these tests")


def _steps(pending: Pending) -> Steps[None]:
    yield pending


def test_ready_does_not_poll_handles_the_progress_thread_drives() -> None:
    """The progress thread polls its handles, then asks each work ready().

    ready() polled every handle a second time on every turn of the thread
    (DDP: one MPI_Test and ~6 Python calls more per bucket and turn); a
    work of a communicator with background progress now reads their state.
    """
    pending = _Never()
    handle: Handle[None] = Handle("allreduce", "test", _steps(pending))
    before = pending.tests
    work = MPXWork([handle], [torch.zeros(1)], driven=True)
    assert not work.ready()
    assert not work.ready()
    assert pending.tests == before


def test_ready_polls_handles_nobody_else_drives() -> None:
    """background_progress=False (mpx-pipeline's communicators): ready() must poll itself."""
    pending = _Never()
    handle: Handle[None] = Handle("allreduce", "test", _steps(pending))
    before = pending.tests
    work = MPXWork([handle], [torch.zeros(1)], driven=False)
    assert not work.ready()
    assert pending.tests == before + 1
