"""The first part of every :class:`~mpx.collectives.Channel` message, and its check.

A channel message is a first part and then its tensors, one MPI message each,
under one tag. The first part says what follows, as int64 words::

    header      count (0..255)   note length   count rows of encode_header   the note
    marker      -1               0             (the stream's last header, again)
    descriptor  DESCRIPTOR       count         count rows of encode_header

(a row is :func:`~mpx.collectives.p2p.tensor_header.encode_header`'s dtype code,
ndim and dims). A sender with ``header=True`` sends a header (or a marker);
any other sends a descriptor. A receiver that does not know the shapes gets a
header and posts its tensors' receives once it is in; one that does
(``like=``, ``into=``) posts them at once, beside the receive of the first
part, and compares the descriptor that arrives with the one it expects.

Why a descriptor on every message without a header: MPI matches a message to a
receive by source and tag alone, and its byte counts cannot tell float32 from
int32, so without one 4 floats land in a receive of 8 (4 never sent, no
error), a float32 in an int32 receive has its bits reinterpreted, and a header
read as a tensor (or a tensor as a header) is garbage. The check is a
comparison of a few dozen bytes with a cached expectation; only a difference
is decoded, to name both sides in the error. Its cost is one more small
message (an eager MPI send and receive, polled by the channel without a
Handle): about 15 us of a 4 KiB message's ~100 us on this project's 2-core
VMs.

The first part is received into :data:`HEADER_BYTES` (whatever the receiver
expects), so that a header where a descriptor was expected -- or the reverse,
or a descriptor of more tensors -- arrives whole and is named, not truncated.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from mpi4py import MPI

from mpx.collectives.base import (
    Backoff,
    CollectiveTimeout,
    Handle,
    MPXValueError,
    Steps,
    numpy_view,
    wire_view,
)
from mpx.collectives.core import Communicator, count_payload
from mpx.collectives.impl import truncated
from mpx.collectives.p2p.tensor_header import HEADER_LEN, decode_header, encode_header

__all__ = [
    "DESCRIPTOR",
    "HEADER_BYTES",
    "MARKER",
    "MAX_NOTE_BYTES",
    "MAX_TENSORS",
    "DataRequest",
    "Head",
    "HeadRequest",
    "Metas",
    "decode",
    "describe",
    "descriptor",
    "encode",
    "marker",
    "mismatch",
    "read_head",
    "receive_data",
    "receive_head",
    "send_data",
    "send_head",
]

Metas = list[tuple[torch.Size, torch.dtype]]

MAX_TENSORS = 255
"""Tensors in one message."""

MAX_NOTE_BYTES = 16384
"""Room for a header's pickled note."""

_FIXED = 2  # int64 words before the rows: count (or the marker, or DESCRIPTOR), then one more
HEADER_BYTES = 8 * (_FIXED + MAX_TENSORS * HEADER_LEN) + MAX_NOTE_BYTES
"""Bytes of a first part's receive: the longest header (a descriptor is shorter)."""

MARKER = -1
"""A header's count word: "the last header on this stream, again"."""

DESCRIPTOR = int.from_bytes(b"mpx:desc", "little")
"""A descriptor's first word; a header's (a count, or -1) is never it."""

_MARKER = torch.tensor([MARKER, 0], dtype=torch.int64).view(torch.uint8)
_MARKER_RAW = _MARKER.numpy()


def _check_count(count: int) -> None:
    if count > MAX_TENSORS:
        raise MPXValueError(
            f"a message carries {count} tensors, more than {MAX_TENSORS}; "
            "stack them into fewer tensors"
        )


def _rows(words: np.ndarray, metas: Iterable[tuple[Sequence[int], torch.dtype]]) -> None:
    for k, (shape, dtype) in enumerate(metas):
        start = _FIXED + k * HEADER_LEN
        words[start : start + HEADER_LEN] = encode_header(tuple(shape), dtype).numpy()


