"""Traffic between neighbouring stages: the border protocol over :class:`mpx.collectives.Channel`.

::

    stage s-1                         stage s                          stage s+1
    ---------                         -------                          ---------
    border j (header + tensors) --->  header receives posted early; the
         (one tag per micro-batch)    channel posts the tensors' receives
                                      as soon as a header is in
                                      ...           border j ----------------->
                                      grad recvs posted right after F(j) <--- grads j
    grads j <--- posted (async) ----

The channel moves the messages (non-blocking, receives posted ahead, pooled
buffers, shapes that may change from one micro-batch to the next, headers
renegotiated only when a shape changes, CUDA through the staged path, memory
kept alive while MPI uses it). What this module adds is the pipeline's side
of it:

- **Tags.** A box is one link to one neighbour, for activations (``"act"``)
  or gradients (``"grad"``), each with a range of tags: micro-batch ``j``
  travels under ``base + j % 8192``.
- **Borders.** An activation is a structure of tensors
  (:mod:`mpx.pipeline.model.border`): its spec and which tensors carry a gradient
  back ride in the channel header's note; each receiving virtual stage is a
  stream, so a border that repeats the last one to that stage is a marker.
  Gradients need no header: the receiver knows the shapes it sent.
- **Failures.** The executor's waits look out for other stages' failure
  notices (``interrupt``); after a failure :mod:`mpx.pipeline.runtime.failure` settles
  every link with the counts each box keeps (:attr:`Outbox.sent`,
  :attr:`Inbox.posted`), through the channel's :meth:`~mpx.collectives.Channel.settle_link`.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mpx.collectives import Channel, Communicator, Handle, MPXTypeError, MPXValueError
from mpx.collectives.building_blocks import decode_header
from mpx.collectives.building_blocks import encode_header as _encode_header
from mpx.pipeline.errors import PipelineError, PipelineTypeError, PipelineValueError
from mpx.pipeline.model import Spec, carries_grad, flatten

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

_WINDOW = 8192  # micro-batches that may be in flight on one link at once
_TAG_BASE = {"act": _WINDOW, "grad": 2 * _WINDOW}

Interrupt = Callable[[], None]
"""Raises if the wait should end early (another stage failed); called while waiting."""

WAITED = Channel.waited
"""Seconds this process has spent waiting for messages (busy-time accounting)."""


def wait_for(
    handle: Handle[Any], comm: Communicator, op: str, peer: int, interrupt: Interrupt | None
) -> None:
    """Waits for any operation's handle as the channel waits (:meth:`Channel.wait_for`).

    Raises:
        CollectiveTimeout: past ``comm.timeout`` (``MPX_TIMEOUT``), naming
            ``peer``; the communicator stays usable (the pipeline settles its links).
    """
    Channel.wait_for(handle, comm, op, peer, interrupt)


def adopt(entries: list[tuple[torch.Tensor, Handle[Any]]]) -> None:
    """Keeps the tensors of unfinished messages alive until their handles complete."""
    Channel.keep_alive(entries)


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


def _tag(kind: str, j: int) -> int:
    return _TAG_BASE[kind] + j % _WINDOW


@dataclass
class Parcel:
    """One micro-batch's message on a link: its tensors (receive buffers) and, for an
    activation, the structure they fill and which of them carry a gradient back."""

    tensors: list[torch.Tensor]
    spec: Spec = "T"
    flags: list[bool] = field(default_factory=list)


class _Box:
    """One link to one neighbour, for one kind of message, on a channel of its own."""

    def __init__(
        self, comm: Communicator, peer: int, kind: str, interrupt: Interrupt | None = None
    ) -> None:
        self.comm, self.peer, self.kind = comm, peer, kind
        self.channel = Channel(comm, interrupt=interrupt)

    @property
    def interrupt(self) -> Interrupt | None:
        return self.channel.interrupt

    @interrupt.setter
    def interrupt(self, value: Interrupt | None) -> None:
        self.channel.interrupt = value

    def owns(self, tag: int) -> bool:
        """Whether ``tag`` is this box's (activations and gradients have tag ranges apart)."""
        return _TAG_BASE[self.kind] <= tag < _TAG_BASE[self.kind] + _WINDOW

    def in_flight(self) -> list[tuple[torch.Tensor, Handle[Any]]]:
        """The messages not known to be complete, with their tensors."""
        return self.channel.in_flight()


