"""Point-to-point traffic between neighbouring stages, through mpx.collectives.

::

    stage s-1                         stage s                          stage s+1
    ---------                         -------                          ---------
    header ------------------------>  (once per call: shape, dtype)
    act j  ---- send(async) ------->  recv posted early into a pooled buffer
                                      ...                  header --->
                                      act j ---- send(async) ------>
                                      grad recv posted right after F(j) <--- grad j
    grad j <--- send(async) --------

``recv`` needs a preallocated tensor, so the sender opens each call with a
10-int header (dtype, ndim, dims); the receiver then posts the receives for the
call's micro-batches at once, into buffers drawn from a pool keyed by (shape,
dtype) and given back after the micro-batch's backward: a new shape allocates,
a repeated one reuses. Every message of micro-batch ``j`` carries its own tag,
so the order in which receives complete does not matter. Send handles are
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
from typing import Any

import torch

from mpx.collectives import CollectiveTimeout, Communicator, Handle, recv, send
from mpx.collectives.building_blocks import HEADER_LEN, decode_header, usable_cores
from mpx.collectives.building_blocks import encode_header as _encode_header
from mpx.pipeline.errors import PipelineError, PipelineTypeError, PipelineValueError

__all__ = [
    "WAITED",
    "Inbox",
    "Interrupt",
    "Outbox",
    "adopt",
    "decode_header",
    "encode_header",
    "wait_for",
]

_HEADER_TAG = 1
_NO_LIMIT_S = 10.0**9
_WINDOW = 8192  # micro-batches that may be in flight on one link at once
_TAG_BASE = {"act": _WINDOW, "grad": 2 * _WINDOW}
_LOGGED_SENDS = 8  # sizes kept per tag: enough for every send a failure can leave unmatched
_SPINS = 200  # polls before a waiting rank starts to sleep (oversubscribed only)
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
    sleepy = _oversubscribed(comm)
    polls = 0
    try:
        while not handle.done():
            if interrupt is not None and polls % _CHECK_EVERY == 0:
                interrupt()
            if deadline is not None and time.monotonic() > deadline:
                assert limit is not None
                raise CollectiveTimeout(op, "mpi", limit, [peer])
            polls += 1
            if sleepy and polls > _SPINS:
                time.sleep(min(1e-3, 1e-5 * (polls - _SPINS)))
    finally:
        WAITED[0] += time.perf_counter() - start
    handle.wait()  # finished: returns at once, or raises the operation's error


def _tag(kind: str, j: int) -> int:
    return _TAG_BASE[kind] + j % _WINDOW


def encode_header(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """The header of an activation (:func:`mpx.collectives.building_blocks.encode_header`).

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
        *box.get("_inflight", {}).values(),
        *box.get("_headers", []),
        *box.get("_pending", {}).values(),
        *box.get("_drains", []),
        *box.get("_answers", []),
    ]
    if box.get("_header_handle") is not None:
        entries.append((box["_header"], box["_header_handle"]))
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
        self._free[(buf.shape, buf.dtype)].append(buf)


