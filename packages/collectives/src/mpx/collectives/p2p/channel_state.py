"""What a :class:`~mpx.collectives.Channel` keeps about its messages in flight.

The records of a message being sent (:class:`Sent`), a receive posted ahead
(:class:`Incoming`) and a message received (:class:`Message`); the pool of
receive buffers; the waits; and what outlives a dropped channel (MPI reads a
send buffer and writes a receive buffer until its request completes, so a
channel's tensors in flight are kept alive, module-wide, until then).
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from mpx.collectives.base import (
    Backoff,
    CollectiveTimeout,
    Handle,
    MPXError,
    MPXValueError,
    RemoteError,
    Requests,
    Steps,
)
from mpx.collectives.core import Communicator
from mpx.collectives.node import usable_cores
from mpx.collectives.p2p.channel_wire import (
    HEADER_BYTES,
    Head,
    HeadRequest,
    Metas,
    mismatch,
    read_head,
)

__all__ = [
    "ORPHANS",
    "WAITED",
    "Entry",
    "Incoming",
    "Interrupt",
    "Ledger",
    "Message",
    "Pool",
    "Sent",
    "Unfinished",
    "complete",
    "first_part",
    "max_tag",
    "raise_failures",
    "reap_orphans",
    "take_unexpected",
    "unreported",
    "wait_for",
    "wire_of",
]

SPINS = 200  # polls before an oversubscribed waiting rank starts to pause
_CHECK_EVERY = 64  # polls between two calls of the interrupt

WAITED = [0.0]
"""Seconds this process has spent in channel waits (``Channel.waited``)."""

Interrupt = Callable[[], None]
"""Raises if a wait should end early (e.g. another rank announced a failure)."""

Ledger = dict[str, dict[int, dict[int, int]]]
"""``{"sent": {peer: {tag: messages}}, "posted": {peer: {tag: receives}}}``."""

Entry = tuple[torch.Tensor, Handle[Any]]

ORPHANS: list[Entry] = []
"""Messages still in flight when their channel was dropped: their tensors stay alive
here until MPI is done with them. Reaped by every channel's progress."""


def reap_orphans() -> None:
    """Lets go of the orphans MPI is done with."""
    if ORPHANS:
        ORPHANS[:] = [(t, h) for t, h in ORPHANS if not h.done()]


def wire_of(t: torch.Tensor) -> torch.Tensor:
    """What MPI moves for ``t``: its memory, contiguous, without autograd; bool as uint8."""
    out = t.detach()
    if not out.is_contiguous():
        out = out.contiguous()
    return out.view(torch.uint8) if out.dtype == torch.bool else out


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
    head: tuple[torch.Tensor, HeadRequest] | None = None  # the first part's receive, until read
    wanted: bytes | None = None  # the descriptor expected (like=, into=); None: a header
    entries: list[Entry] = field(default_factory=list)  # the data receives, once posted
    dtypes: list[torch.dtype] = field(default_factory=list)  # what each buffer holds
    note: Any = None
    pooled: bool = True  # the buffers are the channel's (not the caller's ``into``)
    taken: bool = False
    error: MPXError | None = None  # the message is not what was expected
    reported: bool = False  # ``error`` was raised (drain does not raise it again)

    @property
    def described(self) -> bool:
        """Whether the shapes are known (given, or the header arrived)."""
        return self.head is None or self.wanted is not None

    def expected(self) -> Metas:
        """What the receiver asked for (like=, into=)."""
        return [(buf.shape, d) for (buf, _), d in zip(self.entries, self.dtypes, strict=True)]

    def mismatched(self, head: Head) -> None:
        """Keeps the error of a first part that is not what was expected, for
        :meth:`~mpx.collectives.Channel.receive` (or ``drain``) to raise."""
        wanted = None if self.wanted is None else self.expected()
        how = "like=" if self.pooled else "into="
        self.error = mismatch(self.peer, self.tag, head, wanted, how)


class Pool:
    """Free receive buffers by (shape, dtype, device)."""

    def __init__(self) -> None:
        self._free: dict[tuple[torch.Size, torch.dtype, torch.device], list[torch.Tensor]] = (
            defaultdict(list)
        )
        self._heads: list[tuple[torch.Tensor, np.ndarray]] = []
        self.allocated = 0

    def take_head(self) -> tuple[torch.Tensor, np.ndarray]:
        """A first part's receive buffer, as a tensor and as numpy (what MPI is given)."""
        if self._heads:
            return self._heads.pop()
        self.allocated += 1
        raw = np.empty(HEADER_BYTES, dtype=np.uint8)
        return torch.from_numpy(raw), raw

    def give_head(self, buf: torch.Tensor, raw: np.ndarray) -> None:
        self._heads.append((buf, raw))

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


def first_part(incoming: Incoming, pool: Pool, wait: Callable[[Handle[Any]], None]) -> Head | None:
    """Waits (``wait``) for ``incoming``'s first part and reads it; None: the descriptor
    expected. Its buffer goes back to ``pool``.

    Keeps no error: the caller decides (:meth:`Incoming.mismatched`), as
    ``progress`` and ``settle`` read first parts too and must not raise.
    """
    assert incoming.head is not None
    buf, handle = incoming.head
    try:
        if not handle.done():
            wait(handle)
        nbytes = handle.wait()
    except MPI.Exception as error:  # longer than any first part: not one
        if error.Get_error_class() != MPI.ERR_TRUNCATE:
            raise
        nbytes = -1
    incoming.head = None
    raw = handle.raw
    wanted = incoming.wanted
    if wanted is not None and nbytes == len(wanted) and raw[:nbytes].tobytes() == wanted:
        head = None  # the common case: a few dozen bytes compared, nothing decoded
    else:
        head = read_head(raw, nbytes)
    pool.give_head(buf, raw)
    return head


