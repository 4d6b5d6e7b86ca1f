"""Point-to-point traffic between neighbouring stages, through mpx.collectives.

::

    stage s-1                         stage s                          stage s+1
    ---------                         -------                          ---------
    header j, tensors of j  ------->  header recv posted early; its tensors'
         (one tag per micro-batch)    recvs posted as soon as it arrives
                                      ...           header j, tensors ---->
                                      grad recvs posted right after F(j) <--- grads j
    grads j <--- send(async) -------

A stage border carries any structure of tensors (:mod:`mpx.pipeline.border`):
``recv`` needs a preallocated tensor, so every micro-batch's activation opens
with a header (the structure, each tensor's shape, dtype and whether its
gradient comes back), then one message per tensor, all under the micro-batch's
tag: MPI delivers messages of one tag in the order they were sent, to receives
in the order they were posted, so the header meets the receive posted first.
The receiver posts the header receives of a call's micro-batches at once and
each micro-batch's tensor receives as soon as its header is in (while polling
between layers), into buffers drawn from a pool keyed by (shape, dtype) and
given back after the micro-batch's backward: shapes may change from one
micro-batch to the next; a repeated one reuses. A header that repeats the
last one sent to the same stage is a one-byte marker (``_SAME``). Gradients
need no header: the receiver knows the shapes it sent. Every micro-batch has its own tag, so the
order in which micro-batches complete does not matter. Send handles are
polled and dropped as they finish and waited for at the end of each call.

Memory safety: MPI writes into a receive buffer (and reads a send buffer)
until its request completes, so a box never lets go of a tensor whose message
is in flight -- not when a wait raises, not when a slot is reused (that is an
error), not when the box is dropped (its tensors are adopted, below). After a
failed call the pipeline settles every link (:mod:`mpx.pipeline.failure`) with
the counts each box keeps: messages sent and receives posted per tag, and the
sizes of the last sends of each tag.
"""

from __future__ import annotations

import time
import weakref
from collections import Counter, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mpx.collectives import CollectiveTimeout, Communicator, Handle, recv, send
from mpx.collectives.building_blocks import Backoff, decode_header, usable_cores
from mpx.collectives.building_blocks import encode_header as _encode_header
from mpx.pipeline.border import (
    HEADER_BYTES,
    MAX_TENSORS,
    Spec,
    carries_grad,
    decode,
    encode,
    flatten,
    wire_dtype,
)
from mpx.pipeline.errors import PipelineError, PipelineTypeError, PipelineValueError

__all__ = [
    "WAITED",
    "Inbox",
    "Interrupt",
    "Outbox",
    "Parcel",
    "adopt",
    "decode_header",
    "encode_header",
    "wait_for",
]

_NO_LIMIT_S = 10.0**9
_WINDOW = 8192  # micro-batches that may be in flight on one link at once
_TAG_BASE = {"act": _WINDOW, "grad": 2 * _WINDOW}
# Sizes kept per tag: enough for every send a failure can leave unmatched (one
# micro-batch's header and tensors; a tag is reused only _WINDOW micro-batches later).
_LOGGED_SENDS = MAX_TENSORS + 1
_SPINS = 200  # polls before a waiting rank starts to sleep (oversubscribed only)
# A border whose structure, shapes, dtypes and flags are those of the last one
# sent to the same stage (stream) travels as this one marker byte instead of a
# pickled header: headers are renegotiated only when a shape changes. A sender
# sends each stream's micro-batches in order and the receiver decodes each
# stream's headers in the order it posted them (the same), so a marker always
# means the last full header decoded on its stream. (A pickle starts with 0x80.)
_SAME = 0
_CHECK_EVERY = 64  # polls between two looks at the other stages' failure notices

Interrupt = Callable[[], None]
"""Raises if the wait should end early (another stage failed); called while waiting."""


WAITED = [0.0]
"""Seconds this process has spent waiting for pipeline messages (busy-time accounting)."""


def _oversubscribed(comm: Communicator) -> bool:
    """More ranks on this node than cores this process may run on (cached per comm)."""
    known = comm.cached("pipeline.oversubscribed")
    if known is None:
        known = comm.cache("pipeline.oversubscribed", comm.node_size > usable_cores())
    return bool(known)


