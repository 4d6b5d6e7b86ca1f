"""Live recovery's wire: TCP links between replica groups and the frames they carry.

MPI cannot outlive a peer's death, so replica groups talk over plain TCP
(:class:`PeerLinks`): rank ``r`` of every group links to rank ``r`` of the
others (a *column*). Every wait is a ``select`` of 50 ms slices between which
``check()`` runs: it raises :class:`PeerLost` when the lighthouse's heartbeat
replies (:class:`~mpx.dataparallel.recovery.lighthouse_client.LighthouseClient`)
say the peer's group is dead or the step's quorum was aborted. A killed peer's
socket closes at once (EOF), so a death is seen in milliseconds; a hung one when
the lighthouse stops counting it.

Frames: a 24-byte header (magic, quorum id, kind, payload length), then the
payload. A link is made by the group with the larger id to the smaller one,
with the job's challenge-response (:mod:`mpx.launch.handshake`) in three frames::

    acceptor  -> connector   CHALLENGE  nonce_a
    connector -> acceptor    HELLO      {"group", "incarnation", "nonce", "proof"}
    acceptor  -> connector   WELCOME    the acceptor's proof

A connection whose hello is not a bounded JSON object of a group in ``0..R-1``
with the job's proof is closed and nothing else happens: the accepting thread
goes on. Links are dropped whenever a step fails, so a frame half-read in a
failed step never confuses the next. A frame's length is checked before its
payload is allocated: never more than the receiver expects.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import struct
import sys
import threading
from collections.abc import Callable
from typing import Any

from mpx.dataparallel.errors import DataParallelError
from mpx.launch import NONCE_BYTES, PROOF_BYTES, JobKey, from_hex, new_nonce

__all__ = [
    "CHALLENGE",
    "FRAME",
    "GRAD",
    "HELLO",
    "LOOP",
    "MAX_HELLO",
    "SHM",
    "STATE",
    "WELCOME",
    "PeerLinks",
    "PeerLost",
    "exchange",
    "recv_frame",
    "send_frame",
]

FRAME = struct.Struct("!4sqiQ")
_MAGIC = b"MPXF"
HELLO, GRAD, STATE, SHM = 1, 2, 3, 4  # SHM: a same-host handshake (shm.negotiate)
# The loop's state and the optimizer's settings after a step a group joined (see optimizer).
LOOP = 5
CHALLENGE, WELCOME = 5, 6  # the link's challenge-response (see the module docstring)
MAX_HELLO = 1024  # bytes: a hello's longest payload (~200 are used)
_ACCEPT_TIMEOUT_S = 5.0  # for a connection's handshake, in a thread of its own
# Handshakes under way at once: a connection beyond them is closed at once (a flood of
# silent strangers costs threads, not the links of the job's own groups).
_MAX_HANDSHAKES = 16
_SLICE_S = 0.05
_SMALL = 4096  # bytes: a frame's payload up to this goes in one send with its header


class PeerLost(DataParallelError):
    """A peer group died, hung or left during a step: the step is discarded."""


def _wait(sock: socket.socket, write: bool, check: Callable[[], None]) -> None:
    while True:
        ready = (
            select.select([], [sock], [], _SLICE_S)
            if write
            else select.select([sock], [], [], _SLICE_S)
        )
        if ready[1 if write else 0]:
            return
        check()


def send_frame(
    sock: socket.socket,
    quorum: int,
    kind: int,
    payload: bytes | memoryview | list[memoryview],
    check: Callable[[], None],
) -> None:
    """Sends one frame (its payload: one buffer, or a list sent one after another);
    raises :class:`PeerLost` if the peer is gone."""
    views = [memoryview(p).cast("B") for p in (payload if isinstance(payload, list) else [payload])]
    size = sum(len(view) for view in views)
    for whole in (memoryview(FRAME.pack(_MAGIC, quorum, kind, size)), *views):
        part = whole
        while part:
            _wait(sock, True, check)
            try:
                sent = sock.send(part)
            except BlockingIOError:
                continue
            except OSError as exc:
                raise PeerLost(f"a peer's link broke while sending: {exc}") from exc
            part = part[sent:]


def _recv_exact(sock: socket.socket, into: memoryview, check: Callable[[], None]) -> None:
    while len(into):
        _wait(sock, False, check)
        try:
            got = sock.recv_into(into)
        except BlockingIOError:
            continue
        except OSError as exc:
            raise PeerLost(f"a peer's link broke while receiving: {exc}") from exc
        if got == 0:
            raise PeerLost("a peer closed its link (its process ended or was killed)")
        into = into[got:]


def recv_frame(
    sock: socket.socket,
    quorum: int,
    check: Callable[[], None],
    into: bytearray | memoryview | None = None,
    limit: int = 1 << 40,
) -> tuple[int, bytearray | memoryview]:
    """Receives the next frame of quorum ``quorum`` (older ones are skipped): (kind, payload).

    A frame announcing more than ``limit`` bytes raises :class:`PeerLost` before
    anything is allocated."""
    while True:
        header = bytearray(FRAME.size)
        _recv_exact(sock, memoryview(header), check)
        magic, tag, kind, length = FRAME.unpack(header)
        if magic != _MAGIC:
            raise PeerLost("a peer's link carried a malformed frame")
        if not 0 <= length <= limit:
            raise PeerLost(f"a peer's frame announced {length} bytes (at most {limit} expected)")
        payload = into if into is not None and len(into) == length else bytearray(length)
        _recv_exact(sock, memoryview(payload), check)
        if tag >= quorum:
            return kind, payload


def _recv_blocking(sock: socket.socket, size: int) -> bytes:
    """``size`` bytes from a blocking socket (its timeout bounds the wait)."""
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise OSError("closed during the handshake")
        data += chunk
    return bytes(data)


def _to_stderr(text: str) -> None:
    with contextlib.suppress(OSError):
        print(f"mpx: live recovery: {text}", file=sys.stderr, flush=True)


class _Incoming:
    """One peer's frame being received by :func:`exchange`."""

    def __init__(self) -> None:
        self.header = bytearray(FRAME.size)
        self.view = memoryview(self.header)
        self.payload: bytearray | memoryview | None = None
        self.stale = False


