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
dtype as :mod:`mpx.collectives.p2p.tensor_header` writes them, and a picklable
``note`` of the caller's), so shapes may change from one message to the
next. A message without a header starts with a small *descriptor* of its
shapes and dtypes (:mod:`mpx.collectives.p2p.channel_wire`), which the receiver
compares with what it asked for: any difference -- shape, dtype, tensor
count, a header where none was expected or the reverse -- is an
:class:`~mpx.collectives.MPXValueError` naming both sides, raised by
``receive`` (or by ``drain``, for a message nobody received), never data
reinterpreted.

On a ``stream`` a header that repeats the last one posted to the same peer
and stream travels as one 8-byte marker: headers are renegotiated only when a
shape (or the note) changes. That needs one rule: a stream's messages are
expected in the order they are posted (MPI delivers messages of one tag in
order; a stream may span tags).

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

Memory safety: the channel holds every tensor whose message is in flight,
when a wait raises and when it is dropped (:mod:`mpx.collectives.p2p.channel_state`).

Example::

    ch = Channel(comm)
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    incoming = ch.expect(left, tag=7)                   # posted before the peer sends
    ch.post(right, 7, torch.randn(3, n), header=True)   # n may change every time
    x = ch.receive(incoming).tensors[0]
    ch.flush()
