"""The fault-tolerant layer's wire in one process, and FaultTolerantOptimizer's argument checks."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import torch
from torch import nn

from mpx.dataparallel import DataParallelTypeError, DataParallelValueError, FaultTolerantOptimizer
from mpx.dataparallel.recovery.gradients import _sum_into
from mpx.dataparallel.recovery.links import (
    CHALLENGE,
    FRAME,
    GRAD,
    HELLO,
    STATE,
    PeerLinks,
    PeerLost,
    exchange,
    recv_frame,
    send_frame,
)
from mpx.dataparallel.recovery.state_payload import pack_state, unpack_state
from mpx.launch import NONCE_BYTES, JobKey, new_nonce


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    return a, b


def _never() -> None:
    return None


def test_exchange_swaps_large_payloads_both_ways() -> None:
    a, b = _pair()
    mine, theirs = torch.randn(300_000), torch.randn(300_000)  # more than a socket buffer
    got: dict[int, bytearray | memoryview] = {}

    def other() -> None:
        got.update(exchange({0: b}, 7, GRAD, theirs.numpy().data.cast("B"), _never))

    thread = threading.Thread(target=other)
    thread.start()
    received = exchange({1: a}, 7, GRAD, mine.numpy().data.cast("B"), _never)
    thread.join(timeout=30)
    assert torch.equal(torch.frombuffer(received[1], dtype=torch.float32), theirs)
    assert torch.equal(torch.frombuffer(got[0], dtype=torch.float32), mine)


def test_exchange_skips_an_older_steps_frame() -> None:
    a, b = _pair()
    send_frame(b, 3, GRAD, b"old!", _never)  # left over from a discarded step
    send_frame(b, 4, GRAD, b"new!", _never)
    received = exchange({1: a}, 4, GRAD, b"mine", _never)
    assert received == {1: bytearray(b"new!")}


def test_exchange_raises_when_the_peer_closes() -> None:
    a, b = _pair()
    b.close()
    with pytest.raises(PeerLost, match=r"group 1(.s link broke| closed its link)"):
        exchange({1: a}, 1, GRAD, b"x" * 10, _never)


def test_exchange_raises_on_another_kind_of_frame() -> None:
    a, b = _pair()
    send_frame(b, 1, STATE, b"state", _never)
    with pytest.raises(PeerLost, match="sent no gradients"):
        exchange({1: a}, 1, GRAD, b"x", _never)


def test_exchange_gives_up_when_check_says_the_peer_is_gone() -> None:
    a, _b = _pair()  # the peer never sends

    def gone() -> None:
        raise PeerLost("group 1 is no longer a member")

    with pytest.raises(PeerLost, match="no longer a member"):
        exchange({1: a}, 1, GRAD, b"x", gone)


def _model() -> nn.Module:
    return nn.Linear(2, 2)


def test_optimizer_argument_checks() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(DataParallelTypeError, match=r"torch\.optim\.Optimizer"):
        FaultTolerantOptimizer(model, model, lighthouse="127.0.0.1:1")  # type: ignore[arg-type]
    with pytest.raises(DataParallelTypeError, match=r"nn\.Module"):
        FaultTolerantOptimizer(opt, "model", lighthouse="127.0.0.1:1")  # type: ignore[arg-type]
    with pytest.raises(DataParallelTypeError, match="state must be a dict"):
        FaultTolerantOptimizer(opt, model, state=[1], lighthouse="127.0.0.1:1")  # type: ignore[arg-type]
    with pytest.raises(DataParallelValueError, match="mpxrun --replica-groups"):
        FaultTolerantOptimizer(opt, model, lighthouse="nowhere")
    mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())
    with pytest.raises(DataParallelValueError, match="dtypes"):
        FaultTolerantOptimizer(
            torch.optim.SGD(mixed.parameters(), lr=0.1), mixed, lighthouse="127.0.0.1:1"
        )


def test_exchange_receives_into_the_buffers_given() -> None:
    a, b = _pair()
    theirs = torch.randn(300_000)
    inbox = torch.zeros(300_000)
    send_frame(b, 2, GRAD, b"old!", _never)  # a discarded step's: not received into inbox
    thread = threading.Thread(
        target=lambda: send_frame(b, 3, GRAD, theirs.numpy().data.cast("B"), _never)
    )
    thread.start()
    got = exchange({1: a}, 3, GRAD, b"mine", _never, {1: inbox.numpy().data.cast("B")})
    thread.join(timeout=30)
    assert torch.frombuffer(got[1], dtype=torch.float32).data_ptr() == inbox.data_ptr()
    assert torch.equal(inbox, theirs)
    # A frame of another length than the buffer's is refused before it is read.
    send_frame(b, 3, GRAD, b"four", _never)
    with pytest.raises(PeerLost, match="sent a frame of 4 bytes, not 1200000"):
        exchange({1: a}, 3, GRAD, b"mine", _never, {1: inbox.numpy().data.cast("B")})


@pytest.mark.parametrize("members", [2, 3, 4])
def test_the_sum_is_the_same_bytes_in_the_members_order_and_leaves_the_parts(
    members: int,
) -> None:
    """The sum goes into a buffer of its own, adding in the members' order."""
    torch.manual_seed(0)
    grads = [torch.randn(1000) * 10 ** (3 * g) for g in range(members)]
    grads[0][0] = float("nan")
    expected = grads[0].clone()
    for g in grads[1:]:
        expected = expected + g
    parts = [g.clone() for g in grads]
    out = torch.empty(1000)
    assert _sum_into(parts, out) is out
    assert out.numpy().tobytes() == expected.numpy().tobytes()
    assert all(torch.equal(parts[k], grads[k]) for k in range(1, members))
    assert torch.equal(parts[0][1:], grads[0][1:])


