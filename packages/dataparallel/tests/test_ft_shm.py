"""The gradient exchange's same-host path (recovery.shm): segments, the handshake, and end to end
the same bytes as over TCP."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from mpx.dataparallel.errors import DataParallelError
from mpx.dataparallel.recovery.links import GRAD, PeerLost, exchange
from mpx.dataparallel.recovery.shm import PeerSegment, Segment, negotiate

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs memfd (Linux)")


def _never() -> None:
    return None


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    return a, b


def test_a_peer_maps_the_segment_and_sees_its_writes() -> None:
    mine = Segment(1000, torch.float32, shared=True)
    assert mine.shared
    where = mine.describe()
    assert where is not None
    peer = PeerSegment(where, 1000, torch.float32)
    mine.buffers[1].copy_(torch.arange(1000.0))
    mine.stamp(1, 7)
    mine.stamp(0, 6)
    assert torch.equal(peer.holding(7), torch.arange(1000.0))
    assert peer.holding(6).data_ptr() == peer.buffers[0].data_ptr()
    # A quorum neither buffer holds: an error naming the quorums it has, never a guess.
    with pytest.raises(DataParallelError, match=r"quorum 8 are missing .*\[6, 7\]"):
        peer.holding(8)
    peer.close()
    mine.close()


def test_a_segment_of_another_process_or_size_is_refused() -> None:
    mine = Segment(1000, torch.float32, shared=True)
    where = mine.describe()
    assert where is not None
    with pytest.raises(ValueError, match="token differs"):
        PeerSegment({**where, "token": "00" * 16}, 1000, torch.float32)
    with pytest.raises(ValueError, match="a segment of 1000 gradients, not 5000"):
        PeerSegment(where, 5000, torch.float32)
    with pytest.raises(ValueError, match="smaller"):
        PeerSegment({**where, "numel": 5000}, 5000, torch.float32)
    mine.close()


def test_an_unshared_segment_is_private_memory() -> None:
    mine = Segment(10, torch.float64, shared=False)
    assert not mine.shared
    assert mine.describe() is None
    assert [b.dtype for b in mine.buffers] == [torch.float64] * 2


def _negotiate_both(
    a_shared: bool, b_shared: bool
) -> tuple[dict[int, PeerSegment | None], dict[int, PeerSegment | None]]:
    a, b = _pair()
    seg_a = Segment(100, torch.float32, shared=a_shared)
    seg_b = Segment(100, torch.float32, shared=b_shared)
    got: dict[int, PeerSegment | None] = {}

    def other() -> None:
        got.update(negotiate({0: b}, 1, 3, seg_b, _never))

    thread = threading.Thread(target=other)
    thread.start()
    mine = negotiate({1: a}, 0, 3, seg_a, _never)
    thread.join(timeout=30)
    return mine, got


def test_negotiate_maps_both_ways_when_both_offer() -> None:
    mine, theirs = _negotiate_both(True, True)
    assert isinstance(mine[1], PeerSegment)
    assert isinstance(theirs[0], PeerSegment)


@pytest.mark.parametrize(("a_shared", "b_shared"), [(True, False), (False, True), (False, False)])
def test_negotiate_falls_back_to_tcp_for_both_unless_both_map(
    a_shared: bool, b_shared: bool
) -> None:
    """One end that cannot map (MPX_FT_SHM=0, another host): both send over TCP."""
    mine, theirs = _negotiate_both(a_shared, b_shared)
    assert mine == {1: None}
    assert theirs == {0: None}


def test_negotiate_raises_when_the_peer_is_gone() -> None:
    a, b = _pair()
    b.close()
    with pytest.raises(PeerLost, match="group 1"):
        negotiate({1: a}, 0, 3, Segment(10, torch.float32, shared=True), _never)


def test_exchange_sends_each_peer_its_own_payload() -> None:
    a, b = _pair()
    c, d = _pair()
    got: dict[int, dict[int, Any]] = {}

    def peer(me: int, sock: socket.socket) -> None:
        got[me] = exchange({0: sock}, 2, GRAD, f"from {me}".encode(), _never)

    threads = [threading.Thread(target=peer, args=(g, s)) for g, s in ((1, b), (2, d))]
    for thread in threads:
        thread.start()
    mine = exchange({1: a, 2: c}, 2, GRAD, {1: b"to 1", 2: b"x" * 100_000}, _never)
    for thread in threads:
        thread.join(timeout=30)
    assert mine == {1: bytearray(b"from 1"), 2: bytearray(b"from 2")}
    assert got[1] == {0: bytearray(b"to 1")}
    assert got[2] == {0: bytearray(b"x" * 100_000)}


PROGRAM = textwrap.dedent(
    """
    import os, sys
    import torch
    from torch import nn
    import mpx.dataparallel as dp

    group = int(os.environ["MPX_REPLICA_GROUP"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(30, 200), nn.Tanh(), nn.Linear(200, 3))
    ft = dp.FaultTolerantOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    while ft.step_count < 6:
        ft.zero_grad(set_to_none=ft.step_count % 2 == 0)  # both ways of holding .grad
        gen = torch.Generator().manual_seed(100 * ft.step_count + group)
        x = torch.randn(8, 30, generator=gen) * 10 ** group  # sums that round
        model(x).pow(2).mean().backward()
        assert ft.step(), "no group dies here"
    shared = any(reader is not None for _, reader in ft._grads.shared.values())
    print(f"group {group} shared memory: {shared}", flush=True)
    torch.save(model.state_dict(), f"{sys.argv[1]}/g{group}.pt")
    """
)


def _job(out: Path, shm: str) -> str:
    out.mkdir()
    script = out / "job.py"
    script.write_text(PROGRAM)
    mpxrun = Path(sys.executable).parent / "mpxrun"
    done = subprocess.run(
        [
            str(mpxrun),
            "--replica-groups",
            "3",
            "--timeout",
            "200",
            "--",
            sys.executable,
            str(script),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env={**os.environ, "MPX_FT_SHM": shm, "MPX_FT_HEARTBEAT_TIMEOUT": "20"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_shared_memory_gives_the_same_bytes_as_tcp(tmp_path: Path) -> None:
    """Three groups on this host, six steps, once through shared memory and once over
    TCP (MPX_FT_SHM=0): every group's final weights are the same bytes both ways."""
    said = _job(tmp_path / "shm", "1")
    assert all(f"group {g} shared memory: True" in said for g in range(3)), said
    said = _job(tmp_path / "tcp", "0")
    assert all(f"group {g} shared memory: False" in said for g in range(3)), said
    first = torch.load(tmp_path / "tcp" / "g0.pt", weights_only=True)
    for way in ("shm", "tcp"):
        for g in range(3):
            final = torch.load(tmp_path / way / f"g{g}.pt", weights_only=True)
            for name, value in first.items():
                assert final[name].numpy().tobytes() == value.numpy().tobytes(), (way, g, name)
