"""One rank's passes over micro-batches: what the executor drives.

A :class:`~mpx.pipeline.pipeline.Pipeline` owns one :class:`StagePasses`; the
executor (:mod:`mpx.pipeline.runtime.executor`) runs a schedule's actions through it::

    Pipeline ── Executor (executor.py): one loop over any schedule's actions
                   ├── StagePasses (this module): input, forward, backward,
                   │   input_grad, weight_grad, neighbour traffic, busy time
                   └── hooks (executor.py, stale.py): what a schedule adds

A rank may run several virtual stages (its chunks, :attr:`Stage.parts`): each
micro-batch's activation goes to the rank of the next virtual stage (or is
handed over in place when that is this rank, the V's turn), its gradient back
to the rank of the previous one. Messages are keyed by ``j·S + s`` (``S``
virtual stages, ``s`` the receiving one), one tag per key on each link.

The backward can be split (``I`` then ``W``, :meth:`StagePasses.input_grad`,
:meth:`StagePasses.weight_grad`). ``W`` must neither walk the chunk's graph
again nor make ``I`` keep it (the whole graph of every micro-batch between
its ``I`` and ``W`` would stay alive: many times 1F1B's memory). So ``I``
leaves, per call that takes one of the chunk's weights, what its weights'
gradients need (a product's input and its output's gradient, or the call's own
small graph), frees the graph, and ``W`` computes them
(:mod:`mpx.pipeline.split_backward.deferred`). The calls are found in the autograd graph
(:mod:`mpx.pipeline.split_backward.graph_split`: matrix products, as in Linear, Conv1D's
``addmm``, an attention's projections, ``x @ W``), or, for a chunk whose graph
showed another use of a weight (a convolution, an LSTM), while its forward runs
(:func:`mpx.pipeline.split_backward.capture.capturing`). Cheap weights (norms, 1-D scales,
embeddings) get their gradient in ``I``. A forward that ran without capturing
and is then split keeps its graph from ``I`` to ``W`` instead
(:mod:`mpx.pipeline.split_backward.retained`).
"""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from mpx.collectives import CollectiveTimeout, Communicator, Handle
from mpx.pipeline.model import Stage, Weights, carries_grad, flatten, unflatten
from mpx.pipeline.runtime.transport import WAITED, Inbox, Interrupt, Outbox, wait_for
from mpx.pipeline.schedules import local_stages, rank_of
from mpx.pipeline.split_backward import ChunkSplit, Held, Kept, Records, weight_grads
from mpx.pipeline.split_backward import input_grad as retained_input_grad

__all__ = ["LossFn", "Micro", "StagePasses", "Stash"]

LossFn = Callable[[Any, Any], torch.Tensor]
"""``loss_fn(output, target)``: the last stage's output and the target (tensors or structures)."""


def _unpooled(y: Any, pins: list[_Pin]) -> Any:
    """The last stage's output for ``loss_fn``, each tensor that shares memory with a
    received buffer copied (differentiably). A last stage that returns its input, or a
    view of it (``nn.Identity``, ``nn.Flatten``), would hand ``loss_fn`` a pooled
    receive buffer that a later message refills: a ``loss_fn`` keeping its argument
    (predictions for a metric) saw every kept tensor turn into the last one."""
    pooled = {b.untyped_storage().data_ptr() for pin in pins for b in pin.bufs}
    if not pooled:
        return y
    tensors, spec = flatten(y)
    shared = [t.untyped_storage().data_ptr() in pooled for t in tensors]
    if not any(shared):
        return y
    return unflatten(spec, [t.clone() if c else t for t, c in zip(tensors, shared, strict=True)])


class _Pin:
    """Received buffers, given back to their inbox when no micro-batch chunk reads them.

    A chunk's output handed to this rank's next chunk may be a view of the
    chunk's input (a slicing layer), so the next chunk's graph (kept until its
    ``W`` on the retained path) reads the buffers too: each reader holds a use.
    """

    __slots__ = ("box", "bufs", "users")

    def __init__(self, box: Inbox, bufs: list[torch.Tensor]) -> None:
        self.box, self.bufs, self.users = box, bufs, 1


