"""mpx.collectives.Channel: a message that is not what its receive expects is an error.

Before, MPI matched by source and tag alone: 4 floats landed in a receive of 8
(4 never sent), float32 in an int32 or float64 receive was reinterpreted, and a
header read as data (or data as a header) was garbage or a raw numpy error.
Now every message starts with a header or a descriptor of its shapes and
dtypes, and any difference is an MPXValueError naming both sides.

The multi-rank tests talk to ring neighbours (right = rank + 1, left = rank - 1,
modulo the size), so they run alike on 1 rank (a rank talking to itself), 2
and 3. Every rank drains before asserting: a failed assertion never leaves a
peer waiting.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from mpx.collectives import Channel, Communicator, MPXValueError, RemoteError
from mpx.collectives.p2p import channel_wire as wire
from mpx.collectives.p2p.tensor_header import HEADER_LEN, decode_header, encode_header

TIMEOUT_S = 30.0
TAG = 11


@dataclass
class Case:
    """One kind of mismatch: what the sender posts, how the receiver expects it, and
    the texts the error must hold (the sender's side and the receiver's)."""

    tensors: Callable[[], list[torch.Tensor]]
    expect: Callable[[], dict[str, Any]]
    names: list[str]
    header: bool = False
    post: dict[str, Any] = field(default_factory=dict)


def _like(*metas: tuple[tuple[int, ...], torch.dtype]) -> Callable[[], dict[str, Any]]:
    return lambda: {"like": list(metas)}


F32 = torch.float32
CASES = {
    "fewer elements than expected": Case(
        lambda: [torch.ones(4)],
        _like(((8,), F32)),
        ["sender posted 1 tensor: float32[4]", "float32[8]"],
    ),
    "more elements than expected": Case(
        lambda: [torch.ones(8)], _like(((4,), F32)), ["float32[8]", "expects 1 tensor: float32[4]"]
    ),
    "float32 received as int32": Case(
        lambda: [torch.ones(4)], _like(((4,), torch.int32)), ["float32[4]", "int32[4]"]
    ),
    "float32 received as float64": Case(
        lambda: [torch.ones(4)], _like(((4,), torch.float64)), ["float32[4]", "float64[4]"]
    ),
    "float32 into int64 of as many bytes": Case(
        lambda: [torch.ones(4)],
        lambda: {"into": [torch.zeros(2, dtype=torch.int64)]},
        ["float32[4]", "int64[2]", "into="],
    ),
    "float32 into a larger int64": Case(
        lambda: [torch.ones(4)],
        lambda: {"into": [torch.zeros(4, dtype=torch.int64)]},
        ["float32[4]", "int64[4]", "into="],
    ),
    "more tensors than expected": Case(
        lambda: [torch.ones(4), torch.ones(2)],
        _like(((4,), F32)),
        ["2 tensors: float32[4], float32[2]", "expects 1 tensor: float32[4]"],
    ),
    "fewer tensors than expected": Case(
        lambda: [torch.ones(4)],
        _like(((4,), F32), ((2,), F32)),
        ["posted 1 tensor: float32[4]", "expects 2 tensors: float32[4], float32[2]"],
    ),
    "a header where like= expects none": Case(
        lambda: [torch.ones(4)],
        _like(((4,), F32)),
        ["header=True: 1 tensor: float32[4]", "expects none (like= 1 tensor: float32[4])"],
        header=True,
    ),
    "a header with a note where like= expects none": Case(
        lambda: [torch.ones(4)],
        _like(((4,), F32)),
        ["header=True: 1 tensor: float32[4]", "expects none (like= 1 tensor: float32[4])"],
        header=True,
        post={"note": "x" * 2000},
    ),
    "no header where a header is expected": Case(
        lambda: [torch.ones(4, 3)],
        lambda: {},
        ["without a header (the sender posted 1 tensor: float32[4, 3])", "expects a header"],
    ),
}


def _recovers(ch: Channel, right: int, left: int) -> None:
    """The tag carries correct messages after the mismatch and a drain, both ways of
    receiving (shapes known, and a header)."""
    mask = torch.tensor([True, False, True])
    incoming = ch.expect(left, TAG, like=[((3,), F32), ((3,), torch.bool)])
    ch.post(right, TAG, [torch.full((3,), 7.0), mask])
    x, got = ch.receive(incoming).tensors
    assert torch.equal(x, torch.full((3,), 7.0))
    assert torch.equal(got, mask)
    incoming = ch.expect(left, TAG)
    ch.post(right, TAG, torch.arange(5), header=True)
    assert torch.equal(ch.receive(incoming).tensors[0], torch.arange(5))
    ch.drain()


@pytest.mark.mpi
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(CASES))
def test_a_mismatch_raises_in_receive_naming_both_sides(
    name: str, ring: tuple[Communicator, int, int]
) -> None:
    case = CASES[name]
    comm, right, left = ring
    ch = Channel(comm, timeout=TIMEOUT_S)
    incoming = ch.expect(left, TAG, **case.expect())
    ch.post(right, TAG, case.tensors(), header=case.header, **case.post)
    raised: BaseException | None = None
    try:
        ch.receive(incoming)
    except Exception as error:  # asserted after the drain: no rank is left waiting
        raised = error
    ch.drain()  # the receive that raised is settled; not raised again
    assert isinstance(raised, MPXValueError), repr(raised)
    text = str(raised)
    assert f"from rank {left} (tag {TAG})" in text
    for part in case.names:
        assert part in text, (part, text)
    _recovers(ch, right, left)


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_ready_is_true_once_a_mismatch_is_known(ring: tuple[Communicator, int, int]) -> None:
    comm, right, left = ring
    ch = Channel(comm, timeout=TIMEOUT_S)
    # Fewer tensors than expected: the second data receive would never complete.
    incoming = ch.expect(left, TAG, like=[((4,), F32), ((2,), F32)])
    ch.post(right, TAG, torch.ones(4))
    polls = 0
    while not ch.ready(incoming) and polls < 1_000_000:
        polls += 1
    raised: BaseException | None = None
    try:
        ch.receive(incoming)
    except Exception as error:
        raised = error
    ch.drain()
    assert polls < 1_000_000
    assert isinstance(raised, MPXValueError)
    assert "expects 2 tensors" in str(raised)
    _recovers(ch, right, left)


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_a_mismatch_nobody_received_is_raised_by_drain_on_every_rank(
    ring: tuple[Communicator, int, int],
) -> None:
    comm, right, left = ring
    ch = Channel(comm, timeout=TIMEOUT_S)
    # Only the last rank sends the wrong message (to rank 0); nobody calls receive.
    last = comm.size - 1
    ch.expect(left, TAG, like=[((8,), F32)])
    ch.post(right, TAG, torch.ones(4 if comm.rank == last else 8))
    if comm.rank == 0:
        expected: type[Exception] = MPXValueError
        pattern = re.escape(f"from rank {last} (tag {TAG})") + ".*float32\\[4\\].*float32\\[8\\]"
    else:
        expected, pattern = RemoteError, "on rank 0: MPXValueError: .*float32\\[4\\]"
    with pytest.raises(expected, match=pattern):
        ch.drain()
    assert ch.in_flight() == []
    _recovers(ch, right, left)


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_a_message_out_of_step_is_named_even_when_mpi_truncates_it(
    ring: tuple[Communicator, int, int],
) -> None:
    comm, right, left = ring
    ch = Channel(comm, timeout=TIMEOUT_S)
    # Two receives of one tensor each; one message of two: its second tensor (40 kB,
    # more than any first part) lands in the second receive's first part, which MPI
    # truncates.
    first = ch.expect(left, TAG, like=[((4,), F32)])
    second = ch.expect(left, TAG, like=[((4,), F32)])
    ch.post(right, TAG, [torch.ones(4), torch.ones(10_000)])
    raised: list[BaseException | None] = []
    for incoming in (first, second):
        try:
            ch.receive(incoming)
            raised.append(None)
        except Exception as error:
            raised.append(error)
    ch.drain()
    assert all(isinstance(error, MPXValueError) for error in raised), raised
    assert "2 tensors: float32[4], float32[10000]" in str(raised[0])
    text = str(raised[1])
    assert f"more than {wire.HEADER_BYTES} bytes" in text, text
    assert "expects 1 tensor: float32[4]" in text
    assert "out of step" in text
    _recovers(ch, right, left)


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_a_marker_where_like_expects_none(ring: tuple[Communicator, int, int]) -> None:
    comm, right, left = ring
    ch = Channel(comm, timeout=TIMEOUT_S)
    # A stream may span tags; one tag per message, as a header's data receives are
    # posted only once it is in (a receive posted meanwhile on its tag would come first).
    first = ch.expect(left, TAG, stream=0)
    second = ch.expect(left, TAG + 1, like=[((4,), F32)])
    for tag in (TAG, TAG + 1):  # the second header repeats the first: a marker
        ch.post(right, tag, torch.ones(4), header=True, stream=0)
    raised: BaseException | None = None
    try:
        assert torch.equal(ch.receive(first).tensors[0], torch.ones(4))
        ch.receive(second)
    except Exception as error:
        raised = error
    ch.drain()
    assert isinstance(raised, MPXValueError), repr(raised)
    assert "a marker repeating its last header" in str(raised)
    assert "like= 1 tensor: float32[4]" in str(raised)
    _recovers(ch, right, left)


# -- one process --------------------------------------------------------------


def test_a_first_part_is_told_apart_from_anything_else() -> None:
    metas = [(torch.Size((2, 3)), F32), (torch.Size((4,)), torch.bool)]
    sent, raw, data = wire.descriptor(metas)
    assert bytes(sent.numpy()) == bytes(raw) == data
    assert wire.descriptor(list(metas))[0] is sent  # cached: a post costs no encoding
    buf = np.zeros(wire.HEADER_BYTES, dtype=np.uint8)
    buf[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    head = wire.read_head(buf, len(data))
    assert (head.kind, head.metas) == ("descriptor", metas)
    header = wire.encode([torch.zeros(2, 3), torch.zeros(4, dtype=torch.bool)], b"note").numpy()
    buf[: len(header)] = header
    head = wire.read_head(buf, len(header))
    assert (head.kind, head.metas, head.note) == ("header", metas, b"note")
    assert wire.read_head(wire.marker()[1], 16).kind == "marker"
    assert wire.read_head(buf, 0).kind == "nothing"  # a drain's empty message
    assert wire.read_head(buf, len(header) - 1).kind == "other"  # a length that does not fit
    assert wire.read_head(buf, -1).kind == "other"  # truncated: longer than any first part
    floats = torch.randn(64).numpy().view(np.uint8)
    assert wire.read_head(floats, len(floats)).kind == "other"
    # int64 data that starts like a header of 2 tensors, and is not as long as one
    counts = torch.tensor([2, 0] + [0] * 19, dtype=torch.int64).numpy().view(np.uint8)
    assert wire.read_head(counts, len(counts)).kind == "other"


def test_decode_header_refuses_what_is_no_header() -> None:
    assert decode_header(encode_header((4, 2), F32)) == (torch.Size((4, 2)), F32)
    for bad in ([99, 1, 4], [0, 9, 4], [0, -1, 4], [0, 1, -4]):
        with pytest.raises(MPXValueError, match="not a tensor header"):
            decode_header(torch.tensor(bad + [0] * (HEADER_LEN - 3)))
    with pytest.raises(MPXValueError, match="not a channel header"):
        wire.decode(torch.randn(64).view(torch.uint8))


def test_post_and_expect_refuse_before_anything_moves(self_comm: Communicator) -> None:
    ch = Channel(self_comm, timeout=TIMEOUT_S)
    with pytest.raises(MPXValueError, match="more than 8 dimensions"):
        ch.post(0, TAG, torch.zeros((1,) * 9))
    with pytest.raises(MPXValueError, match="more than 255"):
        ch.post(0, TAG, [torch.zeros(1)] * 256)
    with pytest.raises(MPXValueError, match="into= takes contiguous"):
        ch.expect(0, TAG, into=[torch.zeros(2), torch.zeros(2, dtype=torch.bool)])
    assert ch.ledger() == {"sent": {}, "posted": {}}  # nothing half posted
