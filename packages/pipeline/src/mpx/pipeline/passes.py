"""One rank's passes over micro-batches: what the executor drives.

A :class:`~mpx.pipeline.pipeline.Pipeline` owns one :class:`StagePasses`; the
executor (:mod:`mpx.pipeline.executor`) runs a schedule's actions through it::

    Pipeline ── Executor (executor.py): one loop over any schedule's actions
                   ├── StagePasses (this module): input, forward, backward,
                   │   input_grad, weight_grad, neighbour traffic, busy time
                   └── hooks (hooks.py, stale.py): what a schedule adds

A rank may run several virtual stages (its chunks, :attr:`Stage.parts`): each
micro-batch's activation goes to the rank of the next virtual stage (or is
handed over in place when that is this rank, the V's turn), its gradient back
to the rank of the previous one. Messages are keyed by ``j·S + s`` (``S``
virtual stages, ``s`` the receiving one), one tag per key on each link.

The backward can be split (``I`` then ``W``, :meth:`StagePasses.input_grad`,
:meth:`StagePasses.weight_grad`). ``I`` is ``torch.autograd.grad`` with
``inputs=`` the chunk's input tensors, graph kept; ``W`` must not walk the
input-gradient chain again (in a chunk of several layers that would be most
of ``I`` over again). So ``I`` first finds, in the graph, the nodes on the path
from the outputs to the inputs that also feed a weight by a branch of their
own (a Linear's matmul node: its weight slot), and records the gradient that
reaches each of them while ``I`` runs (a node pre-hook); ``W`` starts from
those nodes (``GradientEdge``) with ``inputs=`` only the weights of their
branches, which the input path does not reach again (:func:`weight_starts`).
Where it would (one weight used at two depths of a chunk) ``W`` falls back to
differentiating the outputs again.
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
from mpx.pipeline.border import carries_grad, flatten, unflatten
from mpx.pipeline.schedule import local_stages, rank_of
from mpx.pipeline.stage import Stage
from mpx.pipeline.transport import WAITED, Inbox, Interrupt, Outbox, wait_for

__all__ = ["LossFn", "Micro", "StagePasses", "weight_starts"]

LossFn = Callable[[Any, Any], torch.Tensor]
"""``loss_fn(output, target)``: the last stage's output and the target (tensors or structures)."""


@dataclass
class _Start:
    """Where ``W`` starts: an output tensor (with its gradient) or a node on the input
    path (with the gradients its pre-hook saw in ``I``), and the weights (bits) below."""

    mask: int
    path: int = 0  # the weights its input-path children reach (not to be asked of it)
    tensor: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    node: Any = None
    grads: tuple[torch.Tensor | None, ...] = ()


def weight_starts(
    outputs: list[torch.Tensor], leaves: list[torch.Tensor], weights: list[torch.Tensor]
) -> list[_Start] | None:
    """The starts of ``W`` (see the module docstring), or None to fall back.

    A node on the input path (it reaches a leaf) starts ``W`` for the weights
    its other children reach; an output off that path starts it for all the
    weights below it. None when a start's input-path children reach one of
    its own weights too: from there ``W`` would run the chain again and count
    that weight's deeper use twice.
    """
    edge = torch.autograd.graph.get_gradient_edge
    targets = {edge(t).node for t in leaves}
    bit = {edge(w).node: 1 << k for k, w in enumerate(weights)}
    info: dict[Any, tuple[bool, int]] = {}  # node -> (reaches an input, weights below)
    roots = [t.grad_fn if t.grad_fn is not None else edge(t).node for t in outputs]
    stack: list[tuple[Any, bool]] = [(r, False) for r in roots if r is not None]
    while stack:  # post-order, without recursion (graphs may be deep)
        node, expanded = stack.pop()
        if node in info:
            continue
        children = [c for c, _ in node.next_functions if c is not None]
        if not expanded:
            stack.append((node, True))
            stack.extend((c, False) for c in children if c not in info)
            continue
        reach = node in targets or any(info[c][0] for c in children)
        mask = bit.get(node, 0)
        for c in children:
            mask |= info[c][1]
        info[node] = (reach, mask)
    starts: list[_Start] = []
    for t, r in zip(outputs, roots, strict=True):
        if r is not None and not info[r][0] and info[r][1]:
            starts.append(_Start(info[r][1], tensor=t))
    for node, (reach, _) in info.items():
        if not reach:
            continue
        branch = path = 0
        for c, _ in node.next_functions:
            if c is None:
                continue
            if info[c][0]:
                path |= info[c][1]
            else:
                branch |= info[c][1]
        if branch & path:
            return None
        if branch:
            starts.append(_Start(branch, path, node=node))
    return starts