class Inbox(_Box):
    """Receives from one neighbour: activations (each with its header) or gradients.

    Attributes:
        posted: receives posted so far, per tag (what :mod:`~mpx.pipeline.runtime.failure`
            compares with the sender's count to settle the link).
        full_headers: headers decoded that described shapes (the rest were markers).
    """

    def __init__(
        self, comm: Communicator, peer: int, kind: str, interrupt: Interrupt | None = None
    ) -> None:
        super().__init__(comm, peer, kind, interrupt)
        self._incoming: dict[int, Any] = {}  # micro-batch -> its receive, posted

    @property
    def posted(self) -> Counter[int]:
        return Counter(self.channel.posted(self.peer))

    @property
    def full_headers(self) -> int:
        return self.channel.full_headers_received

    def _check_free(self, j: int) -> None:
        if j in self._incoming:
            # Reposting would drop a receive MPI may still write into.
            raise PipelineError(f"internal: micro-batch {j} already has a receive posted")

    def expect(self, ids: list[int], stream: int = 0) -> None:
        """Activations: posts the header receives of micro-batches ``ids`` (virtual stage
        ``stream``); their tensors' receives follow once a header is in."""
        for j in ids:
            self._check_free(j)
            self._incoming[j] = self.channel.expect(self.peer, _tag(self.kind, j), stream=stream)

    def post(self, j: int, metas: list[tuple[torch.Size, torch.dtype]]) -> None:
        """Posts the receives of micro-batch ``j``'s tensors, of known shapes, into pooled
        buffers."""
        self._check_free(j)
        self._incoming[j] = self.channel.expect(self.peer, _tag(self.kind, j), like=metas)

    def get(self, j: int) -> Parcel:
        """Waits for micro-batch ``j``; the buffers are ours until :meth:`release`."""
        incoming = self._incoming.get(j)
        if incoming is None:
            raise PipelineError(f"internal: no receive posted for micro-batch {j}")
        # Stays posted until complete: a wait that raises leaves it in the channel.
        message = self.channel.receive(incoming)
        del self._incoming[j]
        spec, flags = message.note if message.note is not None else ("T", [])
        return Parcel(message.tensors, spec, flags)

    def release(self, tensors: list[torch.Tensor]) -> None:
        self.channel.release(tensors)

    def progress(self) -> None:
        """Lets MPI move the messages in flight; a header that has arrived gets its
        tensors' receives posted at once (before the sender of a large message waits)."""
        self.channel.progress()

    # -- settling after a failure (see mpx.pipeline.runtime.failure) ----------------------

    def drain(self, sent: dict[int, tuple[int, Any]]) -> None:
        """Takes every message the peer sent (``sent``: its ledger, ``{tag: (count, _)}``)
        that no receive of this box will take."""
        self.channel.settle_link(self.peer, sent={tag: count for tag, (count, _) in sent.items()})

    def reset(self) -> None:
        """Forgets everything in progress; every receive must have completed."""
        self.channel.reset()
        self._incoming.clear()


class Outbox(_Box):
    """Sends to one neighbour, asynchronously; the channel holds each tensor until sent.

    Attributes:
        sent: messages sent so far, per tag.
        sizes: per tag, sizes of its last sends: empty (the ledger's format
            keeps it; the channel settles without sizes).
        full_headers: headers sent that described shapes (the rest were markers).
    """

    def __init__(
        self, comm: Communicator, peer: int, kind: str, interrupt: Interrupt | None = None
    ) -> None:
        super().__init__(comm, peer, kind, interrupt)
        self._inflight: dict[int, Any] = {}  # micro-batch -> its message, sending
        self.sizes: defaultdict[int, list[tuple[int, torch.dtype]]] = defaultdict(list)

    @property
    def sent(self) -> Counter[int]:
        return Counter(self.channel.sent(self.peer))

    @property
    def full_headers(self) -> int:
        return self.channel.full_headers_sent

    def send(
        self, j: int, obj: Any, flags: list[bool] | None = None, stream: int = 0
    ) -> list[bool]:
        """Activations: sends micro-batch ``j``'s border ``obj`` (header, then tensors).

        ``flags`` (whether each tensor's gradient comes back) default to what
        :func:`~mpx.pipeline.model.border.carries_grad` says in the current grad mode.

        Returns:
            Per tensor of ``obj`` (in :func:`~mpx.pipeline.model.border.flatten` order),
            whether its gradient will come back.

        Raises:
            PipelineTypeError, PipelineValueError: ``obj`` cannot cross a border
                (nothing is sent then).
        """
        tensors, spec = flatten(obj)
        if flags is None:
            flags = [carries_grad(t) for t in tensors]
        self._post(j, tensors, (spec, flags), stream)
        return flags

    def send_tensors(self, j: int, tensors: list[torch.Tensor]) -> None:
        """Sends ``tensors`` as micro-batch ``j``'s messages, in order (one tag, no header)."""
        self._post(j, tensors, None, None)

    def _post(self, j: int, tensors: list[torch.Tensor], note: Any, stream: int | None) -> None:
        if j in self._inflight:
            raise PipelineError(f"internal: micro-batch {j} is already being sent")
        try:
            self._inflight[j] = self.channel.post(
                self.peer,
                _tag(self.kind, j),
                tensors,
                header=note is not None,
                note=note,
                stream=stream,
            )
        except MPXTypeError as exc:
            raise PipelineTypeError(f"an activation cannot cross a stage border: {exc}") from exc
        except MPXValueError as exc:
            raise PipelineValueError(f"an activation cannot cross a stage border: {exc}") from exc
        self._reap()

    def progress(self) -> None:
        """Lets MPI move the messages in flight; drops the finished ones."""
        self.channel.progress()
        self._reap()

    def _reap(self) -> None:
        for j in [j for j, sent in self._inflight.items() if sent.done()]:
            del self._inflight[j]

    def wait(self, j: int) -> None:
        sent = self._inflight.get(j)
        if sent is not None:
            self.channel.wait(sent)
            del self._inflight[j]

    def wait_all(self) -> None:
        for j in list(self._inflight):
            self.wait(j)

    # -- settling after a failure (see mpx.pipeline.runtime.failure) ----------------------

    def answer(self, posted: dict[int, int]) -> None:
        """Sends an empty message to every receive the peer posted (``posted``: its
        ledger) that no send of this box will match; a receive takes a shorter message."""
        self.channel.settle_link(self.peer, posted=posted)

    def reset(self) -> None:
        """Forgets everything in progress; every send must have completed."""
        self.channel.reset()
        self._inflight.clear()
        self.sizes.clear()