def test_a_state_travels_as_raw_bytes_and_comes_back_equal() -> None:
    """pack_state / unpack_state (a restarted group's state): tensors of any dtype and
    shape come back equal, as views of the received frame (no copy); plain values too."""
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 5)).sum().backward()
    opt.step()
    tree = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "step": 17,
        "state": {"epoch": 2, "seen": (3, 4.5, None), "name": "x"},
        "odd": [torch.arange(3, dtype=torch.int16), torch.zeros(0), torch.tensor(True)],
    }
    a, b = _pair()
    thread = threading.Thread(target=lambda: send_frame(b, 1, STATE, pack_state(tree), _never))
    thread.start()
    kind, payload = recv_frame(a, 1, _never)
    thread.join(timeout=30)
    back = unpack_state(payload, torch.device("cpu"))

    def same(x: object, y: object) -> None:
        assert type(x) is type(y), (x, y)
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor)
            assert (x.dtype, x.shape) == (y.dtype, y.shape)
            assert torch.equal(x, y)
        elif isinstance(x, dict):
            assert isinstance(y, dict)
            assert x.keys() == y.keys()
            for k in x:
                same(x[k], y[k])
        elif isinstance(x, list | tuple):
            assert isinstance(y, list | tuple)
            assert len(x) == len(y)
            for u, v in zip(x, y, strict=True):
                same(u, v)
        else:
            assert x == y

    assert kind == STATE
    same(tree, back)
    assert back["model"]._metadata == tree["model"]._metadata  # type: ignore[attr-defined]
    weight = back["model"]["0.weight"]
    start = torch.frombuffer(payload, dtype=torch.uint8).data_ptr()
    assert start <= weight.data_ptr() < start + len(payload)  # a view of the frame


def test_a_malformed_state_is_a_lost_peer() -> None:
    frame = bytearray(pack_state({"w": torch.ones(2)})[0]) + bytearray(b"junk" * 4)
    with pytest.raises(PeerLost, match="malformed state"):
        unpack_state(frame, torch.device("cpu"))


# -- the links' handshake (issue 58: only the job's processes take part) --------------------


def _linked(a: PeerLinks, b: PeerLinks, quorum: int = 1) -> tuple[socket.socket, socket.socket]:
    """Group b (the larger id) links to group a: both ends' sockets."""
    got: list[socket.socket] = []
    thread = threading.Thread(
        target=lambda: got.append(
            b.link(a.group, "inc-a", list(a.address), "inc-b", quorum, _never)
        )
    )
    thread.start()
    mine = a.link(b.group, "inc-b", list(b.address), "inc-a", quorum, _never)
    thread.join(timeout=30)
    return mine, got[0]


def test_linked_groups_prove_the_job_key_and_then_exchange() -> None:
    key = JobKey.new()
    a, b = PeerLinks(0, key, 2), PeerLinks(1, key, 2)
    try:
        sa, sb = _linked(a, b)
        got: dict[int, bytearray | memoryview] = {}
        thread = threading.Thread(
            target=lambda: got.update(exchange({0: sb}, 1, GRAD, b"bbbb", _never))
        )
        thread.start()
        assert exchange({1: sa}, 1, GRAD, b"aaaa", _never) == {1: bytearray(b"bbbb")}
        thread.join(timeout=30)
        assert got == {0: bytearray(b"aaaa")}
    finally:
        a.close()
        b.close()


