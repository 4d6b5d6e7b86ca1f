"""Headers and receive buffers of the point-to-point transport."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mpx.collectives import world
from mpx.pipeline import PipelineError
from mpx.pipeline.model.border import unflatten
from mpx.pipeline.runtime.transport import Inbox, Outbox, decode_header, encode_header


@pytest.mark.parametrize("shape", [(), (7,), (2, 3, 4), (1,) * 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64])
def test_header_round_trip(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    header = encode_header(torch.Size(shape), dtype)
    assert header.shape == (10,)
    assert header.dtype == torch.int64
    assert decode_header(header) == (torch.Size(shape), dtype)


def test_header_refuses_what_cannot_travel() -> None:
    with pytest.raises(PipelineError, match="more than 8 dimensions"):
        encode_header(torch.Size((1,) * 9), torch.float32)
    with pytest.raises(PipelineError, match="complex64"):
        encode_header(torch.Size((2,)), torch.complex64)


@pytest.mark.mpi
def test_send_to_self_with_header_and_reuse() -> None:
    # A rank talking to itself exercises the whole protocol on any world size.
    comm = world().split(world().rank)
    assert comm is not None
    out, inbox = Outbox(comm, 0, "act"), Inbox(comm, 0, "act")
    allocated = []
    for call in range(3):
        ids = [10 * call, 10 * call + 1]
        inbox.expect(ids)
        sent = [torch.randn(4, 5) for _ in ids]
        for j, t in zip(ids, sent, strict=True):
            assert out.send(j, t) == [False]  # no gradient comes back for it
        for j, t in zip(reversed(ids), reversed(sent), strict=True):  # any order
            parcel = inbox.get(j)
            assert parcel.spec == "T"
            assert torch.equal(parcel.tensors[0], t)
            inbox.release(parcel.tensors)
        out.wait_all()
        allocated.append(inbox.channel.buffers_allocated)
    # Buffers (headers and tensors) reused across calls.
    assert allocated[0] == allocated[-1] <= 4


@pytest.mark.mpi
def test_structures_cross_with_their_own_shapes_per_microbatch() -> None:
    # A tuple with a dict, a mask that needs no gradient, plain values; the
    # second micro-batch has other shapes than the first.
    comm = world().split(world().rank)
    assert comm is not None
    out, inbox = Outbox(comm, 0, "act"), Inbox(comm, 0, "act")
    inbox.expect([0, 1])
    sent: list[tuple[dict[str, Any], None, list[float]]] = []
    for j, n in enumerate((3, 5)):
        h = torch.randn(2, n, requires_grad=True)
        obj: tuple[dict[str, Any], None, list[float]] = (
            {"h": h * 2, "mask": torch.ones(2, n, dtype=torch.bool), "n": n},
            None,
            [1.5],
        )
        sent.append(obj)
        assert out.send(j, obj) == [True, False]
    for j, obj in enumerate(sent):
        parcel = inbox.get(j)
        assert parcel.flags == [True, False]
        got = unflatten(parcel.spec, parcel.tensors)
        assert got[1:] == (None, [1.5])
        assert got[0]["n"] == obj[0]["n"]
        assert torch.equal(got[0]["h"], obj[0]["h"].detach())
        assert torch.equal(got[0]["mask"], obj[0]["mask"])
    out.wait_all()
    with pytest.raises(PipelineError, match=r"output\[0\]\['x'\] is a set"):
        out.send(2, ({"x": {1}},))


def test_dropped_boxes_keep_messages_in_flight_alive() -> None:
    """A Pipeline discarded without flush must not free what MPI still reads or writes
    (the channel keeps them: mpx-collectives' test_channel checks how)."""
    import gc

    comm = world().split(world().rank)  # a rank talking to itself
    assert comm is not None
    sent = torch.randn(1 << 18)  # 1 MiB: MPI waits for the receiver (rendezvous)
    out = Outbox(comm, 0, "act")
    out.send(3, sent.clone())
    assert out.in_flight()  # MPICH holds a rendezvous send until its receive
    del out
    gc.collect()
    torch.randn(1 << 18)  # memory a freed send buffer would give to
    # The message is still intact for a receiver that comes later.
    inbox = Inbox(comm, 0, "act")
    inbox.expect([3])
    assert torch.equal(inbox.get(3).tensors[0], sent)
    # A dropped inbox's posted receive still takes its message, into live memory.
    inbox.post(5, [(sent.shape, sent.dtype)])  # posted, never waited for
    del inbox
    gc.collect()
    later = Outbox(comm, 0, "act")
    later.send_tensors(5, [sent.clone()])  # (no header: as gradients travel)
    later.wait_all()  # the orphaned receive takes it