@dataclass
class Stash:
    """What the asynchronous hooks (:class:`mpx.pipeline.runtime.stale.AsyncHooks`) keep of one
    micro-batch on one chunk from its forward to its backward."""

    values: dict[torch.nn.Parameter, torch.Tensor] | None  # the forward's (None: live ones)
    version: int  # the chunk's optimizer steps when the forward ran
    grad_leaves: Weights | None = None  # the leaves the backward's weight gradients reach
    gap_ref: dict[torch.nn.Parameter, torch.Tensor] | None = None  # gap-aware: θ_used


@dataclass
class Micro:
    """What a rank keeps of one micro-batch on one chunk between its forward and backward."""

    feed: Any  # the stage input: a border structure (leaves requiring grad past stage 0)
    pins: list[_Pin] = field(default_factory=list)  # pooled buffers behind ``feed``
    leaves: list[torch.Tensor] = field(default_factory=list)  # feed tensors owed a gradient
    out: Any = None  # output with its graph (None if recomputed)
    flags: list[bool] = field(default_factory=list)  # which output tensors get a gradient
    loss: torch.Tensor | None = None  # last stage: the loss with its graph
    target: Any = None
    recompute: bool = False
    stage: int = 0  # the virtual stage
    # The weights the forward runs on, and a recomputation in the backward
    # (the asynchronous hooks' stashed or predicted ones); None: the live parameters.
    weights: Weights | None = None
    backward_weights: Weights | None = None
    stash: Stash | None = None  # the asynchronous hooks' own state (stale.py)
    forward_only: bool = False  # an evaluation call: no gradient comes back
    to_send: Any = None  # the output, between F and its SEND_F
    grads_in: list[torch.Tensor] | None = None  # the output's gradients, received (RECV_B)
    grads_out: list[torch.Tensor] | None = None  # the input's gradients, until SEND_B
    w_due: bool = False  # between I and W: the micro-batch stays live for W
    capture: bool = False  # the backward will be split: weight calls record for W
    records: Records = field(default_factory=Records)  # W's work, left by I (deferred.py)
    kept: Kept | None = None  # W's work on a chunk that keeps its graph