def _hello_frame(challenge: bytes, key: JobKey, **fields: object) -> bytes:
    mine = new_nonce()
    body = {"group": 1, "incarnation": "inc-b", "nonce": mine.hex(),
            "proof": key.prove("client", challenge, mine).hex(), **fields}  # fmt: skip
    data = json.dumps(body).encode()
    return FRAME.pack(b"MPXF", 1, HELLO, len(data)) + data


@pytest.mark.parametrize(
    "attack",
    [
        "huge length",
        "not a hello",
        "list body",
        "not json",
        "no proof",
        "another key",
        "group 9",
        "group str",
        "replayed proof",
    ],
)
def test_a_link_that_does_not_prove_the_job_is_refused_and_the_next_one_works(
    attack: str,
) -> None:
    """Issue 58: one frame announcing 2**62 bytes, a non-int group or a non-dict body
    killed the accepting thread (a later rejoin never connected); a stranger without the
    job's secret was linked. Now each is closed alone, logged, and a real link follows."""
    key = JobKey.new()
    events: list[str] = []
    a = PeerLinks(0, key, 2, log=events.append)
    b = PeerLinks(1, key, 2)
    try:
        with socket.create_connection(a.address, timeout=10) as conn:
            header = conn.recv(FRAME.size, socket.MSG_WAITALL)
            assert FRAME.unpack(header)[2] == CHALLENGE
            challenge = conn.recv(NONCE_BYTES, socket.MSG_WAITALL)
            frames = {
                "huge length": FRAME.pack(b"MPXF", 1, HELLO, 2**62),
                "not a hello": FRAME.pack(b"MPXF", 1, GRAD, 4) + b"grad",
                "list body": FRAME.pack(b"MPXF", 1, HELLO, 6) + b"[1, 2]",
                "not json": FRAME.pack(b"MPXF", 1, HELLO, 4) + b"{{{{",
                "no proof": _hello_frame(challenge, key, proof="00" * 32),
                "another key": _hello_frame(challenge, JobKey.new()),
                "group 9": _hello_frame(challenge, key, group=9),
                "group str": _hello_frame(challenge, key, group="1"),
                "replayed proof": _hello_frame(new_nonce(), key),
            }
            conn.sendall(frames[attack])
            assert _closed_unanswered(conn)
        sa, sb = _linked(a, b)  # the accepting thread lives on
        assert sa.fileno() >= 0
        assert sb.fileno() >= 0
    finally:
        a.close()
        b.close()
    assert len(events) == 1, events
    assert "refused a link" in events[0], events


def test_silent_strangers_do_not_delay_a_link() -> None:
    """Three connections that never say hello (each held up to the 5 s handshake timeout)
    made before a real link: the handshakes run side by side, so the link is made at
    once instead of after the strangers' 15 s in turn."""
    key = JobKey.new()
    a, b = PeerLinks(0, key, 2, log=lambda _: None), PeerLinks(1, key, 2)
    strangers = [socket.create_connection(a.address, timeout=10) for _ in range(3)]
    try:
        began = time.monotonic()
        sa, sb = _linked(a, b)
        took = time.monotonic() - began
        assert sa.fileno() >= 0
        assert sb.fileno() >= 0
        assert took < 10.0, f"the link waited {took:.1f} s behind the silent connections"
    finally:
        for conn in strangers:
            conn.close()
        a.close()
        b.close()


def _closed_unanswered(conn: socket.socket) -> bool:
    """The peer closed ``conn`` without a byte more (a reset: it left data unread)."""
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_connector_refuses_an_acceptor_without_the_job_key() -> None:
    impostor = PeerLinks(0, JobKey.new(), 2, log=lambda _: None)
    b = PeerLinks(1, JobKey.new(), 2)
    try:
        with pytest.raises(PeerLost, match=r"did not prove the job's secret|closed its link"):
            b.link(0, "inc-a", list(impostor.address), "inc-b", 1, _never)
    finally:
        impostor.close()
        b.close()


def test_a_frame_longer_than_expected_is_refused_before_allocation() -> None:
    a, b = _pair()
    b.send(FRAME.pack(b"MPXF", 1, STATE, 2**62))
    with pytest.raises(PeerLost, match=r"announced 4611686018427387904 bytes \(at most 1024"):
        recv_frame(a, 1, _never, limit=1024)
    a, b = _pair()
    b.send(FRAME.pack(b"MPXF", 1, GRAD, 2**62))
    with pytest.raises(PeerLost, match="sent a frame of 4611686018427387904 bytes, not 8"):
        exchange({1: a}, 1, GRAD, b"x" * 8, _never, {1: memoryview(bytearray(8))})