def encode(tensors: Sequence[torch.Tensor], note: bytes) -> torch.Tensor:
    """A header: count, note length, each tensor's :func:`encode_header`, the note (uint8).

    Raises:
        MPXValueError: too many tensors, too many dimensions, or a note too large.
        MPXTypeError: a dtype no operation takes.
    """
    _check_count(len(tensors))
    if len(note) > MAX_NOTE_BYTES:
        raise MPXValueError(
            f"a message's note takes {len(note)} bytes pickled, more than {MAX_NOTE_BYTES}; "
            "send large values as tensors"
        )
    words = np.empty(_FIXED + len(tensors) * HEADER_LEN, dtype=np.int64)
    words[0], words[1] = len(tensors), len(note)
    _rows(words, ((t.shape, t.dtype) for t in tensors))
    return torch.frombuffer(bytearray(words.tobytes() + note), dtype=torch.uint8)


def marker() -> tuple[torch.Tensor, np.ndarray]:
    """A marker, as a tensor and numpy (shared: MPI only reads a send buffer)."""
    return _MARKER, _MARKER_RAW


def descriptor(
    metas: Iterable[tuple[torch.Size, torch.dtype]],
) -> tuple[torch.Tensor, np.ndarray, bytes]:
    """The descriptor of tensors of these (shape, dtype): to send (a tensor and its numpy,
    shared: MPI only reads a send buffer), and its bytes (to compare).

    Raises:
        MPXValueError: too many tensors or dimensions.
        MPXTypeError: a dtype no operation takes.
    """
    return _descriptor(tuple(metas))


@functools.lru_cache(maxsize=1024)
def _descriptor(
    key: tuple[tuple[torch.Size, torch.dtype], ...],
) -> tuple[torch.Tensor, np.ndarray, bytes]:
    # Cached: a layer's messages repeat a few shapes, and this runs on every post and expect.
    _check_count(len(key))
    words = np.empty(_FIXED + len(key) * HEADER_LEN, dtype=np.int64)
    words[0], words[1] = DESCRIPTOR, len(key)
    _rows(words, key)
    data = words.tobytes()
    raw = np.frombuffer(bytearray(data), dtype=np.uint8)
    return torch.from_numpy(raw), raw, data


@dataclass
class Head:
    """A first part as received: ``kind`` is "header", "marker", "descriptor", "nothing"
    (an empty message: the settling of a receive nobody sent to) or "other"."""

    kind: str
    nbytes: int  # -1: longer than HEADER_BYTES (MPI truncated it)
    metas: Metas = field(default_factory=list)
    note: bytes = b""


def read_head(raw: np.ndarray, nbytes: int | None) -> Head:
    """What the first ``nbytes`` of ``raw`` (uint8) hold; None: all of ``raw``, maybe padded."""
    size = len(raw) if nbytes is None else nbytes
    if size == 0:
        return Head("nothing", 0)
    if size < 8 * _FIXED:
        return Head("other", size)
    first, second = (int(w) for w in raw[: 8 * _FIXED].view(np.int64))
    if first == MARKER and second == 0 and nbytes in (None, 8 * _FIXED):
        return Head("marker", size)
    if first == DESCRIPTOR:
        kind, count, note_len = "descriptor", second, 0
    elif 0 <= first <= MAX_TENSORS and 0 <= second <= MAX_NOTE_BYTES:
        kind, count, note_len = "header", first, second
    else:
        return Head("other", size)
    end = 8 * (_FIXED + count * HEADER_LEN) if 0 <= count <= MAX_TENSORS else -1
    fits = end + note_len <= size if nbytes is None else end + note_len == size
    if end < 0 or not fits:
        return Head("other", size)
    rows = raw[8 * _FIXED : end].view(np.int64).reshape(count, HEADER_LEN)
    try:
        metas = [decode_header(torch.from_numpy(row)) for row in rows]
    except MPXValueError:
        return Head("other", size)
    return Head(kind, size, metas, raw[end : end + note_len].tobytes())


def decode(header: torch.Tensor) -> tuple[Metas, bytes] | None:
    """What :func:`encode` wrote (``header`` may be longer); None for a marker.

    Raises:
        MPXValueError: ``header`` holds no header.
    """
    head = read_head(header.numpy(), None)
    if head.kind == "marker":
        return None
    if head.kind != "header":
        raise MPXValueError(f"not a channel header ({head.kind}, {head.nbytes} bytes)")
    return head.metas, head.note


