"""Live recovery's client of the lighthouse: hello, heartbeats, and rank 0's requests.

The lighthouse (:mod:`mpx.launch.recovery.lighthouse`, started by ``mpxrun
--replica-groups``) decides each step's membership. Every rank keeps one
connection to it for heartbeats, whose replies say which groups are alive and
which quorum was aborted last (what :class:`~mpx.dataparallel.recovery.links.PeerLinks`'
``check()`` reads between its waits); rank 0 of a group keeps a second one for
the requests that wait (quorum, vote, leave). Messages are JSON lines; each
connection starts with the job's challenge-response (:mod:`mpx.launch.handshake`):
the lighthouse's challenge, this rank's proof in its hello, the lighthouse's proof
in the reply, checked before anything the lighthouse says is believed. The hello
also describes what this rank averages (:func:`describe_gradients`): the lighthouse
refuses a rank whose description differs from the same rank's in another group
(they could never average together), and this rank then raises, saying why.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import threading
import time
from typing import Any

from mpx.dataparallel.errors import DataParallelError, DataParallelMismatchError
from mpx.dataparallel.recovery.links import PeerLost
from mpx.launch import NONCE_BYTES, PROOF_BYTES, JobKey, from_hex, new_nonce

__all__ = ["LighthouseClient", "describe_gradients"]

# How long rank 0 polls for the lighthouse's answer to a vote or quorum request before
# it sleeps in recv (see _spin_until_readable): longer than the wait for a group a
# step behind on the benchmark's model (~3 ms), short enough not to hold a core long.
_REQUEST_SPIN_S = 0.005


def describe_gradients(numel: int, dtype: object, compression: Any) -> dict[str, Any]:
    """What a rank averages across the groups, as its hello tells the lighthouse: its
    trainable elements' number, their dtype, and the compression between groups (None,
    or an ``mpx.quantize.CompressionConfig``'s fields that change the bytes sent)."""
    described: dict[str, Any] | None = None
    if compression is not None:
        described = {
            "bits": int(compression.bits),
            "bucket_size": int(compression.bucket_size),
            "stochastic": bool(compression.stochastic),
        }
    return {"numel": int(numel), "dtype": str(dtype), "compression": described}


