"""Point-to-point channels: tagged, non-blocking messages between this rank and its peers.

One :class:`Channel` carries every point-to-point message of a layer built on
mpx (a pipeline's activations and gradients, MGRIT's ghost rows)::

    sender                                  receiver
    ------                                  --------
                                            m = ch.expect(peer, tag)       posted ahead
    ch.post(peer, tag, [a, b], header=True)   header --> (shapes, dtypes, note)
                                            ch.progress()   the header is in: the data
                                                            receives are posted at once
                                  a, b  -->                 (into pooled buffers)
    ...compute...                           ...compute...
    ch.flush()   (or ch.wait(sent))         msg = ch.receive(m); msg.tensors, msg.note
                                            ch.release(msg.tensors)    buffers back

A message is one or more tensors under one tag. A receiver that knows their
shapes says so (``expect(peer, tag, like=[(shape, dtype)])`` or ``into=``
tensors); one that does not gets a *header* first (each tensor's shape and
dtype as :mod:`mpx.collectives.tensor_header` writes them, and a picklable
``note`` of the caller's), so shapes may change from one message to the
next. On a ``stream`` a header that repeats the last one posted to the same
peer and stream travels as one 8-byte marker: headers are renegotiated only
when a shape (or the note) changes. That needs one rule: a stream's messages
are expected in the order they are posted (MPI delivers messages of one tag
in order; a stream may span tags).

Everything is non-blocking: ``post`` and ``expect`` return at once, and MPI
moves the messages whenever any of the channel's calls runs (``progress``
between pieces of work, without a progress thread). CPU tensors travel
through MPI; CUDA tensors through the implementations that provide send and
recv for them (``staged``: pinned host buffers; ``mpi`` with a CUDA-aware MPI).

Waits honour the timeout (the channel's, else the communicator's
``MPX_TIMEOUT``) and raise :class:`~mpx.collectives.CollectiveTimeout` naming
the peer -- without breaking the communicator: :meth:`Channel.drain` settles
the links afterwards. ``drain`` is collective: every rank says how its part
went, every message in flight is completed (receives for what was sent and
never expected, empty messages for receives nothing will match), and if any
rank failed, every rank raises :class:`~mpx.collectives.RemoteError` naming it.

Memory safety: MPI reads a send buffer and writes a receive buffer until its
request completes, so the channel holds every tensor whose message is in
flight -- when a wait raises, and when the channel is dropped (its tensors are
then kept alive, module-wide, until MPI is done with them).

Example::

    ch = Channel(comm)
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    incoming = ch.expect(left, tag=7)                   # posted before the peer sends
    ch.post(right, 7, torch.randn(3, n), header=True)   # n may change every time
    x = ch.receive(incoming).tensors[0]
    ch.flush()
"""

from __future__ import annotations

import functools
import pickle
import time
import weakref
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from mpi4py import MPI

from mpx.collectives.checks import check_rank, check_tensor
from mpx.collectives.communicator import CommLike, Communicator, as_communicator, usable_cores
from mpx.collectives.errors import (
    CollectiveTimeout,
    MPXError,
    MPXTypeError,
    MPXValueError,
    RemoteError,
)
from mpx.collectives.exchange import summarize
from mpx.collectives.handle import Backoff, Handle, Requests, Steps
from mpx.collectives.ops import recv, send
from mpx.collectives.tensor_header import HEADER_LEN, decode_header, encode_header

__all__ = [
    "HEADER_BYTES",
    "MAX_NOTE_BYTES",
    "MAX_TENSORS",
    "Channel",
    "Incoming",
    "Interrupt",
    "Ledger",
    "Message",
    "Sent",
]

MAX_TENSORS = 255
"""Tensors in one message with a header."""

MAX_NOTE_BYTES = 16384
"""Room for a header's pickled note."""

_FIXED = 2  # int64 words before the tensor headers: count (or the marker), note length
HEADER_BYTES = 8 * (_FIXED + MAX_TENSORS * HEADER_LEN) + MAX_NOTE_BYTES
"""Bytes of a header receive, posted before the shapes are known."""

_MARKER = -1  # a header's count word: "the last header on this stream, again"
_SPINS = 200  # polls before an oversubscribed waiting rank starts to pause
_CHECK_EVERY = 64  # polls between two calls of the interrupt