def describe(metas: Sequence[tuple[Sequence[int], torch.dtype]]) -> str:
    """``"2 tensors: float32[4], int64[2, 3]"``."""
    named = ", ".join(f"{str(d).removeprefix('torch.')}{list(s)}" for s, d in metas)
    return f"{len(metas)} tensor{'' if len(metas) == 1 else 's'}{': ' if metas else ''}{named}"


def mismatch(peer: int, tag: int, head: Head, wanted: Metas | None, how: str) -> MPXValueError:
    """The error of a message that is not what its receive expects, naming both sides.

    Args:
        head: the first part that arrived.
        wanted: what the receiver expects (None: a header).
        how: how it expects it ("like=", "into=").
    """
    where = f"Channel: the message from rank {peer} (tag {tag})"
    mine = "a header (expect() without like= or into=)" if wanted is None else describe(wanted)
    settle = "drain() settles the channel"
    if head.kind == "descriptor" and wanted is not None:
        undefined = "; the into= tensors hold undefined values" if how == "into=" else ""
        return MPXValueError(
            f"{where} does not match its receive: the sender posted {describe(head.metas)}, "
            f"the receiver expects {mine} ({how}); receive it with like= of the sender's "
            f"shapes and dtypes, or post what the receiver expects ({settle}{undefined})"
        )
    if head.kind == "descriptor":
        return MPXValueError(
            f"{where} came without a header (the sender posted {describe(head.metas)}), the "
            f"receiver expects {mine}; post it with header=True, or expect it with like= of "
            f"its shapes and dtypes ({settle})"
        )
    if head.kind in ("header", "marker") and wanted is not None:
        sent = (
            describe(head.metas)
            if head.kind == "header"
            else "on a stream, a marker repeating its last header"
        )
        return MPXValueError(
            f"{where} came with a header (the sender posted with header=True: {sent}), the "
            f"receiver expects none ({how} {mine}); post it without header=True, or expect "
            f"it without like= and into= ({settle})"
        )
    size = f"more than {HEADER_BYTES}" if head.nbytes < 0 else str(head.nbytes)
    return MPXValueError(
        f"{where} does not start with a header or descriptor ({size} bytes; the receiver "
        f"expects {mine}): the sender and the receiver are out of step (an earlier message "
        f"on this tag had more or fewer tensors than its receive, or another sender uses "
        f"the tag); {settle}, and keep other traffic on tags of its own"
    )


class HeadRequest(Handle[int]):
    """A first part's send or receive: one MPI request, which the channel polls itself.

    A first part goes with every message, and a :class:`Handle` built by
    :meth:`Communicator.run <mpx.collectives.Communicator.run>` costs tens of
    microseconds (a generator, the lock, the progress thread told): this one
    costs its MPI call. It is deliberately not set up by ``Handle.__init__``:
    nothing but the channel polls it (it is never given to the progress thread,
    so it needs no lock), and it overrides what a Handle's users call --
    :meth:`done`, :meth:`wait`, ``completed``. A receive's result is the length
    of the message in bytes (0: the empty message of a drain).
    """

    def __init__(
        self, op: str, request: MPI.Request, raw: np.ndarray, peer: int, timeout: float | None
    ) -> None:
        self.op, self.impl = op, "mpi"
        self.raw = raw  # the buffer MPI reads or writes, as numpy (no conversion per read)
        self._request, self._status, self._peer = request, MPI.Status(), peer
        self._timeout = timeout
        self._finished, self._result, self._error = False, 0, None

    def done(self) -> bool:
        """Tests the request; True once complete (an MPI error is kept for :meth:`wait`)."""
        if not self._finished:
            try:
                if not self._request.Test(self._status):
                    return False
                self._result = self._status.Get_count(MPI.BYTE)
            except MPI.Exception as error:  # e.g. a receive truncated
                self._error = error
            self._finished = True
        return True

    def wait(self, timeout: float | None = None) -> int:
        """Polls until complete; the length received. Raises the MPI error, if any.

        Raises:
            CollectiveTimeout: past ``timeout`` (else the communicator's).
        """
        if self.done():
            return self._result_or_raise()
        limit = self._timeout if timeout is None else timeout
        deadline = None if limit is None else time.monotonic() + limit
        backoff = Backoff()
        while not self.done():
            if limit is not None and deadline is not None and time.monotonic() > deadline:
                raise CollectiveTimeout(self.op, self.impl, limit, [self._peer])
            backoff.pause()
        return self._result_or_raise()