class LighthouseClient:
    """This rank's connections to the lighthouse: hello, heartbeats, and (rank 0) requests.

    Args:
        address: ``host:port`` (``MPX_LIGHTHOUSE``).
        group, rank, size: this process's group, its rank in the group, the group's size.
        incarnation: unique to this process's start.
        peer_address: where this rank's :class:`PeerLinks` listens.
        key: the job's key (``MPX_JOB_SECRET``), proven on every connection.
        gradients: what this rank averages (:func:`describe_gradients`).
        timeout: seconds to wait for the lighthouse to answer a hello.

    Raises:
        DataParallelError: the lighthouse did not prove the job's secret (not this
            job's ``mpxrun``).
        DataParallelMismatchError: it refused this rank: its gradients differ from
            the same rank's in another group (the message names both).
        PeerLost: it closed the connection (gone, or it refused this rank's proof).
    """

    def __init__(
        self,
        address: str,
        group: int,
        rank: int,
        size: int,
        incarnation: str,
        peer_address: tuple[str, int],
        key: JobKey,
        gradients: dict[str, Any],
        timeout: float = 30.0,
    ) -> None:
        host, _, port = address.rpartition(":")
        self._where = (host, int(port))
        self._hello = {
            "op": "hello",
            "group": group,
            "rank": rank,
            "size": size,
            "incarnation": incarnation,
            "address": list(peer_address),
            "gradients": gradients,
        }
        self._timeout = timeout
        self._key = key
        self._beat_sock, self._beat_file, reply = self._connect()
        self.interval = float(reply["heartbeat_interval"])
        self._request: tuple[socket.socket, Any] | None = None
        self.alive: dict[int, str] = {}
        self.member = True
        self.last_aborted = 0
        self.lost_at: float | None = None
        self._stop = threading.Event()
        self._beat_once()
        self._thread = threading.Thread(target=self._beat_loop, daemon=True, name="mpx-ft-beat")
        self._thread.start()

    def _connect(self) -> tuple[socket.socket, Any, dict[str, Any]]:
        """A connection that said hello, both ends proven: (socket, file, hello's reply)."""
        sock = socket.create_connection(self._where, timeout=self._timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        file = sock.makefile("rwb")
        host, port = self._where
        try:
            challenge = _nonce(json.loads(file.readline(4096) or b"{}").get("challenge"))
            mine = new_nonce()
            proof = self._key.prove("client", challenge, mine).hex()
            reply = self._ask(sock, file, {**self._hello, "nonce": mine.hex(), "proof": proof})
        except PeerLost as exc:
            sock.close()
            raise PeerLost(
                f"the lighthouse at {host}:{port} closed the connection at hello: gone, or it "
                "refused this rank's proof (MPX_JOB_SECRET is not its job's)"
            ) from exc
        except (ValueError, AttributeError) as exc:
            sock.close()
            raise DataParallelError(
                f"the lighthouse at {host}:{port} did not start the job's handshake: "
                "MPX_LIGHTHOUSE does not point at this job's mpxrun"
            ) from exc
        their_proof = from_hex(reply.get("proof"), PROOF_BYTES)
        if not self._key.verify("server", challenge, mine, their_proof):
            sock.close()
            raise DataParallelError(
                f"the lighthouse at {host}:{port} did not prove the job's secret: it is not "
                "this job's mpxrun (MPX_LIGHTHOUSE, MPX_JOB_SECRET)"
            )
        if "error" in reply:  # refused (proven: the lighthouse's own words)
            sock.close()
            raise DataParallelMismatchError(
                f"FaultTolerantOptimizer: the lighthouse refused group {self._hello['group']} "
                f"rank {self._hello['rank']}: {reply['error']}"
            )
        sock.settimeout(None)
        return sock, file, reply

    @staticmethod
    def _ask(
        sock: socket.socket, file: Any, message: dict[str, Any], spin_s: float = 0.0
    ) -> dict[str, Any]:
        file.write(json.dumps(message).encode() + b"\n")
        file.flush()
        if spin_s:
            _spin_until_readable(sock, spin_s)
        line = file.readline()
        if not line:
            raise PeerLost("the lighthouse closed its connection (mpxrun gone?)")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def _beat_once(self) -> None:
        reply = self._ask(self._beat_sock, self._beat_file, {"op": "beat"})
        self.alive = {int(g): i for g, i in reply["alive"].items()}
        self.member = bool(reply["member"])
        self.last_aborted = int(reply["last_aborted"])

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat_once()
            except (OSError, ValueError, PeerLost):
                self.lost_at = time.monotonic()
                return

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        """A request that waits (``quorum``, ``vote``, ``leave``) on rank 0's second connection."""
        if self._request is None:
            sock, file, _ = self._connect()
            self._request = (sock, file)
        return self._ask(*self._request, message, _REQUEST_SPIN_S)

    def close(self) -> None:
        self._stop.set()
        for sock in (self._beat_sock, self._request[0] if self._request else None):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()


def _nonce(value: object) -> bytes:
    """The lighthouse's challenge, as bytes; ValueError unless it is one."""
    nonce = from_hex(value, NONCE_BYTES)
    if nonce is None:
        raise ValueError(f"not a challenge: {value!r}")
    return nonce


def _spin_until_readable(sock: socket.socket, seconds: float) -> None:
    """Polls ``sock`` (yielding the core between polls) for up to ``seconds``.

    A step's vote waits for the slowest group, then for the lighthouse's reply:
    asleep in ``recv``, the reply took another ~0.07 ms to wake this process
    (session 18, this 2-core VM: a vote's round trip 0.21 -> 0.15 ms polled), which
    MPI's own waits, spinning, do not pay. ``sched_yield`` gives the core to
    whatever else is ready on it (the lighthouse, on an oversubscribed host).
    """
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        if select.select([sock], [], [], 0)[0]:
            return
        os.sched_yield()
