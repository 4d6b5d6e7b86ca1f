"""mpx.collectives.Channel: tagged, non-blocking point-to-point messages.

The multi-rank tests talk to ring neighbours (right = rank + 1, left = rank - 1,
modulo the size), so they run alike on 1 rank (a rank talking to itself), 2
and 3.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from mpx.collectives import (
    Channel,
    CollectiveTimeout,
    Communicator,
    MPXTypeError,
    MPXValueError,
    RemoteError,
    bytes_communicated,
    world,
)
from mpx.collectives.p2p import channel as channel_module
from mpx.collectives.p2p import channel_state, channel_wire

TIMEOUT_S = 60.0


def _shape(rank: int, step: int) -> tuple[int, int]:
    """A shape that changes every other step and differs between senders."""
    return (2 + rank, 3 + step // 2)


# -- one process --------------------------------------------------------------


def test_header_round_trip_with_note_and_bool() -> None:
    tensors = [
        torch.zeros(2, 3),
        torch.zeros(4, dtype=torch.bool),
        torch.zeros((), dtype=torch.int64),
    ]
    header = channel_module.encode(tensors, b"note")
    padded = torch.zeros(channel_module.HEADER_BYTES, dtype=torch.uint8)
    padded[: header.numel()] = header  # a header receive is longer than its message
    decoded = channel_module.decode(padded)
    assert decoded is not None
    metas, note = decoded
    assert metas == [
        (torch.Size((2, 3)), torch.float32),
        (torch.Size((4,)), torch.bool),
        (torch.Size(()), torch.int64),
    ]
    assert note == b"note"


def test_encode_refuses_what_does_not_fit() -> None:
    with pytest.raises(MPXValueError, match="more than 255"):
        channel_module.encode([torch.zeros(1)] * 256, b"")
    with pytest.raises(MPXValueError, match="note takes"):
        channel_module.encode([], bytes(channel_module.MAX_NOTE_BYTES + 1))
    with pytest.raises(MPXTypeError, match="complex64"):
        channel_module.encode([torch.zeros(1, dtype=torch.complex64)], b"")


def test_bad_arguments_name_the_value_and_send_nothing(self_comm: Communicator) -> None:
    ch = Channel(self_comm, timeout=TIMEOUT_S)
    with pytest.raises(MPXValueError, match="peer"):
        ch.post(5, 0, torch.zeros(1))
    with pytest.raises(MPXValueError, match="tag must be an int"):
        ch.post(0, -1, torch.zeros(1))
    with pytest.raises(MPXTypeError, match="complex64"):
        ch.post(0, 0, [torch.zeros(1), torch.zeros(1, dtype=torch.complex64)])
    with pytest.raises(MPXTypeError, match=r"torch\.Tensor"):
        ch.post(0, 0, [torch.zeros(1), [1.0]])  # type: ignore[list-item]
    with pytest.raises(MPXValueError, match="header=True"):
        ch.post(0, 0, torch.zeros(1), note="x")
    with pytest.raises(MPXValueError, match="like= or into="):
        ch.expect(0, 0, like=[((1,), torch.float32)], into=[torch.zeros(1)])
    with pytest.raises(MPXValueError, match="timeout"):
        Channel(self_comm, timeout=0)
    assert ch.ledger() == {"sent": {}, "posted": {}}  # nothing left half sent


def test_receive_buffers_are_reused(self_comm: Communicator) -> None:
    ch = Channel(self_comm, timeout=TIMEOUT_S)
    for _ in range(3):
        incoming = ch.expect(0, 1)
        ch.post(0, 1, torch.ones(4, 5), header=True)
        message = ch.receive(incoming)
        assert torch.equal(message.tensors[0], torch.ones(4, 5))
        ch.release(message.tensors)
    ch.flush()
    assert ch.buffers_allocated == 2  # one header buffer, one data buffer
    with pytest.raises(MPXValueError, match="already received"):
        ch.receive(incoming)


def test_cpu_data_goes_straight_to_mpi_counted_and_a_short_buffer_is_named(
    self_comm: Communicator,
) -> None:
    # A CPU tensor's message is the MPI call mpx.collectives.send/recv would make
    # (channel_wire.DataRequest), counted in bytes_communicated as theirs are.
    ch = Channel(self_comm, timeout=TIMEOUT_S)
    x = torch.arange(12.0).view(3, 4)
    before = bytes_communicated()
    incoming = ch.expect(0, 2, like=[(x.shape, x.dtype)])
    sent = ch.post(0, 2, x)
    data = [handle for _, handle in sent.entries[1:]] + [h for _, h in incoming.entries]
    assert len(data) == 2
    assert all(isinstance(h, channel_wire.DataRequest) for h in data)
    assert torch.equal(ch.receive(incoming).tensors[0], x)
    ch.flush()
    assert bytes_communicated() - before == 2 * x.nbytes  # the send's and the receive's
    short = torch.zeros(2)
    receive = channel_wire.receive_data(self_comm, short, 0, 9)
    channel_wire.send_data(self_comm, torch.zeros(5), 0, 9).wait()
    with pytest.raises(
        MPXValueError,
        match=r"rank 0, tag 9 is larger than the receive buffer \(float32\[2\], 8 bytes\)",
    ):
        receive.wait()


def test_a_dropped_channel_is_freed_though_its_interrupt_reaches_it(
    self_comm: Communicator,
) -> None:
    # Its finalizer's arguments live until the channel dies: they must not reach it.
    class Owner:
        def __init__(self) -> None:
            self.channel = Channel(self_comm, timeout=TIMEOUT_S, interrupt=self.interrupt)

        def interrupt(self) -> None:
            pass

    owner = Owner()
    owner.channel.post(0, 4, torch.ones(2))
    owner.channel.receive(owner.channel.expect(0, 4, like=[((2,), torch.float32)]))
    dropped = weakref.ref(owner.channel)
    del owner
    gc.collect()
    assert dropped() is None


def test_a_dropped_channel_keeps_its_messages_in_flight_alive(self_comm: Communicator) -> None:
    comm = self_comm
    sent = torch.randn(1 << 18)  # 1 MiB: MPI waits for the receiver (rendezvous)
    ch = Channel(comm, timeout=TIMEOUT_S)
    ch.post(0, 3, sent.clone())
    in_flight = [h for _, h in ch.in_flight()]
    assert in_flight  # MPICH holds a rendezvous send until its receive
    del ch
    gc.collect()
    adopted = [t for t, h in channel_state.ORPHANS if any(h is g for g in in_flight)]
    assert len(adopted) == len(in_flight)
    later = Channel(comm, timeout=TIMEOUT_S)
    incoming = later.expect(0, 3, like=[(sent.shape, sent.dtype)])
    assert torch.equal(later.receive(incoming).tensors[0], sent)  # the message was intact
    # A dropped channel keeps its posted receive buffers alive the same way.
    incoming = later.expect(0, 5, like=[(sent.shape, sent.dtype)])
    buf = incoming.entries[0][0]
    del later, incoming
    gc.collect()
    assert any(t is buf for t, _ in channel_state.ORPHANS)
    sender = Channel(comm, timeout=TIMEOUT_S)
    sender.post(0, 5, sent.clone())
    sender.flush()  # the orphaned receive took it
    channel_state.reap_orphans()
    assert torch.equal(buf, sent)
    assert not any(t is buf for t, _ in channel_state.ORPHANS)


# -- multi-rank ---------------------------------------------------------------


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_changing_shapes_renegotiate_headers_only_on_change(
    ring: tuple[Communicator, int, int],
) -> None:
    comm, right, left = ring
    ch = Channel(comm, timeout=TIMEOUT_S)
    steps = 6
    # Every receive posted ahead, before any peer sends.
    incoming = [ch.expect(left, 100 + k, stream=0) for k in range(steps)]
    for k in range(steps):
        x = torch.full(_shape(comm.rank, k), float(comm.rank * 100 + k), dtype=torch.float64)
        mask = torch.arange(x.shape[1]) % 2 == 0
        ch.post(right, 100 + k, [x, mask], header=True, note=("step", k % 2), stream=0)
    for k, inc in enumerate(incoming):
        message = ch.receive(inc)
        x, mask = message.tensors
        assert x.shape == _shape(left, k)
        assert torch.equal(x, torch.full(_shape(left, k), float(left * 100 + k), dtype=x.dtype))
        assert mask.dtype == torch.bool
        assert torch.equal(mask, torch.arange(x.shape[1]) % 2 == 0)
        assert message.note == ("step", k % 2)
        ch.release(message.tensors)
    ch.flush()
    # The note alternates, so only the repeats of (note, shapes) two steps apart... are not
    # repeats: a header goes out whenever (note, shapes) differs from the last one.
    assert ch.full_headers_sent == ch.full_headers_received == steps
    # Same note, same shapes: markers only.
    incoming = [ch.expect(left, 200 + k, stream=1) for k in range(4)]
    for k in range(4):
        ch.post(right, 200 + k, torch.ones(3), header=True, stream=1)
    for inc in incoming:
        assert torch.equal(ch.receive(inc).tensors[0], torch.ones(3))
    ch.flush()
    assert ch.full_headers_sent == ch.full_headers_received == steps + 1
    ch.drain()


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_a_receive_posted_ahead_arrives_while_the_rank_computes(
    ring: tuple[Communicator, int, int],
) -> None:
    comm, right, left = ring
    ch = Channel(comm, timeout=TIMEOUT_S)
    incoming = ch.expect(left, 7)  # header first: the shapes are not known here
    ch.post(right, 7, torch.arange(comm.rank + 4.0), header=True)
    # "Compute" while polling: the header arrives, its data receive is posted by
    # progress, the data arrives -- all before receive() is called.
    deadline = torch.tensor(0.0)
    while not ch.ready(incoming):
        deadline += 1
        assert deadline < 10_000_000
    assert incoming.described
    message = ch.receive(incoming)
    assert torch.equal(message.tensors[0], torch.arange(left + 4.0))
    # Known shapes: like= and into= post the data receives at once.
    box = torch.zeros(2, 2)
    into = ch.expect(left, 8, into=[box])
    like = ch.expect(left, 9, like=[((3,), torch.int64)])
    ch.post(right, 9, torch.arange(3) + comm.rank)
    ch.post(right, 8, torch.full((2, 2), float(comm.rank)))
    assert ch.receive(into).tensors[0] is box
    assert torch.equal(box, torch.full((2, 2), float(left)))
    assert torch.equal(ch.receive(like).tensors[0], torch.arange(3) + left)
    ch.drain()


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_an_error_on_one_rank_raises_on_every_rank_and_the_channel_starts_clean(
    ring: tuple[Communicator, int, int],
) -> None:
    comm, right, left = ring
    ch = Channel(comm, timeout=TIMEOUT_S)
    # Left in every state a failure can leave: a header expected and never sent, a
    # message sent and never expected, a large one in flight (rendezvous).
    ch.expect(left, 1)
    ch.post(right, 2, torch.ones(5))
    ch.post(right, 3, torch.ones(1 << 18), header=True, stream=0)
    error = ValueError("injected on the last rank") if comm.rank == comm.size - 1 else None
    with pytest.raises(RemoteError, match=f"on rank {comm.size - 1}: ValueError: injected"):
        ch.drain(error, "the test's exchange")
    assert ch.in_flight() == []
    # The same tags carry the next exchange, untouched by the failed one's messages.
    for tag in (1, 2, 3):
        incoming = ch.expect(left, tag, stream=0)
        ch.post(right, tag, torch.full((2,), float(tag)), header=True, stream=0)
        assert torch.equal(ch.receive(incoming).tensors[0], torch.full((2,), float(tag)))
    ch.drain()


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_a_wait_times_out_naming_the_peer_and_drain_settles_it(
    ring: tuple[Communicator, int, int],
) -> None:
    comm, right, left = ring
    ch = Channel(comm, timeout=0.5)
    incoming = ch.expect(left, 4)  # nobody sends it
    with pytest.raises(CollectiveTimeout, match=f"rank.*{left}"):
        ch.receive(incoming)
    ch.drain()  # the peers answer the receive nothing matched
    incoming = ch.expect(left, 4, like=[((1,), torch.float32)])
    ch.post(right, 4, torch.ones(1))
    assert torch.equal(ch.receive(incoming).tensors[0], torch.ones(1))
    ch.drain()


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_an_interrupt_ends_a_wait(ring: tuple[Communicator, int, int]) -> None:
    comm, _, left = ring

    class Stop(Exception):
        pass

    def interrupt() -> None:
        raise Stop("another rank gave up")

    ch = Channel(comm, timeout=TIMEOUT_S, interrupt=interrupt)
    incoming = ch.expect(left, 6, like=[((1,), torch.float32)])
    with pytest.raises(Stop):
        ch.receive(incoming)
    ch.interrupt = None
    ch.drain()


@pytest.mark.mpi
@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_cuda_tensors_of_changing_shapes(ring: tuple[Communicator, int, int]) -> None:
    comm, right, left = ring
    device = torch.device("cuda", world().node_rank % torch.cuda.device_count())
    ch = Channel(comm, timeout=TIMEOUT_S)
    incoming = [ch.expect(left, 300 + k, stream=0, device=device) for k in range(4)]
    for k in range(4):
        x = torch.full(_shape(comm.rank, k), float(k), device=device)
        ch.post(right, 300 + k, x, header=True, stream=0)
    for k, inc in enumerate(incoming):
        got = ch.receive(inc).tensors[0]
        assert got.device == device
        assert torch.equal(got.cpu(), torch.full(_shape(left, k), float(k)))
    box = torch.zeros(3, device=device)
    into = ch.expect(left, 400, into=[box])
    ch.post(right, 400, torch.ones(3, device=device))
    ch.receive(into)
    assert torch.equal(box.cpu(), torch.ones(3))
    ch.drain()