def exchange(
    links: dict[int, socket.socket],
    quorum: int,
    kind: int,
    payload: bytes | memoryview | dict[int, bytes | memoryview],
    check: Callable[[], None],
    into: dict[int, memoryview] | None = None,
    limit: int = 1 << 40,
) -> dict[int, bytearray | memoryview]:
    """Sends ``payload`` (or ``payload[peer]``) to every peer of ``links`` and receives theirs.

    Returns each peer's payload: received into ``into[peer]`` (a buffer kept from
    step to step: no allocation, zero-fill or page faults), which this step's frame
    must fill exactly, else into a new bytearray of at most ``limit`` bytes. Raises
    :class:`PeerLost` when a peer is gone (its link closed, or ``check()`` said so)
    or sent a frame of another kind or length.
    """
    sending: dict[int, list[memoryview]] = {}
    for peer in links:
        data = memoryview(payload[peer] if isinstance(payload, dict) else payload).cast("B")
        header = FRAME.pack(_MAGIC, quorum, kind, len(data))
        # A small frame in one send: each send wakes the peer (on 2 loaded cores, a switch).
        small = len(data) <= _SMALL
        sending[peer] = [memoryview(header + data)] if small else [memoryview(header), data]
    receiving = {peer: _Incoming() for peer in links}
    got: dict[int, bytearray | memoryview] = {}
    buffers = into or {}
    by_socket = {sock: peer for peer, sock in links.items()}
    while sending or receiving:
        try:
            readable, writable, _ = select.select(
                [links[p] for p in receiving], [links[p] for p in sending], [], _SLICE_S
            )
        except (OSError, ValueError) as exc:
            raise PeerLost(f"a peer's link broke: {exc}") from exc
        if not readable and not writable:
            check()
            continue
        for sock in writable:
            peer = by_socket[sock]
            parts = sending[peer]
            try:
                sent = sock.send(parts[0])
            except BlockingIOError:
                continue
            except OSError as exc:
                raise PeerLost(f"group {peer}'s link broke while sending: {exc}") from exc
            parts[0] = parts[0][sent:]
            while parts and not parts[0]:
                parts.pop(0)
            if not parts:
                del sending[peer]
        for sock in readable:
            peer = by_socket[sock]
            state = receiving[peer]
            try:
                count = sock.recv_into(state.view)
            except BlockingIOError:
                continue
            except OSError as exc:
                raise PeerLost(f"group {peer}'s link broke while receiving: {exc}") from exc
            if count == 0:
                raise PeerLost(f"group {peer} closed its link (its process ended or was killed)")
            state.view = state.view[count:]
            if state.view:
                continue
            if state.payload is None:  # the header is complete
                magic, tag, their_kind, length = FRAME.unpack(state.header)
                if magic != _MAGIC or (tag >= quorum and their_kind != kind):
                    raise PeerLost(f"group {peer} sent no gradients for this step")
                state.stale = tag < quorum
                given = buffers.get(peer)
                if not 0 <= length <= limit or (
                    given is not None and not state.stale and length != given.nbytes
                ):
                    want = limit if given is None or state.stale else given.nbytes
                    raise PeerLost(f"group {peer} sent a frame of {length} bytes, not {want}")
                state.payload = (
                    given if given is not None and given.nbytes == length else bytearray(length)
                )
                state.view = memoryview(state.payload).cast("B")
                if length:
                    continue
            if state.stale:  # an older step's frame: wait for this step's
                receiving[peer] = _Incoming()
                continue
            got[peer] = state.payload
            del receiving[peer]
    return got