class StagePasses:
    """The passes of one micro-batch on this rank's chunks, and the neighbour traffic.

    Attributes:
        stage: this rank's layers (one part per chunk).
        stage_id, num_stages: this rank and the number of ranks.
        first, last: whether this rank reads the inputs (holds virtual stage 0)
            and the targets (holds the last virtual stage).
        stages: this rank's virtual stages, in the order of ``stage.parts``.
        act_in, act_out, grad_in, grad_out: per peer rank, the boxes.
        busy_seconds: compute time of the last call (see :meth:`timed`).

    Example::

        passes = StagePasses(comm, stage)
        passes.start_call([0, 1])
        mb = passes.input(0, x)            # x on the first stage, else received
        passes.forward(0, mb, 0, loss_fn)
        passes.backward(0, mb, 0, loss_fn, scale=0.5)
        passes.finish_sends()
    """

    def __init__(
        self, comm: Communicator, stage: Stage, stages_per_rank: int = 1, style: str = "loop"
    ) -> None:
        # Imported now, by every rank alike, not when the package is imported:
        # autograd imports it (and sympy: seconds on a loaded machine) at the
        # first backward given explicit output gradients, which would stall the
        # other stages in their first call; a process that never builds a
        # pipeline does not pay for it.
        importlib.import_module("torch.fx.experimental.symbolic_shapes")
        self.stage = stage
        self.num_stages, self.stage_id = comm.size, comm.rank
        p, me = comm.size, comm.rank
        self.virtual = p * stages_per_rank
        self.style = style
        self.stages = local_stages(me, p, stages_per_rank, style)
        self.part = {s: k for k, s in enumerate(self.stages)}
        self.first, self.last = 0 in self.part, self.virtual - 1 in self.part
        self.owner = [rank_of(s, p, style) for s in range(self.virtual)]
        self.act_in: dict[int, Inbox] = {}
        self.act_out: dict[int, Outbox] = {}
        self.grad_in: dict[int, Inbox] = {}
        self.grad_out: dict[int, Outbox] = {}
        for s in self.stages:
            if s > 0 and self.owner[s - 1] != me:
                q = self.owner[s - 1]
                self.act_in.setdefault(q, Inbox(comm, q, "act"))
                self.grad_out.setdefault(q, Outbox(comm, q, "grad"))
            if s < self.virtual - 1 and self.owner[s + 1] != me:
                q = self.owner[s + 1]
                self.act_out.setdefault(q, Outbox(comm, q, "act"))
                self.grad_in.setdefault(q, Inbox(comm, q, "grad"))
        self.inboxes: list[Inbox] = [*self.act_in.values(), *self.grad_in.values()]
        self.outboxes: list[Outbox] = [*self.act_out.values(), *self.grad_out.values()]
        self.boxes: list[Inbox | Outbox] = [*self.inboxes, *self.outboxes]
        # The V's turn: a chunk handing to the next chunk on this rank.
        self._handed: dict[tuple[int, int], tuple[Any, list[bool], list[_Pin]]] = {}
        self._handed_grads: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.held = Held()  # bytes the records of every micro-batch keep for W
        # Per chunk, its parameters: what a split forward's calls are matched
        # against (mpx.pipeline.split_backward.capture), listed once (a walk over the modules
        # per forward cost 0.1 ms on a GPT-2 block).
        self._params = [
            [p for layer in stage.part_modules(k) for p in layer.parameters()]
            for k in range(len(self.stages))
        ]
        # Per chunk, how its split backward finds the weights' products: in the
        # graph, or under the capture mode once the graph showed it must.
        self._splits = [ChunkSplit() for _ in range(len(self.stages))]
        self.busy_seconds = 0.0
        self.doing = "nothing yet"  # the pass under way, for the message if it fails

    def key(self, s: int, j: int) -> int:
        """The message key of micro-batch ``j`` arriving at virtual stage ``s``."""
        return j * self.virtual + s

    def set_interrupt(self, interrupt: Interrupt) -> None:
        """Every wait for a message calls ``interrupt`` now and then (see ``failure``)."""
        for box in self.boxes:
            box.interrupt = interrupt

    # -- one call ---------------------------------------------------------------

    def start_call(self, ids: list[int]) -> None:
        """Posts the header receives of a call carrying micro-batches ``ids``."""
        for s in self.stages:
            if s > 0 and self.owner[s - 1] != self.stage_id:
                self.act_in[self.owner[s - 1]].expect([self.key(s, j) for j in ids], stream=s)

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
        for box in self.outboxes:
            box.wait_all()

    # -- settling after a failure (see mpx.pipeline.runtime.failure) ------------------------

    def ledger(self) -> dict[str, dict[int, Any]]:
        """Per neighbour: messages sent (count and last sizes per tag), receives posted per tag.

        A peer may have two boxes each way (activations and gradients, with
        tags of their own ranges): their counts are merged per peer.
        """
        sent: dict[int, dict[int, Any]] = {}
        for box in self.outboxes:
            mine = sent.setdefault(box.peer, {})
            mine.update({tag: (n, list(box.sizes[tag])) for tag, n in box.sent.items()})
        posted: dict[int, dict[int, Any]] = {}
        for inbox in self.inboxes:
            posted.setdefault(inbox.peer, {}).update(dict(inbox.posted))
        return {"sent": sent, "posted": posted}

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
            sent = ledgers[inbox.peer]["sent"].get(me, {})
            inbox.drain({tag: v for tag, v in sent.items() if inbox.owns(tag)})
        for outbox in self.outboxes:
            posted = ledgers[outbox.peer]["posted"].get(me, {})
            outbox.answer({tag: n for tag, n in posted.items() if outbox.owns(tag)})
        for box in self.boxes:
            for _, handle in box.in_flight():
                try:
                    wait_for(handle, box.comm, "settle", box.peer, None)
                except CollectiveTimeout:
                    raise
                except Exception:  # it completed with an error: complete is what counts here
                    pass
            box.reset()
        self._handed.clear()
        self._handed_grads.clear()

    # -- one micro-batch --------------------------------------------------------

    def input(self, j: int, x: Any, s: int | None = None) -> Micro:
        """Micro-batch ``j``'s input to virtual stage ``s`` (this rank's first by default):
        ``x`` on stage 0, else received or handed over by this rank's previous chunk."""
        s = self.stages[0] if s is None else s
        self.doing = f"input of micro-batch {j}"
        if s == 0:
            assert x is not None
            # A user input that requires grad gets its gradient, as loss.backward() would.
            leaves = [t for t in flatten(x, "inputs")[0] if t.requires_grad]
            return Micro(feed=x, leaves=leaves, stage=s, records=Records(self.held))
        if self.owner[s - 1] == self.stage_id:
            y, flags, pins = self._handed.pop((s, j))
            for pin in pins:
                pin.users += 1
            tensors, spec = flatten(y)
            fed = [
                t.detach().requires_grad_(True) if f else t.detach()
                for t, f in zip(tensors, flags, strict=True)
            ]
            leaves = [t for t, f in zip(fed, flags, strict=True) if f]
            return Micro(
                feed=unflatten(spec, fed),
                pins=list(pins),
                leaves=leaves,
                stage=s,
                records=Records(self.held),
            )
        inbox = self.act_in[self.owner[s - 1]]
        parcel = inbox.get(self.key(s, j))
        tensors = [buf.detach() for buf in parcel.tensors]
        leaves = []
        for t, flag in zip(tensors, parcel.flags, strict=True):
            if flag:
                leaves.append(t.requires_grad_(True))
        return Micro(
            feed=unflatten(parcel.spec, tensors),
            pins=[_Pin(inbox, parcel.tensors)],
            leaves=leaves,
            stage=s,
            records=Records(self.held),
        )

    def _run(self, mb: Micro, g: int, weights: Any) -> Any:
        part = self.part[mb.stage]
        if not mb.capture:
            return self.stage.run(mb.feed, g, weights, part)
        # The weights the calls are matched against: the chunk's parameters, and
        # the tensors a stale schedule runs instead of them (functional_call).
        used = self._params[part]
        if weights is not None:
            used = [*used, *(t for d in weights.values() for t in d.values())]
        with self._splits[part].forward(used, mb.records):
            return self.stage.run(mb.feed, g, weights, part)

    def _remote_next(self, s: int) -> bool:
        return s < self.virtual - 1 and self.owner[s + 1] != self.stage_id

    def _remote_prev(self, s: int) -> bool:
        return s > 0 and self.owner[s - 1] != self.stage_id

    def forward(self, j: int, mb: Micro, g: int, loss_fn: LossFn | None) -> None:
        """``F``: runs the chunk; the last stage's loss, the next chunk's input handed
        over on this rank, or the output kept for :meth:`send_activation`."""
        self.doing = f"forward of micro-batch {j}"
        s = mb.stage
        with torch.set_grad_enabled(not mb.recompute):
            y = self._run(mb, g, mb.weights)
            if s == self.virtual - 1:
                if loss_fn is not None:
                    assert mb.target is not None
                    y = _unpooled(y, mb.pins)
                    mb.loss = loss_fn(y, mb.target)
            elif not self._remote_next(s):
                tensors, _ = flatten(y)
                mb.flags = [carries_grad(t) for t in tensors]
                self._handed[(s + 1, j)] = (y, mb.flags, mb.pins)
            else:
                # The flags are read in this grad mode (see border.carries_grad).
                tensors, _ = flatten(y)
                mb.flags = [carries_grad(t) for t in tensors]
                mb.to_send = y
        if not mb.recompute:
            mb.out = y
        elif mb.loss is not None:
            mb.loss = mb.loss.detach()

    def send_activation(self, j: int, mb: Micro) -> None:
        """``SEND_F``: the output to the next chunk's rank; its gradient's receive is posted."""
        self.doing = f"send of micro-batch {j}"
        s = mb.stage
        y, mb.to_send = mb.to_send, None
        q = self.owner[s + 1]
        self.act_out[q].send(self.key(s + 1, j), y, mb.flags, stream=s + 1)
        if mb.forward_only:
            return  # forward only: no gradient comes back
        tensors, _ = flatten(y)
        self.grad_in[q].post(
            self.key(s, j),
            [(t.shape, t.dtype) for t, f in zip(tensors, mb.flags, strict=True) if f],
        )

    def release_input(self, mb: Micro) -> None:
        """Lets go of the buffers behind the chunk's input: given back once no chunk reads them."""
        for pin in mb.pins:
            pin.users -= 1
            if pin.users == 0:
                pin.box.release(pin.bufs)
        mb.pins = []

    def receive_grads(self, j: int, mb: Micro) -> None:
        """``RECV_B``: waits for the gradients of the chunk's output."""
        self.doing = f"receive of the gradients of micro-batch {j}"
        q = self.owner[mb.stage + 1]
        mb.grads_in = self.grad_in[q].get(self.key(mb.stage, j)).tensors

    def _recompute(self, mb: Micro, g: int, loss_fn: LossFn | None) -> None:
        with self.stage.frozen_statistics(), torch.enable_grad():
            mb.out = self._run(mb, g, mb.backward_weights)
            if mb.stage == self.virtual - 1 and loss_fn is not None:
                assert mb.target is not None
                mb.out = _unpooled(mb.out, mb.pins)
                mb.loss = loss_fn(mb.out, mb.target)

    def _output_grads(self, j: int, mb: Micro, scale: float) -> list[tuple[torch.Tensor, Any]]:
        """(output, its gradient) pairs to differentiate: the scaled loss, or the gradients
        the next virtual stage sent (or handed over) for the outputs that carry one."""
        s = mb.stage
        if s == self.virtual - 1:
            assert mb.loss is not None
            # No explicit gradient for the scalar: autograd imports sympy (seconds,
            # once per process) to check a given one, and the last stage's first
            # backward is what every other stage waits for.
            return [(mb.loss * scale, None)]
        grads: list[torch.Tensor] | None
        if not self._remote_next(s):
            grads = self._handed_grads.pop((s, j))
        else:
            if mb.grads_in is None:
                self.receive_grads(j, mb)
            grads = mb.grads_in
            assert grads is not None
        outs, _ = flatten(mb.out)
        owed = [t for t, flag in zip(outs, mb.flags, strict=True) if flag]
        # A recomputed output may not require grad where its first (no-grad)
        # pass guessed it would (see border.carries_grad): its gradient is dropped.
        return [(t, gr) for t, gr in zip(owed, grads, strict=True) if t.requires_grad]

    def _release_grads(self, j: int, mb: Micro) -> None:
        grads, mb.grads_in = mb.grads_in, None
        if grads is not None:
            q = self.owner[mb.stage + 1]
            self.grad_in[q].release(grads)
            self.act_out[q].wait(self.key(mb.stage + 1, j))  # the output may alias ``bufs``

    def _input_grads(self, j: int, mb: Micro, grads: list[torch.Tensor | None]) -> None:
        """The gradients of the chunk's input: kept for :meth:`send_input_grads`, handed to
        this rank's previous chunk, or (stage 0) accumulated into the user's inputs."""
        s = mb.stage
        full = [
            g if g is not None else torch.zeros_like(t)
            for t, g in zip(mb.leaves, grads, strict=True)
        ]
        if s == 0:
            return
        if not self._remote_prev(s):
            self._handed_grads[(s - 1, j)] = full
        else:
            mb.grads_out = full

    def send_input_grads(self, j: int, mb: Micro) -> None:
        """``SEND_B``: the input's gradients to the previous chunk's rank."""
        self.doing = f"send of the gradients of micro-batch {j}"
        q = self.owner[mb.stage - 1]
        grads, mb.grads_out = mb.grads_out, None
        assert grads is not None, f"internal: no input gradients to send for micro-batch {j}"
        self.grad_out[q].send_tensors(self.key(mb.stage - 1, j), grads)
        if not mb.records and mb.kept is None:
            # After ``I`` a record or the kept graph may hold the input (a first
            # product's input is the receive buffer): then ``W`` lets go of them.
            self.release_input(mb)

    def backward(self, j: int, mb: Micro, g: int, loss_fn: LossFn | None, scale: float) -> None:
        """``B``: the full backward of micro-batch ``j`` (input and weight gradients)."""
        self.doing = f"backward of micro-batch {j}"
        self._backward(j, mb, g, loss_fn, scale)
        weight_grads(mb.records)  # a forward that captured, then a full backward
        self._release_grads(j, mb)
        if not self._remote_prev(mb.stage):
            self.release_input(mb)  # handed over: no SEND_B will (see _Pin)

    def _backward(
        self, j: int, mb: Micro, g: int, loss_fn: LossFn | None, scale: float, split: bool = False
    ) -> None:
        if mb.recompute:
            self._recompute(mb, g, loss_fn)
        pairs = self._output_grads(j, mb, scale)
        if pairs:
            tensors, grads = [t for t, _ in pairs], [gr for _, gr in pairs]
            if split:  # I: the weights' products leave records for W
                self._splits[self.part[mb.stage]].input_backward(tensors, grads, mb.records)
            else:  # frees the graph as it goes (captured calls still record)
                torch.autograd.backward(tensors, grads)
        if mb.stage > 0:  # stage 0's inputs are the user's: autograd filled their .grad
            self._input_grads(j, mb, [t.grad for t in mb.leaves])
        mb.out = mb.loss = None

    def input_grad(
        self,
        j: int,
        mb: Micro,
        g: int,
        loss_fn: LossFn | None,
        scale: float,
        weights: list[torch.Tensor] | None = None,
    ) -> None:
        """``I``: the backward of the chunk less its captured weights' gradients, whose
        work stays in ``mb.records`` for :meth:`weight_grad` (the graph itself is
        freed; see :mod:`mpx.pipeline.split_backward.capture`). A forward that
        did not capture keeps its graph for ``W`` instead (``weights``: the tensors ``W``
        differentiates then; see :mod:`mpx.pipeline.split_backward.retained`)."""
        self.doing = f"input gradient of micro-batch {j}"
        if mb.capture:
            self._backward(j, mb, g, loss_fn, scale, split=True)
            return
        if mb.recompute:
            self._recompute(mb, g, loss_fn)
        pairs = self._output_grads(j, mb, scale)
        grads, mb.kept = retained_input_grad(pairs, mb.leaves, weights or [], mb.stage == 0)
        self._input_grads(j, mb, grads)

    def weight_grad(self, j: int, mb: Micro, weights: list[torch.Tensor] | None = None) -> None:
        """``W``: the recorded weight gradients (or, on a chunk that kept its
        graph, those of ``weights``), accumulated into their ``.grad``."""
        self.doing = f"weight gradient of micro-batch {j}"
        weight_grads(mb.records)
        if mb.kept is not None:
            mb.kept.weight_grad(weights or [])
            mb.kept = None
        # A record may hold the received gradient (the chunk's last product's output
        # gradient) and the received input: their buffers go back only now.
        self._release_grads(j, mb)
        self.release_input(mb)
        mb.out = mb.loss = None