class DataRequest(HeadRequest):
    """A CPU tensor of a message, sent or received straight through MPI: what
    :func:`mpx.collectives.send` and ``recv`` end as for it (point to point runs on
    MPI whatever the policy, :func:`mpx.collectives.core.policy.choose`), without their
    checks, generator and handle: a pipeline's round trip of a 4 KiB activation and
    its gradient takes 35 us this way, 84-100 through them (mpi4py alone: 5;
    ``benchmarks/bench_channel.py``).

    A receive into a buffer smaller than the message raises
    :class:`~mpx.collectives.MPXValueError` naming both, as ``recv`` does.
    """

    def __init__(
        self,
        op: str,
        request: MPI.Request,
        tensor: torch.Tensor,
        peer: int,
        tag: int,
        timeout: float | None,
    ) -> None:
        super().__init__(op, request, _NO_HEAD, peer, timeout)
        self._tensor, self._tag = tensor, tag  # the tensor: MPI's memory stays alive

    def _result_or_raise(self) -> int:
        error = self._error
        if isinstance(error, MPI.Exception):
            where = f"rank {self._peer}, tag {self._tag}"
            clear = truncated(error, self._tensor, where)
            if clear is not error:
                raise clear from None
        return super()._result_or_raise()


def send_data(comm: Communicator, t: torch.Tensor, peer: int, tag: int) -> DataRequest:
    """Sends a CPU tensor (contiguous, a dtype MPI moves) straight through MPI; returns at once."""
    return _data("send", comm, t, peer, tag)


def receive_data(comm: Communicator, t: torch.Tensor, peer: int, tag: int) -> DataRequest:
    """Receives into a CPU tensor (contiguous, ours) straight through MPI; returns at once."""
    return _data("recv", comm, t, peer, tag)


_NO_HEAD = np.empty(0, dtype=np.uint8)  # a data part's HeadRequest.raw: it has no first part
_MPI_TYPES: dict[torch.dtype, MPI.Datatype] = {}


def _data(op: str, comm: Communicator, t: torch.Tensor, peer: int, tag: int) -> DataRequest:
    # The memory by its address, with the datatype mpi4py reads off the numpy view
    # send/recv hand it (bfloat16 as int16): 0.3 us where making that view takes 3.5.
    wire = wire_view(t)
    kind = _MPI_TYPES.get(wire.dtype)
    if kind is None:
        code = numpy_view(torch.empty(0, dtype=wire.dtype)).dtype.char
        kind = _MPI_TYPES[wire.dtype] = MPI.Datatype.fromcode(code)
    message = [MPI.buffer.fromaddress(wire.data_ptr(), wire.nbytes), kind]
    start = comm.mpi.Isend if op == "send" else comm.mpi.Irecv
    try:
        request = start(message, peer, tag)  # dest or source, then tag
    except MPI.Exception:
        _usable(comm, op)
        raise
    count_payload(wire.nbytes)  # as send and recv count theirs
    return DataRequest(op, request, t, peer, tag, comm.timeout)


def _usable(comm: Communicator, op: str) -> None:
    """Raises the communicator's own error if it is freed or broken (an MPI call on a
    freed one fails with MPI's, which names nothing)."""
    comm.run(op, "mpi", _no_steps(), False, None)


def _no_steps() -> Steps[None]:
    return
    yield  # a generator of no steps


def send_head(comm: Communicator, raw: np.ndarray, peer: int, tag: int) -> HeadRequest:
    """Sends a first part (``raw``: uint8) straight through MPI; returns at once."""
    try:
        request = comm.mpi.Isend([raw, MPI.BYTE], dest=peer, tag=tag)
    except MPI.Exception:
        _usable(comm, "send")
        raise
    return HeadRequest("send", request, raw, peer, comm.timeout)


def receive_head(comm: Communicator, raw: np.ndarray, peer: int, tag: int) -> HeadRequest:
    """Receives a first part into ``raw`` (uint8, :data:`HEADER_BYTES`); returns at once."""
    try:
        request = comm.mpi.Irecv([raw, MPI.BYTE], source=peer, tag=tag)
    except MPI.Exception:
        _usable(comm, "recv")
        raise
    return HeadRequest("recv", request, raw, peer, comm.timeout)