class Inbox:
    """Receives from one neighbour: activations (with headers) or gradients.

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
        self._header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        self._header_handle: Handle[torch.Tensor] | None = None
        self._expect: list[int] = []
        self._pending: dict[int, tuple[torch.Tensor, Handle[torch.Tensor]]] = {}
        self._drains: list[tuple[torch.Tensor, Handle[torch.Tensor]]] = []  # settling only
        # Dropped with receives posted: their buffers must outlive them.
        weakref.finalize(self, _adopt_box, self.__dict__)

    def _recv(self, buf: torch.Tensor, tag: int) -> Handle[torch.Tensor]:
        handle = recv(buf, self.peer, tag, comm=self.comm, async_op=True)
        self.posted[tag] += 1
        return handle

    def expect(self, ids: list[int]) -> None:
        """Activations: posts the header receive of a call carrying micro-batches ``ids``."""
        if not ids:
            return
        if self._header_handle is not None:
            # Reposting would drop a receive MPI may still write into.
            raise PipelineError("internal: a header receive is already posted on this link")
        self._expect = ids
        self._header_handle = self._recv(self._header, _HEADER_TAG)

    def _post_expected(self) -> None:
        assert self._header_handle is not None
        wait_for(self._header_handle, self.comm, "recv", self.peer, self.interrupt)
        self._header_handle = None
        shape, dtype = decode_header(self._header)
        for j in self._expect:
            self.post(j, shape, dtype)
        self._expect = []

    def post(self, j: int, shape: torch.Size, dtype: torch.dtype) -> None:
        """Posts the receive of micro-batch ``j`` into a pooled buffer."""
        if j in self._pending:
            # Overwriting the entry would free a buffer MPI still writes into.
            raise PipelineError(f"internal: micro-batch {j} already has a receive posted")
        buf = self.pool.take(shape, dtype)
        self._pending[j] = (buf, self._recv(buf, _tag(self.kind, j)))

    def get(self, j: int) -> torch.Tensor:
        """Waits for micro-batch ``j``; the buffer is ours until :meth:`release`."""
        if j not in self._pending and self._header_handle is not None:
            self._post_expected()
        if j not in self._pending:
            raise PipelineError(f"internal: no receive posted for micro-batch {j}")
        buf, handle = self._pending[j]
        # Stays pending until complete: a wait that raises leaves the buffer here.
        wait_for(handle, self.comm, "recv", self.peer, self.interrupt)
        del self._pending[j]
        return buf

    def release(self, buf: torch.Tensor) -> None:
        self.pool.give(buf)

    def progress(self) -> None:
        """Lets MPI move the messages in flight (a test per pending receive)."""
        for _, handle in self._pending.values():
            handle.done()
        _reap_orphans()

    # -- settling after a failure (see mpx.pipeline.failure) ----------------------

    def in_flight(self) -> list[tuple[torch.Tensor, Handle[Any]]]:
        """The receives posted and not yet taken, with their buffers."""
        entries: list[tuple[torch.Tensor, Handle[Any]]] = [*self._pending.values(), *self._drains]
        if self._header_handle is not None:
            entries.append((self._header, self._header_handle))
        return entries

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
        for buf, _ in self._pending.values():
            self.pool.give(buf)
        self._pending.clear()
        self._drains.clear()
        self._header_handle = None
        self._expect = []
        self.posted.clear()


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
        self._needs_header = False
        self._inflight: dict[int, tuple[torch.Tensor, Handle[None]]] = {}
        self._headers: list[tuple[torch.Tensor, Handle[None]]] = []
        self._answers: list[tuple[torch.Tensor, Handle[None]]] = []  # settling only
        # Dropped with sends in flight: hand them over instead of freeing them.
        weakref.finalize(self, _adopt_box, self.__dict__)

    def _send(self, t: torch.Tensor, tag: int) -> Handle[None]:
        handle = send(t, self.peer, tag, comm=self.comm, async_op=True)
        self.sent[tag] += 1
        self.sizes[tag].append((t.numel(), t.dtype))
        return handle

    def new_call(self) -> None:
        """Activations: the next send opens with a header."""
        self._needs_header = True

    def send(self, j: int, t: torch.Tensor) -> None:
        if j in self._inflight:
            raise PipelineError(f"internal: micro-batch {j} is already being sent")
        t = t.detach().contiguous()
        if self._needs_header:
            header = encode_header(t.shape, t.dtype)
            self._headers.append((header, self._send(header, _HEADER_TAG)))
            self._needs_header = False
        self._inflight[j] = (t, self._send(t, _tag(self.kind, j)))
        self._reap()

    def progress(self) -> None:
        """Lets MPI move the messages in flight; drops the finished ones."""
        self._reap()

    def _reap(self) -> None:
        for j in [j for j, (_, h) in self._inflight.items() if h.done()]:
            del self._inflight[j]
        self._headers = [(t, h) for t, h in self._headers if not h.done()]
        _reap_orphans()

    def wait(self, j: int) -> None:
        entry = self._inflight.get(j)
        if entry is not None:
            wait_for(entry[1], self.comm, "send", self.peer, self.interrupt)
            del self._inflight[j]

    def wait_all(self) -> None:
        for entries in (self._headers, list(self._inflight.values())):
            for _, handle in entries:
                wait_for(handle, self.comm, "send", self.peer, self.interrupt)
        self._headers.clear()
        self._inflight.clear()

    # -- settling after a failure (see mpx.pipeline.failure) ----------------------

    def in_flight(self) -> list[tuple[torch.Tensor, Handle[Any]]]:
        """The sends not known to be complete, with their tensors."""
        return [*self._headers, *self._inflight.values(), *self._answers]

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
        self._headers.clear()
        self._inflight.clear()
        self._answers.clear()
        self._needs_header = False
        self.sent.clear()
        self.sizes.clear()