@dataclass
class Micro:
    """What a rank keeps of one micro-batch on one chunk between its forward and backward."""

    feed: Any  # the stage input: a border structure (leaves requiring grad past stage 0)
    bufs: list[torch.Tensor] = field(default_factory=list)  # pooled buffers behind ``feed``
    leaves: list[torch.Tensor] = field(default_factory=list)  # feed tensors owed a gradient
    out: Any = None  # output with its graph (None if recomputed)
    flags: list[bool] = field(default_factory=list)  # which output tensors get a gradient
    loss: torch.Tensor | None = None  # last stage: the loss with its graph
    target: Any = None
    recompute: bool = False
    stage: int = 0  # the virtual stage
    extra: dict[str, Any] = field(default_factory=dict)  # hooks' state (async: weights used)
    owed: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # W: (out, grad)
    starts: list[_Start] = field(default_factory=list)  # W: where to start (weight_starts)


def _saver(start: _Start) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
    def hook(grads: tuple[torch.Tensor | None, ...]) -> None:
        start.grads = tuple(grads)

    return hook


def _accumulate(w: torch.Tensor, gw: torch.Tensor) -> None:
    with torch.no_grad():
        if w.grad is None:
            w.grad = gw
        else:
            w.grad.add_(gw)


def _from_starts(starts: list[_Start], weights: list[torch.Tensor]) -> None:
    """``W`` from the starts: in groups whose input-path children reach none of the
    group's weights (one autograd call per group, not per node: the nodes of
    parallel branches, such as a block's query, key and value, go together)."""
    groups: list[tuple[int, int, list[_Start]]] = []  # (weights, path weights, starts)
    for st in starts:
        for k, (mask, path, members) in enumerate(groups):
            if not (mask | st.mask) & (path | st.path):
                groups[k] = (mask | st.mask, path | st.path, [*members, st])
                break
        else:
            groups.append((st.mask, st.path, [st]))
    edge_type = torch.autograd.graph.GradientEdge
    for mask, _, members in groups:
        outs: list[Any] = []
        grads: list[torch.Tensor | None] = []
        for st in members:
            if st.tensor is not None:
                outs.append(st.tensor)
                grads.append(st.grad)
            for k, gr in enumerate(st.grads):
                if gr is not None:
                    outs.append(edge_type(st.node, k))
                    grads.append(gr)
        chosen = [w for k, w in enumerate(weights) if mask >> k & 1]
        if not outs:
            continue
        got = torch.autograd.grad(
            outs, inputs=chosen, grad_outputs=grads, retain_graph=True, allow_unused=True
        )
        for w, gw in zip(chosen, got, strict=True):
            if gw is not None:
                _accumulate(w, gw)


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
        self._handed: dict[tuple[int, int], tuple[Any, list[bool]]] = {}
        self._handed_grads: dict[tuple[int, int], list[torch.Tensor]] = {}
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

    # -- settling after a failure (see mpx.pipeline.failure) ------------------------

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
            return Micro(feed=x, leaves=leaves, stage=s)
        if self.owner[s - 1] == self.stage_id:
            y, flags = self._handed.pop((s, j))
            tensors, spec = flatten(y)
            fed = [
                t.detach().requires_grad_(True) if f else t.detach()
                for t, f in zip(tensors, flags, strict=True)
            ]
            leaves = [t for t, f in zip(fed, flags, strict=True) if f]
            return Micro(feed=unflatten(spec, fed), leaves=leaves, stage=s)
        parcel = self.act_in[self.owner[s - 1]].get(self.key(s, j))
        tensors = [buf.detach() for buf in parcel.tensors]
        leaves = []
        for t, flag in zip(tensors, parcel.flags, strict=True):
            if flag:
                leaves.append(t.requires_grad_(True))
        return Micro(
            feed=unflatten(parcel.spec, tensors), bufs=parcel.tensors, leaves=leaves, stage=s
        )

    def _run(self, mb: Micro, g: int, weights: Any) -> Any:
        return self.stage.run(mb.feed, g, weights, self.part[mb.stage])

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
            y = self._run(mb, g, mb.extra.get("weights"))
            if s == self.virtual - 1:
                if loss_fn is not None:
                    assert mb.target is not None
                    mb.loss = loss_fn(y, mb.target)
            elif not self._remote_next(s):
                tensors, _ = flatten(y)
                mb.flags = [carries_grad(t) for t in tensors]
                self._handed[(s + 1, j)] = (y, mb.flags)
            else:
                # The flags are read in this grad mode (see border.carries_grad).
                tensors, _ = flatten(y)
                mb.flags = [carries_grad(t) for t in tensors]
                mb.extra["to_send"] = y
        if not mb.recompute:
            mb.out = y
        elif mb.loss is not None:
            mb.loss = mb.loss.detach()

    def send_activation(self, j: int, mb: Micro) -> None:
        """``SEND_F``: the output to the next chunk's rank; its gradient's receive is posted."""
        self.doing = f"send of micro-batch {j}"
        s = mb.stage
        y = mb.extra.pop("to_send")
        q = self.owner[s + 1]
        self.act_out[q].send(self.key(s + 1, j), y, mb.flags, stream=s + 1)
        if mb.extra.get("eval"):
            return  # forward only: no gradient comes back
        tensors, _ = flatten(y)
        self.grad_in[q].post(
            self.key(s, j),
            [(t.shape, t.dtype) for t, f in zip(tensors, mb.flags, strict=True) if f],
        )

    def release_input(self, mb: Micro) -> None:
        """Gives a received input's buffers back (forward only: no backward will)."""
        if mb.bufs:
            self.act_in[self.owner[mb.stage - 1]].release(mb.bufs)
            mb.bufs = []

    def receive_grads(self, j: int, mb: Micro) -> None:
        """``RECV_B``: waits for the gradients of the chunk's output."""
        self.doing = f"receive of the gradients of micro-batch {j}"
        q = self.owner[mb.stage + 1]
        mb.extra["grads_in"] = self.grad_in[q].get(self.key(mb.stage, j)).tensors

    def _recompute(self, mb: Micro, g: int, loss_fn: LossFn | None) -> None:
        with self.stage.frozen_statistics(), torch.enable_grad():
            mb.out = self._run(mb, g, mb.extra.get("backward_weights"))
            if mb.stage == self.virtual - 1 and loss_fn is not None:
                assert mb.target is not None
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
        if not self._remote_next(s):
            grads = self._handed_grads.pop((s, j))
        else:
            if "grads_in" not in mb.extra:
                self.receive_grads(j, mb)
            grads = mb.extra["grads_in"]
        outs, _ = flatten(mb.out)
        owed = [t for t, flag in zip(outs, mb.flags, strict=True) if flag]
        # A recomputed output may not require grad where its first (no-grad)
        # pass guessed it would (see border.carries_grad): its gradient is dropped.
        return [(t, gr) for t, gr in zip(owed, grads, strict=True) if t.requires_grad]

    def _release_grads(self, j: int, mb: Micro) -> None:
        grads = mb.extra.pop("grads_in", None)
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
            mb.extra["grads_out"] = full

    def send_input_grads(self, j: int, mb: Micro) -> None:
        """``SEND_B``: the input's gradients to the previous chunk's rank."""
        self.doing = f"send of the gradients of micro-batch {j}"
        q = self.owner[mb.stage - 1]
        self.grad_out[q].send_tensors(self.key(mb.stage - 1, j), mb.extra.pop("grads_out"))
        if not mb.owed and not mb.starts:
            # After ``I`` the kept graph still reads the input (a Linear's saved
            # input is the receive buffer): ``W`` gives the buffers back.
            self.act_in[q].release(mb.bufs)
            mb.bufs = []

    def backward(self, j: int, mb: Micro, g: int, loss_fn: LossFn | None, scale: float) -> None:
        """``B``: the full backward of micro-batch ``j`` (input and weight gradients)."""
        self.doing = f"backward of micro-batch {j}"
        if mb.recompute:
            self._recompute(mb, g, loss_fn)
        pairs = self._output_grads(j, mb, scale)
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [gr for _, gr in pairs])
        self._release_grads(j, mb)
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
        """``I``: the gradient of the chunk's input only (``torch.autograd.grad`` with
        ``inputs=`` the input tensors); the graph is kept for :meth:`weight_grad`,
        and where ``W`` will start (``weights``: those it differentiates)."""
        self.doing = f"input gradient of micro-batch {j}"
        if mb.recompute:
            self._recompute(mb, g, loss_fn)
        pairs = self._output_grads(j, mb, scale)
        mb.owed, mb.starts = pairs, []
        grads: list[torch.Tensor | None] = [None] * len(mb.leaves)
        if pairs and mb.leaves:
            needs = [w for w in weights or [] if w.requires_grad]
            outs = [t for t, _ in pairs]
            starts = weight_starts(outs, mb.leaves, needs) if needs else None
            handles = []
            if starts is not None:
                mb.owed, mb.starts = [], starts
                mb.extra["w_needs"] = needs
                given = {id(t): gr for t, gr in pairs}
                for st in starts:
                    if st.tensor is not None:
                        st.grad = given.get(id(st.tensor))
                    else:
                        handles.append(st.node.register_prehook(_saver(st)))
            try:
                got = torch.autograd.grad(
                    outs,
                    inputs=mb.leaves,
                    grad_outputs=[gr for _, gr in pairs],
                    retain_graph=True,
                    allow_unused=True,
                )
            finally:
                for h in handles:
                    h.remove()
            grads = list(got)
            if mb.stage == 0:
                # The user's own inputs that require grad (micro-batches are views of
                # them): the gradient goes on to them as loss.backward() would send it.
                owed = [(t, gt) for t, gt in zip(mb.leaves, grads, strict=True) if gt is not None]
                if owed:
                    torch.autograd.backward([t for t, _ in owed], [gt for _, gt in owed])
        self._input_grads(j, mb, grads)

    def weight_grad(self, j: int, mb: Micro, weights: list[torch.Tensor]) -> None:
        """``W``: the gradients of ``weights`` (the tensors the chunk's forward used),
        accumulated into their ``.grad``: from the starts ``I`` found, else from the
        outputs (``torch.autograd.grad`` with ``inputs=`` the weights)."""
        self.doing = f"weight gradient of micro-batch {j}"
        pairs, mb.owed = mb.owed, []
        needs = [w for w in weights if w.requires_grad]
        if mb.starts:
            _from_starts(mb.starts, mb.extra.pop("w_needs"))
            mb.starts = []
        elif pairs and needs:
            # allow_unused: a weight this micro-batch did not reach gets None.
            got: tuple[torch.Tensor | None, ...] = torch.autograd.grad(
                [t for t, _ in pairs],
                inputs=needs,
                grad_outputs=[gr for _, gr in pairs],
                allow_unused=True,
            )
            with torch.no_grad():
                for w, gw in zip(needs, got, strict=True):
                    if gw is None:
                        continue
                    if w.grad is None:
                        w.grad = gw
                    else:
                        w.grad.add_(gw)
        self._release_grads(j, mb)
        self.release_input(mb)
        mb.out = mb.loss = None