Interrupt = Callable[[], None]
"""Raises if a wait should end early (e.g. another rank announced a failure)."""

Ledger = dict[str, dict[int, dict[int, int]]]
"""``{"sent": {peer: {tag: messages}}, "posted": {peer: {tag: receives}}}``."""

Entry = tuple[torch.Tensor, Handle[Any]]

_ORPHANS: list[Entry] = []
"""Messages still in flight when their channel was dropped: their tensors stay alive
here until MPI is done with them. Reaped by every channel's progress."""


def _reap_orphans() -> None:
    if _ORPHANS:
        _ORPHANS[:] = [(t, h) for t, h in _ORPHANS if not h.done()]


def _wire(t: torch.Tensor) -> torch.Tensor:
    """What MPI moves for ``t``: its memory, contiguous, without autograd; bool as uint8."""
    wire = t.detach()
    if not wire.is_contiguous():
        wire = wire.contiguous()
    return wire.view(torch.uint8) if wire.dtype == torch.bool else wire


@dataclass(eq=False)
class Sent:
    """A message being sent; :meth:`Channel.wait` waits for it."""

    peer: int
    tag: int
    entries: list[Entry]

    def done(self) -> bool:
        """Makes progress; True once every part has left (MPI no longer reads it)."""
        return all(h.done() for _, h in self.entries)


@dataclass
class Message:
    """A received message: its tensors (the channel's buffers until released) and note."""

    peer: int
    tag: int
    tensors: list[torch.Tensor]
    note: Any = None


@dataclass(eq=False)
class Incoming:
    """A receive posted ahead (:meth:`Channel.expect`); :meth:`Channel.receive` takes it."""

    peer: int
    tag: int
    stream: int | None
    device: torch.device
    header: Entry | None = None  # the header receive, until decoded
    entries: list[Entry] = field(default_factory=list)  # the data receives, once posted
    dtypes: list[torch.dtype] = field(default_factory=list)  # what each buffer holds
    note: Any = None
    pooled: bool = True  # the buffers are the channel's (not the caller's ``into``)
    taken: bool = False

    @property
    def described(self) -> bool:
        """Whether the shapes are known (given, or the header arrived)."""
        return self.header is None


def encode(tensors: Sequence[torch.Tensor], note: bytes) -> torch.Tensor:
    """A header: count, note length, each tensor's :func:`encode_header`, the note (uint8).

    Raises:
        MPXValueError: too many tensors, too many dimensions, or a note too large.
        MPXTypeError: a dtype no operation takes.
    """
    if len(tensors) > MAX_TENSORS:
        raise MPXValueError(
            f"a message carries {len(tensors)} tensors, more than {MAX_TENSORS}; "
            "stack them into fewer tensors"
        )
    if len(note) > MAX_NOTE_BYTES:
        raise MPXValueError(
            f"a message's note takes {len(note)} bytes pickled, more than {MAX_NOTE_BYTES}; "
            "send large values as tensors"
        )
    words = np.empty(_FIXED + len(tensors) * HEADER_LEN, dtype=np.int64)
    words[0], words[1] = len(tensors), len(note)
    for k, t in enumerate(tensors):
        start = _FIXED + k * HEADER_LEN
        words[start : start + HEADER_LEN] = encode_header(t.shape, t.dtype).numpy()
    data = words.tobytes() + note
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def decode(header: torch.Tensor) -> tuple[list[tuple[torch.Size, torch.dtype]], bytes] | None:
    """What :func:`encode` wrote (``header`` may be longer); None for a marker."""
    raw = header.numpy()
    fixed = raw[: 8 * _FIXED].view(np.int64)
    count, note_len = int(fixed[0]), int(fixed[1])
    if count == _MARKER:
        return None
    end = 8 * (_FIXED + count * HEADER_LEN)
    rows = raw[8 * _FIXED : end].view(np.int64).reshape(count, HEADER_LEN)
    metas = [decode_header(torch.from_numpy(row)) for row in rows]
    return metas, raw[end : end + note_len].tobytes()