def wait_for(
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
    if handle.done():  # the common case once a message is in: no clock, no backoff
        handle.wait()
        return
    start = time.perf_counter()
    limit = comm.timeout if timeout is None else timeout
    deadline = None if limit is None else time.monotonic() + limit
    backoff = Backoff(spins=SPINS) if _oversubscribed(comm) else None
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
        WAITED[0] += time.perf_counter() - start
    handle.wait()  # finished: returns at once, or raises the operation's error


def unreported(incoming: Incoming, pool: Pool) -> MPXError | None:
    """The error of a settled receive nobody took (and nothing raised yet), if any: a
    message nobody received may still be the wrong one, and is not lost in a drain."""
    if incoming.taken or incoming.reported:
        return None
    if incoming.error is None and incoming.head is not None:
        head = first_part(incoming, pool, lambda handle: None)  # complete: settled
        fine = ("nothing",) if incoming.wanted is not None else ("nothing", "header", "marker")
        if head is not None and head.kind not in fine:  # "nothing": never sent
            incoming.mismatched(head)
    return incoming.error


def raise_failures(
    what: str,
    error: BaseException | str | None,
    errors: list[str | None],
    mismatches: list[str | None],
    found: MPXValueError | None,
) -> None:
    """Raises what a drain found: this rank's mismatch ``found`` (MPXValueError), else a
    RemoteError naming every rank's error (``errors``, passed to drain) and mismatch.

    Raises:
        MPXValueError: ``found``.
        RemoteError: some rank failed.
    """
    failures = {r: text for r, text in enumerate(errors) if text is not None}
    for r, text in enumerate(mismatches):
        if text is not None:
            failures[r] = f"{failures[r]}; {text}" if r in failures else text
    raised = RemoteError(what, failures) if failures else None
    if found is not None:
        raise found from raised
    if raised is not None:
        if isinstance(error, BaseException):
            raise raised from error
        raise raised


def complete(handles: list[Handle[Any]], timeout: float | None, peers: list[int]) -> None:
    """Polls ``handles`` together until every one is complete (a wait for one must not
    hold up the others); a :class:`CollectiveTimeout` of "drain" naming ``peers``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    backoff = Backoff(spins=SPINS)
    while handles:
        handles = [handle for handle in handles if not handle.done()]
        if handles and deadline is not None and time.monotonic() > deadline:
            assert timeout is not None
            raise CollectiveTimeout("drain", "mpi", timeout, peers)
        backoff.pause()


def take_unexpected(comm: Communicator, peer: int, tag: int, timeout: float | None) -> Entry:
    """Receives (to drop it) the next message of (peer, tag) that no receive was posted
    for, whatever its size: it was sent before the ledgers were exchanged, so it is
    there to probe (MPI matches it; its data may still be on the way)."""
    status = MPI.Status()
    deadline = None if timeout is None else time.monotonic() + timeout
    backoff = Backoff(spins=SPINS)
    while (message := comm.mpi.Improbe(peer, tag, status)) is None:
        if deadline is not None and time.monotonic() > deadline:
            assert timeout is not None
            raise CollectiveTimeout("drain", "mpi", timeout, [peer])
        backoff.pause()
    buf = torch.empty(status.Get_count(MPI.BYTE), dtype=torch.uint8)
    request = message.Irecv([buf.numpy(), MPI.BYTE])
    return buf, Handle("drain", "mpi", _requests(request, peer))


def _requests(request: MPI.Request, peer: int) -> Steps[None]:
    yield Requests([request], peers=[peer])


class Unfinished:
    """The unfinished messages of a channel: what its finalizer adopts.

    It holds the channel's three lists of messages in flight (which the channel
    only ever changes in place) and nothing else of it: a finalizer's arguments
    live until the channel dies, so one that reached the channel (through its
    communicator's owner, its ``interrupt``) would keep it, and its pipeline, alive
    for ever.
    """

    def __init__(
        self, sending: list[Sent], incoming: list[Incoming], settling: list[Entry]
    ) -> None:
        self.sending, self.incoming, self.settling = sending, incoming, settling

    def __iter__(self) -> Iterator[Entry]:
        for sent in self.sending:
            yield from (e for e in sent.entries if not e[1].completed)
        for incoming in self.incoming:
            if incoming.head is not None and not incoming.head[1].completed:
                yield incoming.head
            yield from (e for e in incoming.entries if not e[1].completed)
        yield from (e for e in self.settling if not e[1].completed)


def _oversubscribed(comm: Communicator) -> bool:
    """More ranks on this node than cores this process may run on (cached per comm)."""
    known = comm.cached("channel.oversubscribed")
    if known is None:
        known = comm.cache("channel.oversubscribed", comm.node_size > usable_cores())
    return bool(known)


@functools.cache
def max_tag() -> int:
    value = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
    return int(value) if value is not None else 32767
