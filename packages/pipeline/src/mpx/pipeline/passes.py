"""One stage's passes over micro-batches: what every schedule drives.

A :class:`~mpx.pipeline.pipeline.Pipeline` owns one :class:`StagePasses`; the
synchronous schedules (in ``pipeline.py``) and the asynchronous one
(:class:`~mpx.pipeline.stale.StaleRunner`) both run micro-batches through it::

    Pipeline ──┬── StagePasses (this module): input, forward, backward,
               │   start_call, progress, finish_sends, busy-time accounting
               └── StaleRunner (stale.py): gets the StagePasses and two callables
                   of the Pipeline (average_grads, progress)

So ``stale.py`` needs nothing of ``pipeline.py``, and neither imports the other.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from mpx.collectives import CollectiveTimeout, Communicator, Handle
from mpx.pipeline.border import flatten, unflatten
from mpx.pipeline.stage import Stage
from mpx.pipeline.transport import WAITED, Inbox, Interrupt, Outbox, wait_for

__all__ = ["LossFn", "Micro", "StagePasses"]

LossFn = Callable[[Any, Any], torch.Tensor]
"""``loss_fn(output, target)``: the last stage's output and the target (tensors or structures)."""


@dataclass
class Micro:
    """What a stage keeps of one micro-batch between its forward and backward."""

    feed: Any  # the stage input: a border structure (leaves requiring grad past stage 0)
    bufs: list[torch.Tensor] = field(default_factory=list)  # pooled buffers behind ``feed``
    leaves: list[torch.Tensor] = field(default_factory=list)  # feed tensors owed a gradient
    out: Any = None  # output with its graph (None if recomputed)
    flags: list[bool] = field(default_factory=list)  # which output tensors get a gradient
    loss: torch.Tensor | None = None  # last stage: the loss with its graph
    target: Any = None
    recompute: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # the async schedule's state