def wait_for(
    handle: Handle[Any], comm: Communicator, op: str, peer: int, interrupt: Interrupt | None
) -> None:
    """Waits for a message, looking out for failures elsewhere; times out as ``comm`` says.

    A stage waits a lot (the bubble, a neighbour's compute). With a core per
    rank it polls without pause (MPI's own wait spins the same way). With more
    ranks than cores (CI runs 3 ranks on 2) a spinning rank takes the core
    from a computing one, so it sleeps between polls after a short spin.
    Every few polls ``interrupt`` looks for another stage's failure notice:
    a stage waiting for a neighbour that gave up must not wait forever.

    Raises:
        CollectiveTimeout: past ``comm.timeout`` (``MPX_TIMEOUT``), naming
            ``peer``. Unlike a timed out collective, this leaves the
            communicator usable: the pipeline settles its links after it.
    """
    start = time.perf_counter()
    limit = comm.timeout
    deadline = None if limit is None else time.monotonic() + limit
    # Oversubscribed, a waiting stage must leave the core to the stage that
    # computes: the collectives' own backoff (spin, sched_yield, then sleep).
    backoff = Backoff(spins=_SPINS) if _oversubscribed(comm) else None
    polls = 0
    try:
        while not handle.done():
            if interrupt is not None and polls % _CHECK_EVERY == 0:
                interrupt()
            if deadline is not None and time.monotonic() > deadline:
                assert limit is not None
                raise CollectiveTimeout(op, "mpi", limit, [peer])
            polls += 1
            if backoff is not None:
                backoff.pause()
    finally:
        WAITED[0] += time.perf_counter() - start
    handle.wait()  # finished: returns at once, or raises the operation's error


def _tag(kind: str, j: int) -> int:
    return _TAG_BASE[kind] + j % _WINDOW