class _Pool:
    """Free receive buffers by (shape, dtype, device)."""

    def __init__(self) -> None:
        self._free: dict[tuple[torch.Size, torch.dtype, torch.device], list[torch.Tensor]] = (
            defaultdict(list)
        )
        self.allocated = 0

    def take(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        free = self._free[(shape, dtype, device)]
        if free:
            return free.pop()
        self.allocated += 1
        return torch.empty(shape, dtype=dtype, device=device)

    def give(self, buf: torch.Tensor) -> None:
        if buf.dtype == torch.bool:
            buf = buf.view(torch.uint8)  # the bool view of a uint8 buffer
        self._free[(buf.shape, buf.dtype, buf.device)].append(buf)


def _requests(request: MPI.Request, peer: int) -> Steps[None]:
    yield Requests([request], peers=[peer])


class Channel:
    """Tagged, non-blocking point-to-point messages between this rank and its peers.

    Args:
        comm: the communicator (a raw mpi4py one is wrapped; None: all ranks).
            Channels sharing a communicator (and its other point-to-point users)
            must use tags apart.
        timeout: seconds a wait may take (None: the communicator's ``MPX_TIMEOUT``).
        interrupt: called every few polls of a wait; raises to end it early.

    Attributes:
        full_headers_sent: headers posted that described shapes (the others were
            markers: nothing had changed on their stream).
        full_headers_received: headers decoded that described shapes.
    """

    waited: ClassVar[list[float]] = [0.0]
    """Seconds this process has spent in channel waits (one element: read ``waited[0]``)."""

    def __init__(
        self,
        comm: CommLike | None = None,
        *,
        timeout: float | None = None,
        interrupt: Interrupt | None = None,
    ) -> None:
        self.comm = as_communicator(comm)
        if timeout is not None and (isinstance(timeout, bool) or not timeout > 0):
            raise MPXValueError(f"Channel: timeout must be seconds > 0 or None, got {timeout!r}")
        self._timeout = timeout
        self.interrupt = interrupt
        self._pool = _Pool()
        self._sent: Counter[tuple[int, int]] = Counter()
        self._posted: Counter[tuple[int, int]] = Counter()
        self._sending: list[Sent] = []
        self._incoming: list[Incoming] = []
        self._settling: list[Entry] = []
        # Per (peer, stream): the last header posted / decoded (what a marker repeats),
        # and the header receives not yet decoded, in posting order.
        self._last_out: dict[tuple[int, int], tuple[Any, list[tuple[torch.Size, torch.dtype]]]] = {}
        self._last_in: dict[tuple[int, int], tuple[list[tuple[torch.Size, torch.dtype]], Any]] = {}
        self._order: dict[tuple[int, int], deque[Incoming]] = {}
        self.full_headers_sent = 0
        self.full_headers_received = 0
        # Dropped with messages in flight: their tensors must outlive them.
        weakref.finalize(self, _ORPHANS.extend, _Unfinished(self.__dict__))

    # -- properties -------------------------------------------------------------

    @property
    def timeout(self) -> float | None:
        """Seconds a wait may take: the channel's, else the communicator's (None: no limit)."""
        return self.comm.timeout if self._timeout is None else self._timeout

    @property
    def buffers_allocated(self) -> int:
        """Receive buffers made so far (the rest were reused from the pool)."""
        return self._pool.allocated

    def sent(self, peer: int) -> dict[int, int]:
        """Messages (header and tensors each count one) posted to ``peer``, per tag."""
        return {t: n for (p, t), n in self._sent.items() if p == peer}

    def posted(self, peer: int) -> dict[int, int]:
        """Receives posted from ``peer``, per tag."""
        return {t: n for (p, t), n in self._posted.items() if p == peer}

    # -- sending ----------------------------------------------------------------

    def post(
        self,
        peer: int,
        tag: int,
        tensors: torch.Tensor | Sequence[torch.Tensor],
        *,
        header: bool = False,
        note: Any = None,
        stream: int | None = None,
    ) -> Sent:
        """Starts sending ``tensors`` to ``peer`` as one message under ``tag``.

        The channel holds the tensors until MPI is done with them; do not
        change them in place before :meth:`wait` (CUDA tensors are copied to
        the host at once).

        Args:
            header: send a header first (shapes, dtypes, ``note``), for a
                receiver that expects without knowing the shapes.
            note: any picklable value the receiver gets with the message
                (needs ``header``).
            stream: with ``header``, a header equal to the last one posted to
                ``peer`` on this stream travels as a marker (see the module
                docstring for the order this needs).

        Raises:
            MPXValueError, MPXTypeError: a peer or tag out of range, a note
                without a header, or tensors that cannot travel (nothing is
                sent then).
        """
        self._check_peer(peer, tag, "post")
        parts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        for t in parts:
            if not isinstance(t, torch.Tensor):
                raise MPXTypeError(
                    f"Channel.post: tensors must be torch.Tensors, got {type(t).__name__}; "
                    "convert with torch.as_tensor(...)"
                )
        if note is not None and not header:
            raise MPXValueError("Channel.post: a note travels in the header; pass header=True")
        wires = [_wire(t) for t in parts]
        for wire in wires:  # all checked before the first leaves: never half a message
            check_tensor(wire, "Channel.post")
        if header:
            metas = [(t.shape, t.dtype) for t in parts]
            key = None if stream is None else (peer, stream)
            if key is not None and self._last_out.get(key) == (note, metas):
                head = torch.tensor([_MARKER, 0], dtype=torch.int64).view(torch.uint8)
            else:
                pickled = b"" if note is None else pickle.dumps(note, pickle.HIGHEST_PROTOCOL)
                head = encode(parts, pickled)
                if key is not None:
                    self._last_out[key] = (note, metas)
                self.full_headers_sent += 1
            wires.insert(0, head)
        entries = []
        for wire in wires:
            entries.append((wire, send(wire, peer, tag, comm=self.comm, async_op=True)))
            self._sent[(peer, tag)] += 1
        sent = Sent(peer, tag, entries)
        self._sending.append(sent)
        self._reap()
        return sent

    def wait(self, sent: Sent) -> None:
        """Waits until ``sent`` has left (its tensors may change then)."""
        for _, handle in sent.entries:
            self.wait_for(handle, self.comm, "send", sent.peer, self.interrupt, self.timeout)
        self._reap()

    def flush(self) -> None:
        """Waits for every message this channel is sending."""
        for sent in list(self._sending):
            self.wait(sent)

    # -- receiving --------------------------------------------------------------

    def expect(
        self,
        peer: int,
        tag: int,
        like: Sequence[tuple[torch.Size | tuple[int, ...], torch.dtype]] | None = None,
        *,
        into: Sequence[torch.Tensor] | None = None,
        stream: int | None = None,
        device: torch.device | str = "cpu",
    ) -> Incoming:
        """Posts the receive of ``peer``'s next message under ``tag``; returns at once.

        Args:
            like: the (shape, dtype) of each tensor, when known: the receives
                go into pooled buffers now. Without ``like`` or ``into`` a
                header is expected (the sender posts with ``header=True``)
                and the data receives follow as soon as it arrives.
            into: receive straight into these tensors (contiguous; yours).
            stream: the stream of the sender's headers (see :meth:`post`).
            device: where pooled buffers live ("cuda" for CUDA tensors).

        Raises:
            MPXValueError: a peer or tag out of range, or both ``like`` and ``into``.
        """
        self._check_peer(peer, tag, "expect")
        if like is not None and into is not None:
            raise MPXValueError("Channel.expect: pass like= or into=, not both")
        incoming = Incoming(peer, tag, stream, torch.device(device))
        if into is not None:
            incoming.pooled = False
            for t in into:
                if t.dtype == torch.bool or not t.is_contiguous():
                    raise MPXValueError(
                        "Channel.expect: into= takes contiguous tensors of a supported dtype, "
                        f"got {t.dtype} of strides {t.stride()}; receive with like= instead"
                    )
                incoming.entries.append((t, self._recv(t, peer, tag)))
                incoming.dtypes.append(t.dtype)
        elif like is not None:
            self._post_data(incoming, [(torch.Size(s), d) for s, d in like])
        else:
            buf = self._pool.take(torch.Size((HEADER_BYTES,)), torch.uint8, torch.device("cpu"))
            incoming.header = (buf, self._recv(buf, peer, tag))
            if stream is not None:
                self._order.setdefault((peer, stream), deque()).append(incoming)
        self._incoming.append(incoming)
        return incoming

    def ready(self, incoming: Incoming) -> bool:
        """Makes progress; True once ``incoming`` has arrived whole."""
        self.progress()
        return incoming.described and all(h.done() for _, h in incoming.entries)

    def receive(self, incoming: Incoming) -> Message:
        """Waits for ``incoming``; its tensors are the channel's buffers until :meth:`release`.

        Raises:
            CollectiveTimeout: not arrived in time (names the peer); the
                receive stays posted (:meth:`drain` settles it).
            MPXValueError: a message larger than the receive buffers given,
                or ``incoming`` already received or drained.
        """
        if incoming.taken or incoming not in self._incoming:
            raise MPXValueError(
                f"Channel.receive: the message from rank {incoming.peer} (tag {incoming.tag}) "
                "was already received or drained; expect it again"
            )
        if not incoming.described:
            self._open(incoming)
        for _, handle in incoming.entries:
            self.wait_for(handle, self.comm, "recv", incoming.peer, self.interrupt, self.timeout)
        incoming.taken = True
        self._incoming.remove(incoming)
        tensors = [
            buf if buf.dtype == d else buf.view(d)
            for (buf, _), d in zip(incoming.entries, incoming.dtypes, strict=True)
        ]
        return Message(incoming.peer, incoming.tag, tensors, incoming.note)

    def release(self, tensors: Sequence[torch.Tensor]) -> None:
        """Gives received buffers back to the pool (the next messages may reuse them)."""
        for buf in tensors:
            self._pool.give(buf)

    def progress(self) -> None:
        """Lets MPI move the messages in flight: a header that has arrived gets its
        data receives posted at once (each stream's in posting order), finished
        sends are dropped. Call it between pieces of work."""
        for incoming in list(self._incoming):
            if incoming.header is None:
                for _, handle in incoming.entries:
                    handle.done()
            elif incoming.stream is None and incoming.header[1].done():
                self._decode(incoming)
        for order in self._order.values():
            while order and order[0].header is not None and order[0].header[1].done():
                self._decode(order[0])
        self._reap()

    # -- settling ---------------------------------------------------------------

    def ledger(self) -> Ledger:
        """Messages posted to and receives posted from each peer, per tag."""
        sent: dict[int, dict[int, int]] = {}
        for (p, t), n in self._sent.items():
            sent.setdefault(p, {})[t] = n
        posted: dict[int, dict[int, int]] = {}
        for (p, t), n in self._posted.items():
            posted.setdefault(p, {})[t] = n
        return {"sent": sent, "posted": posted}

    def settle_link(
        self,
        peer: int,
        sent: dict[int, int] | None = None,
        posted: dict[int, int] | None = None,
    ) -> None:
        """Matches what ``peer``'s ledger says is unmatched on the link with it.

        Args:
            sent: messages ``peer`` posted to this rank, per tag: those beyond
                this rank's receives are received (whatever their size) and dropped.
            posted: receives ``peer`` posted from this rank, per tag: those
                beyond this rank's messages get an empty one.
        """
        for tag, count in (sent or {}).items():
            for _ in range(count - self._posted[(peer, tag)]):
                self._take_unexpected(peer, tag)
        for tag, count in (posted or {}).items():
            for _ in range(count - self._sent[(peer, tag)]):
                empty = torch.empty(0)
                handle = send(empty, peer, tag, comm=self.comm, async_op=True)
                self._settling.append((empty, handle))

    def settle(self, ledgers: Sequence[Ledger]) -> None:
        """Completes every message in flight on this rank's links and forgets them all.

        Args:
            ledgers: every rank's :meth:`ledger`, by rank (an allgather of them).

        Raises:
            CollectiveTimeout: a message did not complete in time.
        """
        me = self.comm.rank
        peers = {p for p, _ in self._sent} | {p for p, _ in self._posted}
        peers |= {r for r, ledger in enumerate(ledgers) if me in ledger["sent"]}
        peers |= {r for r, ledger in enumerate(ledgers) if me in ledger["posted"]}
        for peer in sorted(peers):
            self.settle_link(
                peer, ledgers[peer]["sent"].get(me, {}), ledgers[peer]["posted"].get(me, {})
            )
        # Polled together: a wait for one message must not hold up the others.
        pending = [handle for _, handle in self.in_flight()]
        limit = self.timeout
        deadline = None if limit is None else time.monotonic() + limit
        backoff = Backoff(spins=_SPINS)
        while pending:
            pending = [handle for handle in pending if not handle.done()]
            if pending and deadline is not None and time.monotonic() > deadline:
                assert limit is not None
                raise CollectiveTimeout("drain", "mpi", limit, sorted(peers))
            backoff.pause()
        self.reset()

    def drain(self, error: BaseException | str | None = None, what: str = "Channel") -> None:
        """Completes everything outstanding; raises every rank's error on every rank. Collective.

        Every rank of the communicator calls it (with its own failure, or
        None). Receives posted and not taken are completed and dropped, so are
        messages nobody expected; afterwards nothing is in flight and the
        channel starts afresh (headers included).

        Raises:
            RemoteError: some rank passed an error (names the ranks and errors).
            CollectiveTimeout: the ranks or their messages did not arrive in time.
        """
        summary = None if error is None else summarize(error)
        every = self.comm.allgather_object((summary, self.ledger()), timeout=self.timeout)
        self.settle([ledger for _, ledger in every])
        failures = {r: text for r, (text, _) in enumerate(every) if text is not None}
        if failures:
            raised = RemoteError(what, failures)
            if isinstance(error, BaseException):
                raise raised from error
            raise raised

    def in_flight(self) -> list[Entry]:
        """Every message not known to be complete, with its tensor."""
        return list(_Unfinished(self.__dict__))

    def reset(self) -> None:
        """Forgets everything in progress; every message must have completed.

        Raises:
            MPXError: a message is still in flight (:meth:`settle` first).
        """
        if not all(h.completed for _, h in self.in_flight()):
            raise MPXError("Channel.reset: messages are still in flight; drain() first")
        for incoming in self._incoming:
            incoming.taken = True
            if incoming.header is not None:
                self._pool.give(incoming.header[0])
            if incoming.pooled:
                self.release([buf for buf, _ in incoming.entries])
        self._incoming.clear()
        self._sending.clear()
        self._settling.clear()
        self._sent.clear()
        self._posted.clear()
        self._last_out.clear()
        self._last_in.clear()
        self._order.clear()

    # -- waiting ----------------------------------------------------------------

    @classmethod
    def wait_for(
        cls,
        handle: Handle[Any],
        comm: Communicator,
        op: str,
        peer: int,
        interrupt: Interrupt | None = None,
        timeout: float | None = None,
    ) -> None:
        """Waits for ``handle`` (any operation), calling ``interrupt`` now and then.

        With a core per rank it polls without pause (as MPI's own wait); with
        more ranks than cores it pauses between polls (spin, sched_yield,
        then sleeps), leaving the core to a rank that computes.

        Raises:
            CollectiveTimeout: past ``timeout`` (else ``comm.timeout``), naming
                ``peer``. Unlike a timed out collective, this leaves the
                communicator usable: drain the channel after it.
        """
        start = time.perf_counter()
        limit = comm.timeout if timeout is None else timeout
        deadline = None if limit is None else time.monotonic() + limit
        backoff = Backoff(spins=_SPINS) if _oversubscribed(comm) else None
        polls = 0
        try:
            while not handle.done():
                if interrupt is not None and polls % _CHECK_EVERY == 0:
                    interrupt()
                if deadline is not None and time.monotonic() > deadline:
                    assert limit is not None
                    raise CollectiveTimeout(op, "mpi", limit, [peer] if peer >= 0 else [])
                polls += 1
                if backoff is not None:
                    backoff.pause()
        finally:
            cls.waited[0] += time.perf_counter() - start
        handle.wait()  # finished: returns at once, or raises the operation's error

    @staticmethod
    def keep_alive(entries: Sequence[Entry]) -> None:
        """Keeps the tensors of unfinished messages alive until their handles complete
        (for a caller that gives up on its messages without settling them)."""
        _ORPHANS.extend(entry for entry in entries if not entry[1].completed)

    # -- internals --------------------------------------------------------------

    def _check_peer(self, peer: int, tag: int, op: str) -> None:
        check_rank(peer, self.comm.size, "peer", f"Channel.{op}")
        if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag <= _max_tag():
            raise MPXValueError(
                f"Channel.{op}: tag must be an int in [0, {_max_tag()}], got {tag!r}"
            )

    def _recv(self, buf: torch.Tensor, peer: int, tag: int) -> Handle[torch.Tensor]:
        handle = recv(buf, peer, tag, comm=self.comm, async_op=True)
        self._posted[(peer, tag)] += 1
        return handle

    def _post_data(self, incoming: Incoming, metas: list[tuple[torch.Size, torch.dtype]]) -> None:
        for shape, dtype in metas:
            wire = torch.uint8 if dtype == torch.bool else dtype
            buf = self._pool.take(shape, wire, incoming.device)
            incoming.entries.append((buf, self._recv(buf, incoming.peer, incoming.tag)))
            incoming.dtypes.append(dtype)

    def _open(self, incoming: Incoming) -> None:
        """Waits for ``incoming``'s header, its stream's earlier ones first, and decodes it."""
        if incoming.stream is None:
            self._decode(incoming)
            return
        order = self._order[(incoming.peer, incoming.stream)]
        while not incoming.described:
            self._decode(order[0])

    def _decode(self, incoming: Incoming) -> None:
        assert incoming.header is not None
        buf, handle = incoming.header
        self.wait_for(handle, self.comm, "recv", incoming.peer, self.interrupt, self.timeout)
        incoming.header = None
        key = None if incoming.stream is None else (incoming.peer, incoming.stream)
        if key is not None:
            self._order[key].popleft()
        decoded = decode(buf)
        self._pool.give(buf)
        if decoded is None:
            if key is None or key not in self._last_in:
                raise MPXError(
                    f"Channel: a header marker from rank {incoming.peer} (tag {incoming.tag}) "
                    "repeats a header never received on its stream; expect a stream's "
                    "messages in the order they are posted"
                )
            metas, note = self._last_in[key]
        else:
            metas, pickled = decoded
            note = pickle.loads(pickled) if pickled else None  # our own ranks' bytes
            if key is not None:
                self._last_in[key] = (metas, note)
            self.full_headers_received += 1
        incoming.note = note
        self._post_data(incoming, metas)

    def _take_unexpected(self, peer: int, tag: int) -> None:
        """Receives (to drop it) the next message of (peer, tag) that no receive was posted
        for, whatever its size: it was sent before the ledgers were exchanged, so it is
        there to probe (MPI matches it; its data may still be on the way)."""
        status = MPI.Status()
        limit = self.timeout
        deadline = None if limit is None else time.monotonic() + limit
        backoff = Backoff(spins=_SPINS)
        while (message := self.comm.mpi.Improbe(peer, tag, status)) is None:
            if deadline is not None and time.monotonic() > deadline:
                assert limit is not None
                raise CollectiveTimeout("drain", "mpi", limit, [peer])
            backoff.pause()
        buf = torch.empty(status.Get_count(MPI.BYTE), dtype=torch.uint8)
        request = message.Irecv([buf.numpy(), MPI.BYTE])
        self._settling.append((buf, Handle("drain", "mpi", _requests(request, peer))))

    def _reap(self) -> None:
        self._sending = [s for s in self._sending if not s.done()]
        _reap_orphans()


class _Unfinished:
    """The unfinished messages of a channel (its ``__dict__``): what its finalizer adopts."""

    def __init__(self, box: dict[str, Any]) -> None:
        self.box = box

    def __iter__(self) -> Iterator[Entry]:
        box = self.box
        for sent in box.get("_sending", []):
            yield from (e for e in sent.entries if not e[1].completed)
        for incoming in box.get("_incoming", []):
            if incoming.header is not None and not incoming.header[1].completed:
                yield incoming.header
            yield from (e for e in incoming.entries if not e[1].completed)
        yield from (e for e in box.get("_settling", []) if not e[1].completed)


def _oversubscribed(comm: Communicator) -> bool:
    """More ranks on this node than cores this process may run on (cached per comm)."""
    known = comm.cached("channel.oversubscribed")
    if known is None:
        known = comm.cache("channel.oversubscribed", comm.node_size > usable_cores())
    return bool(known)


@functools.cache
def _max_tag() -> int:
    value = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
    return int(value) if value is not None else 32767