class StagePasses:
    """The forward and backward of one micro-batch on this stage, and its neighbour traffic.

    Attributes:
        stage: this rank's layers.
        stage_id, num_stages, first, last: where the stage sits.
        act_in, act_out, grad_in, grad_out: the boxes to and from the
            neighbours (None where there is no neighbour).
        busy_seconds: compute time of the last call (see :meth:`timed`).

    Example::

        passes = StagePasses(comm, stage)
        passes.start_call([0, 1])
        mb = passes.input(0, x)            # x on the first stage, else received
        passes.forward(0, mb, 0, loss_fn)
        passes.backward(0, mb, 0, loss_fn, scale=0.5)
        passes.finish_sends()
    """

    def __init__(self, comm: Communicator, stage: Stage) -> None:
        self.stage = stage
        self.num_stages, self.stage_id = comm.size, comm.rank
        self.first, self.last = self.stage_id == 0, self.stage_id == self.num_stages - 1
        prev, nxt = self.stage_id - 1, self.stage_id + 1
        self.act_in = Inbox(comm, prev, "act") if not self.first else None
        self.act_out = Outbox(comm, nxt, "act") if not self.last else None
        self.grad_in = Inbox(comm, nxt, "grad") if not self.last else None
        self.grad_out = Outbox(comm, prev, "grad") if not self.first else None
        self.boxes = [b for b in (self.act_in, self.act_out, self.grad_in, self.grad_out) if b]
        self.inboxes = [b for b in (self.act_in, self.grad_in) if b is not None]
        self.outboxes = [b for b in (self.act_out, self.grad_out) if b is not None]
        self.busy_seconds = 0.0
        self.doing = "nothing yet"  # the pass under way, for the message if it fails

    def set_interrupt(self, interrupt: Interrupt) -> None:
        """Every wait for a message calls ``interrupt`` now and then (see ``failure``)."""
        for box in self.boxes:
            box.interrupt = interrupt

    # -- one call ---------------------------------------------------------------

    def start_call(self, ids: list[int]) -> None:
        """Posts the header receives of a call carrying micro-batches ``ids``."""
        if self.act_in is not None:
            self.act_in.expect(ids)

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        """Sets :attr:`busy_seconds`: the block's time less the time spent waiting on messages."""
        start, waited = time.perf_counter(), WAITED[0]
        yield
        self.busy_seconds = time.perf_counter() - start - (WAITED[0] - waited)

    def progress(self) -> None:
        """Lets MPI move this stage's messages in flight."""
        for box in self.boxes:
            box.progress()

    def finish_sends(self) -> None:
        """Waits for every send still in flight."""
        for box in (self.act_out, self.grad_out):
            if box is not None:
                box.wait_all()

    # -- settling after a failure (see mpx.pipeline.failure) ------------------------

    def ledger(self) -> dict[str, dict[int, Any]]:
        """Per neighbour: messages sent (count and last sizes per tag), receives posted per tag."""
        return {
            "sent": {
                box.peer: {tag: (n, list(box.sizes[tag])) for tag, n in box.sent.items()}
                for box in self.outboxes
            },
            "posted": {box.peer: dict(box.posted) for box in self.inboxes},
        }

    def in_flight(self) -> list[tuple[torch.Tensor, Handle[Any]]]:
        return [entry for box in self.boxes for entry in box.in_flight()]

    def settle(self, ledgers: list[dict[str, dict[int, Any]]]) -> None:
        """Matches every message in flight on this stage's links, waits for all, resets.

        Args:
            ledgers: every stage's :meth:`ledger`, by stage.

        Raises:
            CollectiveTimeout: a message did not complete in time.
        """
        me = self.stage_id
        for inbox in self.inboxes:
            inbox.drain(ledgers[inbox.peer]["sent"].get(me, {}))
        for outbox in self.outboxes:
            outbox.answer(ledgers[outbox.peer]["posted"].get(me, {}))
        for box in self.boxes:
            for _, handle in box.in_flight():
                try:
                    wait_for(handle, box.comm, "settle", box.peer, None)
                except CollectiveTimeout:
                    raise
                except Exception:  # it completed with an error: complete is what counts here
                    pass
            box.reset()

    # -- one micro-batch --------------------------------------------------------

    def input(self, j: int, x: Any) -> Micro:
        """Micro-batch ``j``'s input: ``x`` on the first stage, else received."""
        self.doing = f"input of micro-batch {j}"
        if self.first:
            assert x is not None
            return Micro(feed=x)
        assert self.act_in is not None
        parcel = self.act_in.get(j)
        tensors = [buf.detach() for buf in parcel.tensors]
        leaves = []
        for t, flag in zip(tensors, parcel.flags, strict=True):
            if flag:
                leaves.append(t.requires_grad_(True))
        return Micro(feed=unflatten(parcel.spec, tensors), bufs=parcel.tensors, leaves=leaves)

    def forward(self, j: int, mb: Micro, g: int, loss_fn: LossFn | None) -> None:
        self.doing = f"forward of micro-batch {j}"
        with torch.set_grad_enabled(not mb.recompute):
            y = self.stage.run(mb.feed, g, mb.extra.get("weights"))
            if self.last:
                if loss_fn is not None:
                    assert mb.target is not None
                    mb.loss = loss_fn(y, mb.target)
            else:
                assert self.act_out is not None
                assert self.grad_in is not None
                mb.flags = self.act_out.send(j, y)
                tensors, _ = flatten(y)
                self.grad_in.post(
                    j, [(t.shape, t.dtype) for t, f in zip(tensors, mb.flags, strict=True) if f]
                )
        if not mb.recompute:
            mb.out = y
        elif mb.loss is not None:
            mb.loss = mb.loss.detach()

    def backward(self, j: int, mb: Micro, g: int, loss_fn: LossFn | None, scale: float) -> None:
        """Runs the backward of micro-batch ``j`` and sends its input's gradients back."""
        self.doing = f"backward of micro-batch {j}"
        if mb.recompute:
            with self.stage.frozen_statistics(), torch.enable_grad():
                mb.out = self.stage.run(mb.feed, g, mb.extra.get("backward_weights"))
                if self.last and loss_fn is not None:
                    assert mb.target is not None
                    mb.loss = loss_fn(mb.out, mb.target)
        if self.last:
            assert mb.loss is not None
            torch.autograd.backward(mb.loss * scale)
        else:
            assert self.grad_in is not None
            assert self.act_out is not None
            grads = self.grad_in.get(j).tensors
            outs, _ = flatten(mb.out)
            owed = [t for t, flag in zip(outs, mb.flags, strict=True) if flag]
            # A recomputed output may not require grad where its first (no-grad)
            # pass guessed it would (see border.carries_grad): its gradient is dropped.
            pairs = [(t, gr) for t, gr in zip(owed, grads, strict=True) if t.requires_grad]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [gr for _, gr in pairs])
            self.grad_in.release(grads)
            self.act_out.wait(j)  # the output may alias ``bufs``: done before reuse
        if not self.first:
            assert self.grad_out is not None
            assert self.act_in is not None
            self.grad_out.send_tensors(
                j, [t.grad if t.grad is not None else torch.zeros_like(t) for t in mb.leaves]
            )
            self.act_in.release(mb.bufs)
        mb.out = mb.loss = None