"""

from __future__ import annotations

import pickle
import weakref
from collections import Counter, deque
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from mpx.collectives.base import (
    Handle,
    MPXError,
    MPXTypeError,
    MPXValueError,
    check_rank,
    check_tensor,
)
from mpx.collectives.core import CommLike, as_communicator, recv, send
from mpx.collectives.p2p.channel_settle import Settling
from mpx.collectives.p2p.channel_state import (
    ORPHANS,
    WAITED,
    Entry,
    Incoming,
    Interrupt,
    Ledger,
    Message,
    Pool,
    Sent,
    Unfinished,
    first_part,
    max_tag,
    reap_orphans,
    wait_for,
    wire_of,
)
from mpx.collectives.p2p.channel_wire import (
    HEADER_BYTES,
    MAX_NOTE_BYTES,
    MAX_TENSORS,
    Head,
    Metas,
    decode,
    descriptor,
    encode,
    marker,
    receive_data,
    receive_head,
    send_data,
    send_head,
)

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
    "decode",
    "encode",
]


class Channel(Settling):
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

    Its ``ledger``, ``settle_link``, ``settle``, ``drain``, ``in_flight`` and
    ``reset`` come from :class:`~mpx.collectives.p2p.channel_settle.Settling`.
    """

    waited: ClassVar[list[float]] = WAITED
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
        self._pool = Pool()
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
        weakref.finalize(
            self, ORPHANS.extend, Unfinished(self._sending, self._incoming, self._settling)
        )

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
        """Messages (the first part -- header or descriptor -- and each tensor count one)
        posted to ``peer``, per tag."""
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
                receiver that expects without knowing the shapes; without
                one a descriptor of the shapes and dtypes goes first, for a
                receiver that expects with ``like=`` or ``into=`` to check.
            note: any picklable value the receiver gets with the message
                (needs ``header``).
            stream: with ``header``, a header equal to the last one posted to
                ``peer`` on this stream travels as a marker (see the module
                docstring for the order this needs).

        Raises:
            MPXValueError, MPXTypeError: a peer or tag out of range, a note
                without a header, or tensors that cannot travel: more than
                :data:`MAX_TENSORS`, more than 8 dimensions, a dtype no
                operation takes (nothing is sent then).
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
        wires = [wire_of(t) for t in parts]
        for wire in wires:  # all checked before the first leaves: never half a message
            check_tensor(wire, "Channel.post")
        metas = [(t.shape, t.dtype) for t in parts]
        if not header:
            head, raw, _ = descriptor(metas)
        elif stream is not None and self._last_out.get((peer, stream)) == (note, metas):
            head, raw = marker()
        else:
            pickled = b"" if note is None else pickle.dumps(note, pickle.HIGHEST_PROTOCOL)
            head = encode(parts, pickled)
            raw = head.numpy()
            if stream is not None:
                self._last_out[(peer, stream)] = (note, metas)
            self.full_headers_sent += 1
        sent = Sent(peer, tag, [(head, send_head(self.comm, raw, peer, tag))])
        self._sent[(peer, tag)] += 1
        self._sending.append(sent)  # first: a data send that raises leaves the ledger true
        for wire in wires:
            sent.entries.append((wire, self._send(wire, peer, tag)))
            self._sent[(peer, tag)] += 1
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
                On a mismatch (see :meth:`receive`) they hold undefined values.
            stream: the stream of the sender's headers (see :meth:`post`).
            device: where pooled buffers live ("cuda" for CUDA tensors).

        Raises:
            MPXValueError, MPXTypeError: a peer or tag out of range, both
                ``like`` and ``into``, or tensors that cannot travel (nothing
                is posted then).
        """
        self._check_peer(peer, tag, "expect")
        if like is not None and into is not None:
            raise MPXValueError("Channel.expect: pass like= or into=, not both")
        incoming = Incoming(peer, tag, stream, torch.device(device))
        metas: Metas | None = None
        if into is not None:
            for t in into:  # all checked before the first receive is posted
                if t.dtype == torch.bool or not t.is_contiguous():
                    raise MPXValueError(
                        "Channel.expect: into= takes contiguous tensors of a supported dtype, "
                        f"got {t.dtype} of strides {t.stride()}; receive with like= instead"
                    )
            metas = [(t.shape, t.dtype) for t in into]
        elif like is not None:
            metas = [(torch.Size(s), d) for s, d in like]
        if metas is not None:
            incoming.wanted = descriptor(metas)[2]
        buf, raw = self._pool.take_head()
        # Posted before the data receives: MPI matches one tag's messages in order.
        incoming.head = (buf, receive_head(self.comm, raw, peer, tag))
        self._posted[(peer, tag)] += 1
        if into is not None:
            incoming.pooled = False
            for t in into:
                incoming.entries.append((t, self._recv(t, peer, tag)))
                incoming.dtypes.append(t.dtype)
        elif metas is not None:
            self._post_data(incoming, metas)
        elif stream is not None:
            self._order.setdefault((peer, stream), deque()).append(incoming)
        self._incoming.append(incoming)
        return incoming

    def ready(self, incoming: Incoming) -> bool:
        """Makes progress; True once ``incoming`` has arrived whole (or is known not to
        be what was expected: :meth:`receive` raises then)."""
        self.progress()
        if incoming.error is not None:
            return True
        return incoming.head is None and all(h.done() for _, h in incoming.entries)

    def receive(self, incoming: Incoming) -> Message:
        """Waits for ``incoming``; its tensors are the channel's buffers until :meth:`release`.

        Raises:
            CollectiveTimeout: not arrived in time (names the peer); the
                receive stays posted (:meth:`drain` settles it).
            MPXValueError: the message is not what was expected (names the
                sender's shapes and dtypes and the receiver's: a shape, a
                dtype, the tensor count, a header where none was expected or
                the reverse); the receive stays posted, :meth:`drain` settles
                it. Or ``incoming`` already received or drained.
        """
        if incoming.taken or incoming not in self._incoming:
            raise MPXValueError(
                f"Channel.receive: the message from rank {incoming.peer} (tag {incoming.tag}) "
                "was already received or drained; expect it again"
            )
        if incoming.error is None and not incoming.described:
            self._open(incoming)
        elif incoming.error is None and incoming.head is not None:
            self._check(incoming)
        if incoming.error is not None:
            incoming.reported = True
            raise incoming.error
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
        data receives posted at once (each stream's in posting order), a
        descriptor is checked, finished sends are dropped. Call it between
        pieces of work."""
        for incoming in list(self._incoming):
            if incoming.head is not None and incoming.head[1].done():
                if incoming.wanted is not None:
                    self._check(incoming)
                elif incoming.stream is None:
                    self._decode(incoming)
            if incoming.described:
                for _, handle in incoming.entries:
                    handle.done()
        for order in self._order.values():
            while order and order[0].head is not None and order[0].head[1].done():
                self._decode(order[0])
        self._reap()

    # -- waiting ----------------------------------------------------------------

    wait_for = staticmethod(wait_for)
    """Waits for a handle (any operation), calling ``interrupt`` now and then
    (:func:`mpx.collectives.p2p.channel_state.wait_for`)."""

    @staticmethod
    def keep_alive(entries: Sequence[Entry]) -> None:
        """Keeps the tensors of unfinished messages alive until their handles complete
        (for a caller that gives up on its messages without settling them)."""
        ORPHANS.extend(entry for entry in entries if not entry[1].completed)

    # -- internals --------------------------------------------------------------

    def _check_peer(self, peer: int, tag: int, op: str) -> None:
        check_rank(peer, self.comm.size, "peer", f"Channel.{op}")
        if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag <= max_tag():
            raise MPXValueError(
                f"Channel.{op}: tag must be an int in [0, {max_tag()}], got {tag!r}"
            )

    def _send(self, wire: torch.Tensor, peer: int, tag: int) -> Handle[Any]:
        if wire.is_cuda:
            return send(wire, peer, tag, comm=self.comm, async_op=True)
        # A CPU tensor: the MPI call ``send`` ends as, made here (channel_wire.DataRequest).
        return send_data(self.comm, wire, peer, tag)

    def _recv(self, buf: torch.Tensor, peer: int, tag: int) -> Handle[Any]:
        if buf.is_cuda:
            handle: Handle[Any] = recv(buf, peer, tag, comm=self.comm, async_op=True)
        else:
            handle = receive_data(self.comm, buf, peer, tag)
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

    def _first(self, incoming: Incoming) -> Head | None:
        """Waits for ``incoming``'s first part and reads it (:func:`first_part`)."""

        def wait(handle: Handle[Any]) -> None:
            wait_for(handle, self.comm, "recv", incoming.peer, self.interrupt, self.timeout)

        return first_part(incoming, self._pool, wait)

    def _check(self, incoming: Incoming) -> None:
        """Compares ``incoming``'s descriptor with the one expected (like=, into=)."""
        head = self._first(incoming)
        if head is not None:
            incoming.mismatched(head)

    def _decode(self, incoming: Incoming) -> None:
        key = None if incoming.stream is None else (incoming.peer, incoming.stream)
        head = self._first(incoming)
        if key is not None:
            self._order[key].popleft()
        assert head is not None
        if head.kind == "marker":
            if key is None or key not in self._last_in:
                incoming.error = MPXError(
                    f"Channel: a header marker from rank {incoming.peer} (tag {incoming.tag}) "
                    "repeats a header never received on its stream; expect a stream's "
                    "messages in the order they are posted"
                )
                return
            metas, note = self._last_in[key]
        elif head.kind == "header":
            metas = head.metas
            note = pickle.loads(head.note) if head.note else None  # our own ranks' bytes
            if key is not None:
                self._last_in[key] = (metas, note)
            self.full_headers_received += 1
        else:
            incoming.mismatched(head)
            return
        incoming.note = note
        self._post_data(incoming, metas)

    def _reap(self) -> None:
        self._sending[:] = [s for s in self._sending if not s.done()]  # in place: see Unfinished
        reap_orphans()