class PeerLinks:
    """This rank's TCP links to the same rank of the other groups.

    Args:
        group: this rank's group.
        key: the job's key (``MPX_JOB_SECRET``): every link proves it, both ways.
        groups: the number of replica groups (a hello from another group id is refused).
        host: the address to listen on.
        log: where refused connections are reported (default: stderr).
    """

    def __init__(
        self,
        group: int,
        key: JobKey,
        groups: int,
        host: str = "127.0.0.1",
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.group = group
        self._key = key
        self._groups = groups
        self._log = log if log is not None else _to_stderr
        self._server = socket.create_server((host, 0))
        self.address: tuple[str, int] = (host, self._server.getsockname()[1])
        self._links: dict[tuple[int, str], socket.socket] = {}
        self._incoming: dict[tuple[int, str], tuple[int, socket.socket]] = {}
        self._arrived = threading.Condition()
        self._closed = False
        self._epoch = 0
        self._handshakes = threading.BoundedSemaphore(_MAX_HANDSHAKES)
        self._thread = threading.Thread(target=self._accept, daemon=True, name="mpx-ft-accept")
        self._thread.start()

    def _accept(self) -> None:
        """Accepts connections; each one's handshake runs in a thread of its own, so a
        stranger that stays silent (up to its timeout) delays no other link."""
        while not self._closed:
            try:
                sock, peer = self._server.accept()
            except OSError:
                return
            if not self._handshakes.acquire(blocking=False):
                sock.close()
                self._log(
                    f"group {self.group} refused a link from {peer[0]}:{peer[1]}: "
                    f"{_MAX_HANDSHAKES} handshakes under way already"
                )
                continue
            threading.Thread(
                target=self._admit, args=(sock, peer), daemon=True, name="mpx-ft-handshake"
            ).start()

    def _admit(self, sock: socket.socket, peer: tuple[str, int]) -> None:
        """One accepted connection: linked if its handshake proves the job, else closed."""
        try:
            try:
                tag, key = self._greet(sock)
            except Exception as exc:  # whatever a stranger sends ends only its connection
                sock.close()
                if not self._closed:
                    self._log(f"group {self.group} refused a link from {peer[0]}:{peer[1]}: {exc}")
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._arrived:
                if self._closed:
                    sock.close()
                    return
                old = self._incoming.pop(key, None)
                if old is not None:
                    old[1].close()
                self._incoming[key] = (tag, sock)
                self._arrived.notify_all()
        finally:
            self._handshakes.release()

    def _greet(self, sock: socket.socket) -> tuple[int, tuple[int, str]]:
        """The acceptor's side of the handshake: (the hello's quorum tag, (group,
        incarnation)); raises on anything but a proven hello of a group in range."""
        sock.settimeout(_ACCEPT_TIMEOUT_S)
        challenge = new_nonce()
        sock.sendall(FRAME.pack(_MAGIC, 0, CHALLENGE, NONCE_BYTES) + challenge)
        magic, tag, kind, length = FRAME.unpack(_recv_blocking(sock, FRAME.size))
        if magic != _MAGIC or kind != HELLO or not 0 <= length <= MAX_HELLO:
            raise ValueError(f"not a hello (kind {kind}, {length} bytes)")
        who = json.loads(_recv_blocking(sock, length))
        if not isinstance(who, dict):
            raise ValueError("a hello that is not a JSON object")
        group, incarnation = who.get("group"), who.get("incarnation")
        theirs = from_hex(who.get("nonce"), NONCE_BYTES)
        proof = from_hex(who.get("proof"), PROOF_BYTES)
        if (
            theirs is None
            or proof is None
            or not self._key.verify("client", challenge, theirs, proof)
        ):
            raise ValueError("no proof of the job's secret (MPX_JOB_SECRET)")
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < self._groups:
            raise ValueError(f"a hello from group {group!r}, not one of 0..{self._groups - 1}")
        if not isinstance(incarnation, str) or not 0 < len(incarnation) <= 64:
            raise ValueError(f"a hello with incarnation {incarnation!r}")
        welcome = self._key.prove("server", challenge, theirs)
        sock.sendall(FRAME.pack(_MAGIC, 0, WELCOME, len(welcome)) + welcome)
        return tag, (group, incarnation)

    def link(
        self,
        peer: int,
        incarnation: str,
        address: list[Any],
        me: str,
        quorum: int,
        check: Callable[[], None],
    ) -> socket.socket:
        """The link to ``peer`` (this incarnation), made or awaited as the ids say."""
        key = (peer, incarnation)
        found = self._links.get(key)
        if found is not None:
            return found
        if peer < self.group:
            try:
                sock = socket.create_connection((str(address[0]), int(address[1])), timeout=5.0)
            except OSError as exc:
                raise PeerLost(f"group {peer} cannot be reached: {exc}") from exc
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                self._prove(sock, peer, me, quorum, check)
            except BaseException:
                sock.close()
                raise
        else:
            with self._arrived:
                while True:
                    arrived = self._incoming.get(key)
                    if arrived is not None and arrived[0] >= self._epoch:
                        del self._incoming[key]
                        sock = arrived[1]
                        break
                    self._arrived.wait(_SLICE_S)
                    check()
        self._links[key] = sock
        return sock

    def _prove(
        self, sock: socket.socket, peer: int, me: str, quorum: int, check: Callable[[], None]
    ) -> None:
        """The connector's side of the handshake; :class:`PeerLost` unless ``peer``
        proves the job's secret in turn."""
        kind, challenge = recv_frame(sock, 0, check, limit=NONCE_BYTES)
        if kind != CHALLENGE or len(challenge) != NONCE_BYTES:
            raise PeerLost(f"group {peer}'s link did not start with the job's challenge")
        mine = new_nonce()
        hello = {
            "group": self.group,
            "incarnation": me,
            "nonce": mine.hex(),
            "proof": self._key.prove("client", bytes(challenge), mine).hex(),
        }
        send_frame(sock, quorum, HELLO, json.dumps(hello).encode(), check)
        kind, proof = recv_frame(sock, 0, check, limit=PROOF_BYTES)
        if kind != WELCOME or not self._key.verify("server", bytes(challenge), mine, bytes(proof)):
            raise PeerLost(f"group {peer}'s link did not prove the job's secret")

    def drop(self, quorum: int) -> None:
        """Closes every link (after a failed step): the next step makes fresh ones."""
        for sock in self._links.values():
            with contextlib.suppress(OSError):
                sock.close()
        self._links.clear()
        with self._arrived:
            self._epoch = quorum + 1
            for tag, sock in list(self._incoming.values()):
                if tag <= quorum:
                    sock.close()
            self._incoming = {k: v for k, v in self._incoming.items() if v[0] > quorum}

    def keep(self, peers: set[tuple[int, str]]) -> None:
        """Closes the links to groups no longer members."""
        for key in [k for k in self._links if k not in peers]:
            with contextlib.suppress(OSError):
                self._links.pop(key).close()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._server.close()
        self.drop(1 << 62)