def encode_header(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """One tensor's shape and dtype (:func:`mpx.collectives.building_blocks.encode_header`),
    as a border's header holds them for each of its tensors.

    Raises:
        PipelineValueError: more dimensions than a header holds.
        PipelineTypeError: a dtype no operation takes.
    """
    try:
        return _encode_header(shape, dtype)
    except TypeError as exc:
        raise PipelineTypeError(f"an activation cannot cross a stage border: {exc}") from exc
    except ValueError as exc:
        raise PipelineValueError(f"an activation cannot cross a stage border: {exc}") from exc


_ORPHANS: list[tuple[torch.Tensor, Handle[Any]]] = []
"""Messages still in flight when their box was dropped (a Pipeline discarded
without ``flush``, or one whose failure could not be settled): their tensors
stay alive here until MPI is done with them, so MPI never reads or writes
freed memory. Reaped by every box's progress."""


def adopt(entries: list[tuple[torch.Tensor, Handle[Any]]]) -> None:
    """Keeps the tensors of unfinished messages alive until their handles complete."""
    _ORPHANS.extend(entry for entry in entries if not entry[1].completed)


def _adopt_box(box: dict[str, Any]) -> None:
    """A box's finalizer (gets the box's ``__dict__``): adopts its messages in flight."""
    entries: list[tuple[torch.Tensor, Handle[Any]]] = [
        *(e for es in box.get("_inflight", {}).values() for e in es),
        *box.get("_headers", {}).values(),
        *(e for es in box.get("_pending", {}).values() for e in es),
        *box.get("_drains", []),
        *box.get("_answers", []),
    ]
    adopt(entries)


def _reap_orphans() -> None:
    if _ORPHANS:
        _ORPHANS[:] = [(t, h) for t, h in _ORPHANS if not h.done()]


class _Pool:
    """Free receive buffers by (shape, dtype)."""

    def __init__(self) -> None:
        self._free: dict[tuple[torch.Size, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        self.allocated = 0

    def take(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        free = self._free[(shape, dtype)]
        if free:
            return free.pop()
        self.allocated += 1
        return torch.empty(shape, dtype=dtype)

    def give(self, buf: torch.Tensor) -> None:
        if buf.dtype != wire_dtype(buf.dtype):
            buf = buf.view(wire_dtype(buf.dtype))  # a bool view of a uint8 buffer
        self._free[(buf.shape, buf.dtype)].append(buf)


@dataclass
class Parcel:
    """One micro-batch's message on a link: its tensors (receive buffers) and, for an
    activation, the structure they fill and which of them carry a gradient back."""

    tensors: list[torch.Tensor]
    spec: Spec = "T"
    flags: list[bool] = field(default_factory=list)


class Inbox:
    """Receives from one neighbour: activations (each with its header) or gradients.

    Attributes:
        posted: receives posted so far, per tag (what :mod:`~mpx.pipeline.failure`
            compares with the sender's count to settle the link).
    """

    def __init__(
        self, comm: Communicator, peer: int, kind: str, interrupt: Interrupt | None = None
    ) -> None:
        self.comm, self.peer, self.kind = comm, peer, kind
        self.interrupt = interrupt
        self.pool = _Pool()
        self.posted: Counter[int] = Counter()
        # Per micro-batch: a header receive not yet decoded (activations only).
        self._headers: dict[int, tuple[torch.Tensor, Handle[torch.Tensor]]] = {}
        # Per micro-batch: its tensors' receives, posted (all messages share the tag).
        self._pending: dict[int, list[tuple[torch.Tensor, Handle[torch.Tensor]]]] = {}
        self._described: dict[int, tuple[Spec, list[bool]]] = {}
        self._dtypes: dict[int, list[torch.dtype]] = {}  # what each buffer holds (bool as uint8)
        self._drains: list[tuple[torch.Tensor, Handle[torch.Tensor]]] = []  # settling only
        # Per stream: the last full header decoded (what a marker repeats), and
        # the header receives posted and not yet opened, in posting order.
        self._known: dict[int, tuple[Spec, list[tuple[torch.Size, torch.dtype]], list[bool]]] = {}
        self._order: dict[int, deque[int]] = {}
        self._stream_of: dict[int, int] = {}
        self.full_headers = 0  # full headers decoded (the rest were markers)
        # Dropped with receives posted: their buffers must outlive them.
        weakref.finalize(self, _adopt_box, self.__dict__)

    def owns(self, tag: int) -> bool:
        """Whether ``tag`` is this box's (activations and gradients have tag ranges apart)."""
        return _TAG_BASE[self.kind] <= tag < _TAG_BASE[self.kind] + _WINDOW

    def _recv(self, buf: torch.Tensor, tag: int) -> Handle[torch.Tensor]:
        handle = recv(buf, self.peer, tag, comm=self.comm, async_op=True)
        self.posted[tag] += 1
        return handle

    def expect(self, ids: list[int], stream: int = 0) -> None:
        """Activations: posts the header receives of micro-batches ``ids``.

        A header shares its micro-batch's tag and is sent first, so it
        matches the receive posted first; its tensors' receives follow once
        it is read (:meth:`progress`, :meth:`get`)."""
        for j in ids:
            if j in self._headers or j in self._pending:
                # Reposting would drop a receive MPI may still write into.
                raise PipelineError(f"internal: micro-batch {j} already has a receive posted")
            buf = self.pool.take(torch.Size((HEADER_BYTES,)), torch.uint8)
            self._headers[j] = (buf, self._recv(buf, _tag(self.kind, j)))
            self._order.setdefault(stream, deque()).append(j)
            self._stream_of[j] = stream

    def _open(self, j: int) -> None:
        """Reads micro-batch ``j``'s header (waiting for it) and posts its tensors' receives;
        the headers posted before it on its stream first (they were sent before it)."""
        order = self._order[self._stream_of[j]]
        while order and order[0] != j:
            self._open_next(order)
        self._open_next(order)

    def _open_next(self, order: deque[int]) -> None:
        j = order[0]
        buf, handle = self._headers[j]
        wait_for(handle, self.comm, "recv", self.peer, self.interrupt)
        del self._headers[j]
        order.popleft()
        stream = self._stream_of.pop(j)
        if int(buf[0]) == _SAME:
            self.pool.give(buf)
            if stream not in self._known:
                raise PipelineError(f"internal: header {j} repeats a header never received")
            spec, metas, flags = self._known[stream]
        else:
            # The message fills only the start of the buffer; unpickling stops at its end.
            spec, metas, flags = decode(buf)
            self.pool.give(buf)
            self._known[stream] = (spec, metas, flags)
            self.full_headers += 1
        self._described[j] = (spec, flags)
        self.post(j, metas)

    def post(self, j: int, metas: list[tuple[torch.Size, torch.dtype]]) -> None:
        """Posts the receives of micro-batch ``j``'s tensors into pooled buffers."""
        if j in self._pending:
            # Overwriting the entry would free buffers MPI still writes into.
            raise PipelineError(f"internal: micro-batch {j} already has a receive posted")
        tag = _tag(self.kind, j)
        entries = self._pending[j] = []
        for shape, dtype in metas:
            buf = self.pool.take(shape, wire_dtype(dtype))
            entries.append((buf, self._recv(buf, tag)))
        self._dtypes[j] = [dtype for _, dtype in metas]

    def get(self, j: int) -> Parcel:
        """Waits for micro-batch ``j``; the buffers are ours until :meth:`release`."""
        if j in self._headers:
            self._open(j)
        if j not in self._pending:
            raise PipelineError(f"internal: no receive posted for micro-batch {j}")
        entries = self._pending[j]
        # Stay pending until complete: a wait that raises leaves the buffers here.
        for _, handle in entries:
            wait_for(handle, self.comm, "recv", self.peer, self.interrupt)
        del self._pending[j]
        spec, flags = self._described.pop(j, ("T", []))
        dtypes = self._dtypes.pop(j)
        tensors = [
            buf if buf.dtype == d else buf.view(d)
            for (buf, _), d in zip(entries, dtypes, strict=True)
        ]
        return Parcel(tensors, spec, flags)

    def release(self, tensors: list[torch.Tensor]) -> None:
        for buf in tensors:
            self.pool.give(buf)

    def progress(self) -> None:
        """Lets MPI move the messages in flight (a test per pending receive); a header
        that has arrived gets its tensors' receives posted at once (before the sender
        of a large message waits for them), each stream's in posting order."""
        for order in self._order.values():
            while order and self._headers[order[0]][1].done():
                self._open_next(order)
        for entries in self._pending.values():
            for _, handle in entries:
                handle.done()
        _reap_orphans()

    # -- settling after a failure (see mpx.pipeline.failure) ----------------------

    def in_flight(self) -> list[tuple[torch.Tensor, Handle[Any]]]:
        """The receives posted and not yet taken, with their buffers."""
        return [
            *self._headers.values(),
            *(entry for entries in self._pending.values() for entry in entries),
            *self._drains,
        ]

    def drain(self, sent: dict[int, tuple[int, list[tuple[int, torch.dtype]]]]) -> None:
        """Posts a receive for every message the peer sent (``sent``: its ledger) and no
        receive of this box will take: the last ones of their tag, of the logged sizes."""
        for tag, (count, sizes) in sent.items():
            missing = count - self.posted[tag]
            if missing > len(sizes):
                raise PipelineError(
                    f"internal: {missing} unreceived messages of tag {tag}, {len(sizes)} logged"
                )
            for numel, dtype in sizes[len(sizes) - missing :] if missing > 0 else []:
                buf = torch.empty(numel, dtype=dtype)
                self._drains.append((buf, self._recv(buf, tag)))

    def reset(self) -> None:
        """Forgets everything in progress; every receive must have completed."""
        assert all(h.completed for _, h in self.in_flight())
        for buf, _ in self._headers.values():
            self.pool.give(buf)
        for entries in self._pending.values():
            self.release([buf for buf, _ in entries])
        self._headers.clear()
        self._pending.clear()
        self._described.clear()
        self._dtypes.clear()
        self._drains.clear()
        self.posted.clear()
        self._known.clear()
        self._order.clear()
        self._stream_of.clear()


class Outbox:
    """Sends to one neighbour, asynchronously; holds each tensor until its send is done.

    Attributes:
        sent: messages sent so far, per tag.
        sizes: per tag, (numel, dtype) of its last sends: what a receiver must
            post to take the ones a failure left unmatched.
    """

    def __init__(
        self, comm: Communicator, peer: int, kind: str, interrupt: Interrupt | None = None
    ) -> None:
        self.comm, self.peer, self.kind = comm, peer, kind
        self.interrupt = interrupt
        self.sent: Counter[int] = Counter()
        self.sizes: dict[int, deque[tuple[int, torch.dtype]]] = defaultdict(
            lambda: deque(maxlen=_LOGGED_SENDS)
        )
        self._inflight: dict[int, list[tuple[torch.Tensor, Handle[None]]]] = {}
        self._answers: list[tuple[torch.Tensor, Handle[None]]] = []  # settling only
        # Per receiving stream (virtual stage): what the last full header described.
        self._last: dict[int, Any] = {}
        self.full_headers = 0  # full headers sent (the rest were markers)
        # Dropped with sends in flight: hand them over instead of freeing them.
        weakref.finalize(self, _adopt_box, self.__dict__)

    def owns(self, tag: int) -> bool:
        """Whether ``tag`` is this box's (activations and gradients have tag ranges apart)."""
        return _TAG_BASE[self.kind] <= tag < _TAG_BASE[self.kind] + _WINDOW

    def _send(self, t: torch.Tensor, tag: int) -> Handle[None]:
        handle = send(t, self.peer, tag, comm=self.comm, async_op=True)
        self.sent[tag] += 1
        self.sizes[tag].append((t.numel(), t.dtype))
        return handle

    def send(
        self, j: int, obj: Any, flags: list[bool] | None = None, stream: int = 0
    ) -> list[bool]:
        """Activations: sends micro-batch ``j``'s border ``obj`` (header, then tensors).

        ``flags`` (whether each tensor's gradient comes back) default to what
        :func:`~mpx.pipeline.border.carries_grad` says in the current grad mode.

        Returns:
            Per tensor of ``obj`` (in :func:`~mpx.pipeline.border.flatten` order),
            whether its gradient will come back.

        Raises:
            PipelineTypeError, PipelineValueError: ``obj`` cannot cross a border
                (nothing is sent then).
        """
        tensors, spec = flatten(obj)
        if flags is None:
            flags = [carries_grad(t) for t in tensors]
        described = (spec, [(tuple(t.shape), t.dtype) for t in tensors], flags)
        if self._last.get(stream) == described:
            # Same structure, shapes, dtypes and flags as the last full header
            # to this stream: one marker byte (the receiver kept it decoded).
            header = torch.tensor([_SAME], dtype=torch.uint8)
        else:
            header = encode(tensors, spec, flags)
            self._last[stream] = described
            self.full_headers += 1
        self.send_tensors(j, [header, *tensors])
        return flags

    def send_tensors(self, j: int, tensors: list[torch.Tensor]) -> None:
        """Sends ``tensors`` as micro-batch ``j``'s messages, in order (one tag)."""
        if j in self._inflight:
            raise PipelineError(f"internal: micro-batch {j} is already being sent")
        tag = _tag(self.kind, j)
        entries = self._inflight[j] = []
        for t in tensors:
            wire = t.detach().contiguous()
            if wire.dtype != wire_dtype(wire.dtype):
                wire = wire.view(wire_dtype(wire.dtype))
            entries.append((wire, self._send(wire, tag)))
        self._reap()

    def progress(self) -> None:
        """Lets MPI move the messages in flight; drops the finished ones."""
        self._reap()

    def _reap(self) -> None:
        for j in [j for j, es in self._inflight.items() if all(h.done() for _, h in es)]:
            del self._inflight[j]
        _reap_orphans()

    def wait(self, j: int) -> None:
        for _, handle in self._inflight.get(j, []):
            wait_for(handle, self.comm, "send", self.peer, self.interrupt)
        self._inflight.pop(j, None)

    def wait_all(self) -> None:
        for j in list(self._inflight):
            self.wait(j)

    # -- settling after a failure (see mpx.pipeline.failure) ----------------------

    def in_flight(self) -> list[tuple[torch.Tensor, Handle[Any]]]:
        """The sends not known to be complete, with their tensors."""
        return [*(e for es in self._inflight.values() for e in es), *self._answers]

    def answer(self, posted: dict[int, int]) -> None:
        """Sends an empty message to every receive the peer posted (``posted``: its
        ledger) that no send of this box will match; a receive takes a shorter message."""
        for tag, count in posted.items():
            for _ in range(count - self.sent[tag]):
                empty = torch.empty(0)
                self._answers.append((empty, self._send(empty, tag)))

    def reset(self) -> None:
        """Forgets everything in progress; every send must have completed."""
        assert all(h.completed for _, h in self.in_flight())
        self._inflight.clear()
        self._answers.clear()
        self.sent.clear()
        self.sizes.clear()
        self._last.clear()
