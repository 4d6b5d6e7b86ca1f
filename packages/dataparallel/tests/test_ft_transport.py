"""The fault-tolerant layer's wire in one process, and FaultTolerantOptimizer's argument checks."""

from __future__ import annotations

import socket
import threading

import pytest
import torch
from torch import nn

from mpx.dataparallel import DataParallelTypeError, DataParallelValueError, FaultTolerantOptimizer
from mpx.dataparallel.recovery.links import (
    GRAD,
    STATE,
    PeerLost,
    exchange,
    recv_frame,
    send_frame,
)
from mpx.dataparallel.recovery.optimizer import _sum_into
from mpx.dataparallel.recovery.state_payload import pack_state, unpack_state


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
    # A frame of another length than the buffer's gets a buffer of its own.
    send_frame(b, 3, GRAD, b"four", _never)
    assert exchange({1: a}, 3, GRAD, b"mine", _never, {1: inbox.numpy().data.cast("B")}) == {
        1: bytearray(b"four")
    }


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
