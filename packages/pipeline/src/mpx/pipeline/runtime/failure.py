"""When a stage fails: every stage raises the same error, and the next call starts clean.

A call (``step``, ``forward``, ``flush``) can fail on one stage only: a bad
batch on the first stage, an activation of the wrong shape on the next, a user
error inside a layer, a loss that does not fit the target. The other stages
are then waiting for messages that will never come, or have done their part
and are about to return a loss. Three things make every stage raise::

    stage f (fails)              stage g (waits for f)         stage h (done)
    ---------------              ---------------------         --------------
    status (not ok)              ...                           status (ok), waits
    notice ---> every stage ---> the wait sees the notice
                                 status (not ok)
    notices of all <------------ notice                  <---- notice (its status
    statuses complete                                            showed a failure)
    settle: errors and ledgers allgathered, links drained; every stage raises
    PipelineRemoteError naming stage f and its error

- **Status.** Every call ends with a small allgather of (ok, loss) per stage.
  It replaces the loss broadcast (same cost), and a stage that did its part
  learns there that another did not. ``async`` starts it at the end of a call
  and reads it at the end of the next, as it did the loss.
- **Notices.** Every stage keeps a receive posted from every other stage. A
  stage that fails, or learns of a failure, sends each of them a notice
  carrying how many statuses it has issued and which call it is in; waits for
  messages look at these receives (:func:`mpx.pipeline.runtime.transport.wait_for`),
  so no stage waits for a neighbour that gave up. With every other stage's
  notice in hand, a stage issues the statuses it is behind, so that all have
  issued the same collectives, and waits for them.
- **Settling.** One allgather of each stage's error and ledger (messages sent
  and receives posted per link and tag). Each link then takes what was sent
  but never received (receives posted with the logged sizes), and answers the
  receives nothing would match (empty sends: a receive takes a shorter
  message). Once every handle has completed no message is in flight, so
  buffers may be reused or freed -- freeing them earlier let MPI write into
  freed memory (``malloc(): unsorted double linked list corrupted``) -- and
  the next call matches only its own messages.

**Closing.** :meth:`FailureAgreement.close` (``Pipeline.close()``) settles the
same way, with notices that say the stage closes: they complete the notice
receives (a receive never matched keeps a communicator alive in MPI after its
free), and they are no failure -- a stage still in the last call (``async``)
finishes it, then closes.

**One call, the same on every stage.** Under ``async`` a stage may have
finished call ``c`` and returned before another failed in it: it learns of the
failure in call ``c + 1`` (its status is read a call late, like its loss).
Raising in different calls on different stages would pair the first stage's
inputs with another batch's targets afterwards, so every stage raises in the
latest call any stage was in when it settled (:attr:`FailureAgreement.raise_in`):
a stage that settled a call earlier returns from it like a call without a loss
(NaN) and raises at the start of its next call, before touching its arguments.
A stage that was a call ahead undoes both calls (:attr:`FailureAgreement.failed_in`).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from mpx.collectives import CollectiveTimeout, Communicator, Handle, allgather, recv, send
from mpx.pipeline.errors import PipelineError, PipelineRemoteError, PipelineValueError
from mpx.pipeline.runtime.passes import StagePasses
from mpx.pipeline.runtime.transport import adopt, wait_for

__all__ = ["FailureAgreement", "StageGaveUp", "Status", "summarize"]

_NOTICE_TAG = 2  # beside the transport's header (1) and data tags (>= 8192)
# Why a notice was sent (its last word): this stage learned of a failure, failed, or closes.
_GAVE_UP, _FAILED, _CLOSING = 0, 1, 2
_MAX_SUMMARY = 2000


class StageGaveUp(PipelineError):
    """Internal: another stage failed this call; this one stops and settles (never escapes)."""


def summarize(error: BaseException) -> str:
    """``"ValueError: message"``, shortened to fit an agreement."""
    text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return text if len(text) <= _MAX_SUMMARY else text[: _MAX_SUMMARY - 15] + " ... (shortened)"


@dataclass(eq=False)
class Status:
    """One call's status collective: every stage's (not ok, loss), gathered."""

    value: torch.Tensor  # this stage's [not ok, loss]
    handle: Handle[torch.Tensor]
    gathered: torch.Tensor | None = None  # (stages, 2) once complete


_KEPT: list[Any] = []
"""Notice receives of dropped pipelines: nothing will ever match them, so their
buffers live as long as the process (two int64 per stage)."""


class FailureAgreement:
    """Statuses, notices and settling for one pipeline (see the module docstring).

    Example::

        agreement = FailureAgreement(comm, passes)
        try:
            loss = run_the_call()
            status = agreement.issue(loss, ok=True)
            loss = agreement.read(status)       # raises StageGaveUp if a stage failed
        except Exception as error:
            raise agreement.settle(error, "Pipeline.step failed", status_due=...) from error
    """

    def __init__(self, comm: Communicator, passes: StagePasses) -> None:
        self.comm, self.passes = comm, passes
        self.others = [r for r in range(comm.size) if r != comm.rank]
        self.issued = 0  # status collectives this stage has started
        self.calls = 0  # calls (step, forward, flush) begun; counted by the Pipeline
        self.raise_in = 0  # the call in which every stage raises the last failure
        self.failed_in = 0  # the earliest call a stage was in when it settled
        self.statuses: list[Status] = []  # started and not yet read, oldest first
        self.broken: str | None = None  # why the pipeline cannot be used any more
        self.loss_rank = comm.size - 1  # the rank whose loss a status carries (last stage's)
        self._notices = {r: torch.zeros(3, dtype=torch.int64) for r in self.others}
        self._listening: dict[int, Handle[torch.Tensor]] = {}
        for r in self.others:
            self._listen(r)
        self._keep = weakref.finalize(self, _KEPT.append, (self._notices, self._listening))
        # Stages whose notice said they close the pipeline (Pipeline.close()):
        # this one then listens no more, and its own close() only frees.
        self.closed_by: list[int] = []

    def _listen(self, peer: int) -> None:
        self._listening[peer] = recv(
            self._notices[peer], peer, _NOTICE_TAG, comm=self.comm, async_op=True
        )

    # -- while a call runs ------------------------------------------------------

    def interrupt(self) -> None:
        """Raises :class:`StageGaveUp` if another stage sent a notice of a failure.

        A notice that a stage closes is no reason to stop: under ``async`` a
        stage may still be in the last call when the others, done with it, close.
        """
        for r, handle in self._listening.items():
            if handle.done() and int(self._notices[r][2]) != _CLOSING:
                raise StageGaveUp(f"stage {r} failed")

    def issue(self, loss: float, ok: bool) -> Status:
        """Starts this call's status collective."""
        value = torch.tensor([0.0 if ok else 1.0, loss], dtype=torch.float64)
        handle = allgather(value, comm=self.comm, async_op=True)
        self.issued += 1
        status = Status(value, handle)
        self.statuses.append(status)
        return status

    def read(self, status: Status) -> float:
        """Waits for ``status``; the last stage's loss, or StageGaveUp if a stage failed."""
        self._complete(status, self.interrupt)
        self.statuses = [s for s in self.statuses if s is not status]
        assert status.gathered is not None
        if bool((status.gathered[:, 0] != 0).any()):
            raise StageGaveUp("a stage's status says it failed")
        return float(status.gathered[self.loss_rank, 1])

    def _complete(self, status: Status, interrupt: Any) -> None:
        wait_for(status.handle, self.comm, "allgather", self.comm.rank, interrupt)
        status.gathered = status.handle.wait()

    # -- after a failure ----------------------------------------------------------

    def settle(
        self, error: BaseException, what: str, *, status_due: bool, where: str = ""
    ) -> PipelineRemoteError | PipelineError:
        """Brings every stage to the same clean state; returns the error to raise.

        Args:
            error: what this stage raised (:class:`StageGaveUp` if it only
                learned of another stage's failure).
            what: the call, for the message (``"Pipeline.step (schedule='gpipe') failed"``).
            status_due: this call normally ends with a status that was not
                issued yet (issued now, so that a stage blocked in it moves on).
            where: what this stage was doing (``"forward of micro-batch 2"``).

        Returns:
            :class:`PipelineRemoteError` naming the failed stages, the same on
            every stage, to be raised in call :attr:`raise_in`; or, when the
            stages could not be brought together in time, a
            :class:`PipelineError` saying the pipeline is broken.
        """
        failed = not isinstance(error, StageGaveUp)
        summary = None
        if failed:
            summary = f"{where}: {summarize(error)}" if where else summarize(error)
        try:
            if status_due:
                self.issue(math.nan, ok=False)
            failures = self._agree(_FAILED if failed else _GAVE_UP, summary)
        except CollectiveTimeout as timeout:
            self.raise_in = self.failed_in = self.calls
            return self._break(what, timeout)
        if not failures and self.closed_by:
            # Nothing failed: a stage closed the pipeline while this one was in a call.
            return PipelineValueError(
                f"{what}: stage(s) {self.closed_by} closed the pipeline (Pipeline.close()) "
                "while this stage was in the call; every stage calls close() after the same "
                "calls"
            )
        return PipelineRemoteError(what, failures)

    def close(self) -> PipelineRemoteError | PipelineError | None:
        """Leaves nothing in flight on the pipeline's communicator, before it is freed. Collective.

        The stages settle as after a failure, with notices that say they close:
        the notices complete the receives each stage keeps posted for them (a
        receive never matched would keep the communicator alive in MPI after
        its free), statuses complete, the links are drained. A stage that was
        settling a failure of its own when the others closed takes part in it
        (its notice carries the failure) and listens no more.

        Returns:
            :class:`PipelineRemoteError` when a stage reported a failure no call
            raised here; :class:`PipelineError` when the stages did not settle in
            time (the pipeline is broken: MPI may still use its buffers); else None.
        """
        if self.broken is not None:
            return None  # settled never: what MPI may still touch is kept already
        if not self.closed_by:
            try:
                failures = self._agree(_CLOSING, None)
            except CollectiveTimeout as timeout:
                return self._break("Pipeline.close()", timeout)
            if failures:
                return PipelineRemoteError("Pipeline.close()", failures)
        self._keep.detach()  # no receive left posted: nothing to keep alive
        return None

    def _agree(self, why: int, summary: str | None) -> dict[int, str]:
        """Notices exchanged, statuses caught up and complete, links settled.

        Returns:
            The failures the stages reported (``summary`` is this stage's).
        """
        told = self._tell_others(why)
        heard = self._hear_others()
        while self.issued < max([self.issued, *(issued for issued, _, _ in heard.values())]):
            self.issue(math.nan, ok=False)
        calls = [self.calls, *(calls for _, calls, _ in heard.values())]
        self.raise_in, self.failed_in = max(calls), min(calls)
        for status in self.statuses:
            self._complete(status, None)
        self.statuses.clear()
        every = self.comm.allgather_object((summary, self.passes.ledger()))
        self.passes.settle([ledger for _, ledger in every])
        for r, (_, handle) in zip(self.others, told, strict=True):
            wait_for(handle, self.comm, "send", r, None)
        self.closed_by = sorted(r for r, (_, _, w) in heard.items() if w == _CLOSING)
        if why == _CLOSING or self.closed_by:
            self._listening.clear()  # every notice receive has completed
        else:
            for r in self.others:
                self._listen(r)
        return {r: text for r, (text, _) in enumerate(every) if text is not None}

    def _tell_others(self, why: int) -> list[tuple[torch.Tensor, Handle[None]]]:
        told = []
        for r in self.others:
            notice = torch.tensor([self.issued, self.calls, why], dtype=torch.int64)
            told.append((notice, send(notice, r, _NOTICE_TAG, comm=self.comm, async_op=True)))
        return told

    def _hear_others(self) -> dict[int, tuple[int, int, int]]:
        """Every other stage's notice: the statuses it has issued, the call it is in, why."""
        heard = {}
        for r, handle in self._listening.items():
            wait_for(handle, self.comm, "recv", r, None)
            heard[r] = (
                int(self._notices[r][0]),
                int(self._notices[r][1]),
                int(self._notices[r][2]),
            )
        return heard

    def _break(self, what: str, timeout: CollectiveTimeout) -> PipelineError:
        """The stages could not settle in time: keep what MPI may still touch, forever."""
        self.broken = f"{what}, and the stages did not settle: {timeout}"
        adopt(self.passes.in_flight())
        adopt([(s.value, s.handle) for s in self.statuses])
        _KEPT.append((self._notices, self._listening))
        return PipelineError(
            f"{self.broken}. The pipeline is unusable: build a new Pipeline (or restart the job)"
        )
