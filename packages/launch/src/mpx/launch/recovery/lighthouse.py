"""The lighthouse: a small TCP server in ``mpxrun`` that keeps the replica groups' membership.

``mpxrun --replica-groups R`` runs one in a thread and tells every rank its
address (``MPX_LIGHTHOUSE``). The rules it keeps are :mod:`mpx.launch.recovery.membership`'s;
this module is the wire: one JSON object a line each way, one request at a
time per connection. Each rank of each group holds a connection on which it
says ``hello`` and then beats (a heartbeat thread); its group's rank 0 holds a
second one for the requests that wait (``quorum``, ``vote``). A connection
that closes without ``leave`` kills its group at once: a SIGKILLed process's
sockets are closed by its kernel, so a death is seen in milliseconds. A group
that stops beating is counted out after its deadline (``heartbeat_timeout``
stretched by its own recent beats and steps: a loaded machine does not count a
live group out) and comes back if it beats again; silent for ``hang_timeout``
it is hung, and ``mpxrun`` stops and restarts it (:meth:`Lighthouse.hung`).

Every connection starts with the job's challenge-response
(:mod:`mpx.launch.handshake`): the lighthouse sends ``{"challenge": nonce_s}``, the
member's ``hello`` carries its nonce and proof, the reply the lighthouse's proof. A
connection that cannot prove the job's secret, sends a line of more than
:data:`MAX_LINE` bytes or anything but a JSON object, or names a group outside
``0..R-1``, is closed and logged (``mpxrun: lighthouse: refused ...``); nothing it
said is acted on, and every other connection goes on.

Each hello also says what that rank averages across the groups (``gradients``: its
trainable elements' number, their dtype, the compression between groups): rank
``r`` of every group must agree with rank ``r`` of the others, or their exchange
could never succeed (frames of another length are refused as a lost peer: every
step discarded, for ever). The first description of rank ``r`` is kept; a hello
that differs is answered ``{"error": ...}`` naming both and the fix, logged, and
closed; :meth:`Lighthouse.misconfigured` then tells ``mpxrun`` to restart no group
(:mod:`~mpx.launch.recovery.gradients_description`).

Requests and replies::

    {"op": "hello", "group": g, "rank": r, "size": n, "incarnation": id,
     "address": [host, port], "gradients": {"numel": n, "dtype": "torch.float32",
     "compression": null or {"bits": b, "bucket_size": k, "stochastic": bool}},
     "nonce": hex, "proof": hex}
                                              -> {"ok": true, "heartbeat_interval": s,
                                                  "proof": hex}
                                                 or {"error": why, "proof": hex} (its
                                                 gradients differ from another group's
                                                 same rank: not a member; closed)
    {"op": "beat"}                            -> {"member": bool, "alive": {g: id},
                                                  "last_aborted": quorum}
    {"op": "quorum", "step": s}               -> {"quorum": {...Quorum.view...}}
                                                 or {"member": false} (dead or
                                                 replaced: a counted-out group's
                                                 request waits until it is back)
                                                 or {"finished": step} (the others
                                                 ended training and left)
                                                 or {"lost": step} (no group holds
                                                 the state of that step, and none
                                                 resumed from a checkpoint)
    {"op": "vote", "quorum": q, "ok": bool}   -> {"outcome": bool}
    {"op": "vote", "quorum": q, "ok": bool, "next": s}
                                              -> {"outcome": bool, and the reply of a
                                                  "quorum" request at step s, + 1 if
                                                  the step committed}
    {"op": "leave", "step": s}                -> {"ok": true}

Nothing here imports torch: the lighthouse runs in ``mpxrun``.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from mpx.launch.handshake import NONCE_BYTES, PROOF_BYTES, JobKey, from_hex, new_nonce
from mpx.launch.recovery.gradients_description import checked_gradients, described
from mpx.launch.recovery.membership import Membership

__all__ = ["MAX_LINE", "Lighthouse", "Refused", "print_event"]

#: bytes: the longest line a connection may send (a member's longest is ~300)
MAX_LINE = 64 * 1024
_MAX_SIZE = 1 << 20  # ranks in one group
_HELLO_TIMEOUT_S = 10.0  # for a new connection's challenge-response (then no limit)

# How often a member beats, as a fraction of the timeout: several beats are
# missed before a group is declared dead, so one slow beat is no death.
BEATS_PER_TIMEOUT = 5
MAX_BEAT_INTERVAL_S = 0.1


class Refused(Exception):
    """A connection that did not prove the job's secret or sent what no member sends."""


def _integer(message: dict[str, Any], name: str, low: int, high: int) -> int:
    value = message.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < high:
        raise Refused(f"hello with {name}={value!r}, not an integer in [{low}, {high})")
    return value


def _identity(hello: dict[str, Any], expected: int) -> tuple[tuple[int, int, str], int, list[Any]]:
    """A proven hello's ``(group, rank, incarnation)``, group size and address, checked."""
    group = _integer(hello, "group", 0, expected)
    size = _integer(hello, "size", 1, _MAX_SIZE + 1)
    rank = _integer(hello, "rank", 0, size)
    incarnation, address = hello.get("incarnation"), hello.get("address")
    if not isinstance(incarnation, str) or not re.fullmatch(r"[0-9A-Za-z_.-]{1,64}", incarnation):
        raise Refused(f"hello with incarnation={incarnation!r}")
    if (
        not isinstance(address, list)
        or len(address) != 2
        or not isinstance(address[0], str)
        or len(address[0]) > 255
        or isinstance(address[1], bool)
        or not isinstance(address[1], int)
        or not 0 < address[1] < 65536
    ):
        raise Refused(f"hello with address={address!r}, not [host, port]")
    return (group, rank, incarnation), size, address


class _Handler(socketserver.StreamRequestHandler):
    server: _Server

    def _send(self, reply: dict[str, Any]) -> None:
        self.wfile.write(json.dumps(reply).encode() + b"\n")
        self.wfile.flush()

    def _read(self) -> dict[str, Any] | None:
        """The next request (None: the connection closed)."""
        raw = self.rfile.readline(MAX_LINE + 1)
        if not raw:
            return None
        if len(raw) > MAX_LINE:
            raise Refused(f"a line of more than {MAX_LINE} bytes")
        try:
            message = json.loads(raw)
        except ValueError as exc:
            raise Refused("a line that is not JSON") from exc
        if not isinstance(message, dict):
            raise Refused("a line that is not a JSON object")
        return message

    def _greet(
        self,
    ) -> tuple[tuple[int, int, str], int, list[Any], dict[str, Any], dict[str, Any]]:
        """The challenge-response and the hello: the member's identity, group size,
        address, gradients' description and the reply's proof; :class:`Refused` unless
        the proof holds and the hello is well formed."""
        key = self.server.lighthouse.key
        challenge = new_nonce()
        self.request.settimeout(_HELLO_TIMEOUT_S)  # a silent stranger holds no thread long
        self._send({"challenge": challenge.hex()})
        try:
            hello = self._read()
        except TimeoutError as exc:
            raise Refused(f"no hello within {_HELLO_TIMEOUT_S:g} s") from exc
        self.request.settimeout(None)
        if hello is None:
            raise Refused("closed before its hello")
        theirs = from_hex(hello.get("nonce"), NONCE_BYTES)
        proof = from_hex(hello.get("proof"), PROOF_BYTES)
        if hello.get("op") != "hello":
            raise Refused(f"{hello.get('op')!r} before hello")
        if theirs is None or proof is None or not key.verify("client", challenge, theirs, proof):
            raise Refused("no proof of the job's secret (MPX_JOB_SECRET)")
        identity, size, address = _identity(hello, self.server.lighthouse.expected)
        try:
            gradients = checked_gradients(hello.get("gradients"))
        except ValueError as exc:
            raise Refused(f"hello with {exc}") from exc
        answer = {"proof": key.prove("server", challenge, theirs).hex()}
        return identity, size, address, gradients, answer

    def handle(self) -> None:
        lighthouse = self.server.lighthouse
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        identity: tuple[int, int, str] | None = None
        left = False
        try:
            proven, size, address, gradients, proof = self._greet()
            differs = lighthouse.compare(proven, gradients)
            if differs is not None:
                # Answered (proven, so the rank believes it) rather than closed: the
                # rank raises with the reason. Never a member: logged as refused.
                self._send({"error": differs, **proof})
                raise Refused(differs)
            identity = proven
            self._send({**lighthouse.hello(identity, size, address), **proof})
            while (message := self._read()) is not None:
                op = message.get("op")
                if op == "beat":
                    reply = lighthouse.beat(identity)
                elif op == "quorum":
                    reply = lighthouse.quorum(identity, int(message["step"]))
                elif op == "vote":
                    then = message.get("next")
                    reply = lighthouse.vote(
                        identity,
                        int(message["quorum"]),
                        bool(message["ok"]),
                        None if then is None else int(then),
                    )
                elif op == "leave":
                    left = True
                    reply = lighthouse.leave(identity, int(message["step"]))
                else:
                    reply = {"error": f"unknown op {op!r}"}
                self._send(reply)
        except Refused as why:
            if identity is None:  # never a member: logged, and nothing else happens
                lighthouse.refused(self.client_address, str(why))
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a member gone (or broken) mid-message is a member gone
        finally:
            if identity is not None and not left:
                lighthouse.lost(identity)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    lighthouse: Lighthouse


class Lighthouse:
    """The membership server; ``with Lighthouse(expected=R) as lh: lh.address``.

    Args:
        expected: the number of replica groups the first quorum waits for (the
            groups are 0 to ``expected - 1``).
        heartbeat_timeout: seconds a rank may stay silent before its group is counted
            out, at least (the group's own recent timing stretches it: see
            :mod:`~mpx.launch.recovery.membership`).
        join_timeout: how long the first quorum waits for ``expected`` groups.
        hang_timeout: seconds a counted-out group may stay silent before it is hung
            (default: :class:`~mpx.launch.recovery.membership.Membership`'s).
        host: the address to listen on (port chosen by the system; ``"0.0.0.0"``:
            every interface, for groups on other hosts: every connection proves the
            job's secret).
        log: where membership events are written (None: nowhere).
        key: the job's key its members prove (default: a new one: ``key.hex`` is
            then what the members' ``MPX_JOB_SECRET`` must hold).
        advertise: the host :attr:`address` names (default the one listened on).
    """

    def __init__(
        self,
        expected: int,
        heartbeat_timeout: float = 0.5,
        join_timeout: float = 120.0,
        hang_timeout: float | None = None,
        host: str = "127.0.0.1",
        log: Callable[[str], None] | None = None,
        key: JobKey | None = None,
        advertise: str | None = None,
    ) -> None:
        self.expected = expected
        # The host the members are told (host "0.0.0.0" listens everywhere, but is
        # no address to reach).
        self._advertise = advertise
        self.key = key if key is not None else JobKey.new()
        self.membership = Membership(
            expected, join_timeout, heartbeat_timeout, time.monotonic(), hang_timeout
        )
        self.heartbeat_timeout = heartbeat_timeout
        # The members' view of who is alive comes with the beats' replies: kept
        # fresh even when a long timeout is allowed.
        self.heartbeat_interval = min(heartbeat_timeout / BEATS_PER_TIMEOUT, MAX_BEAT_INTERVAL_S)
        self._changed = threading.Condition()
        self._log = log
        self._server = _Server((host, 0), _Handler)
        self._server.lighthouse = self
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._hung: list[int] = []
        # Rank index -> (group, description) of the first hello of that rank: each
        # rank's gradients are averaged with the same rank of the other groups only
        # (a group's ranks may hold different parts of the model: pipeline stages,
        # shards), so rank r of every group is compared with rank r, not with rank 0.
        # Of two groups that differ, the one refused is the later to say hello at that
        # rank: neither is known to be the right one, and the refusal names both.
        self._gradients: dict[int, tuple[int, dict[str, Any]]] = {}
        self._misconfigured: str | None = None
        # Quorum id -> the voters waiting for its outcome: group -> (incarnation, the step
        # their vote asked the next quorum at), until the outcome asks for them (see vote).
        self._then: dict[int, dict[int, tuple[str, int, bool]]] = {}

    @property
    def address(self) -> str:
        host, port = self._server.socket.getsockname()[:2]
        return f"{self._advertise or host}:{port}"

    def __enter__(self) -> Lighthouse:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        for target in (self._server.serve_forever, self._watch):
            thread = threading.Thread(target=target, daemon=True, name="mpx-lighthouse")
            thread.start()
            self._threads.append(thread)

    def close(self) -> None:
        self._closed.set()
        self._server.shutdown()
        self._server.server_close()
        with self._changed:
            self._changed.notify_all()

    def hung(self) -> list[int]:
        """The groups found hung since the last call (counted out, then silent for
        ``hang_timeout``: ``mpxrun`` stops and restarts them)."""
        with self._changed:
            found, self._hung = self._hung, []
        return found

    def cannot_go_on(self) -> str | None:
        """Why no group can train on, if none can (the state is lost): ``mpxrun`` then
        restarts no group."""
        with self._changed:
            lost = self.membership.state_lost
        if lost is None:
            return None
        return (
            f"no group holds the state of step {lost} (every group that had it is gone) and "
            "none resumed from a checkpoint: training again from fresh weights would lose "
            f"{lost} steps (docs/live-recovery.md: checkpoints)"
        )

    def misconfigured(self) -> str | None:
        """Why the groups cannot average together, if a hello was refused for gradients
        that differ from another group's (:meth:`compare`): ``mpxrun`` then restarts no
        group (a restart builds the same model) and stops the others."""
        with self._changed:
            return self._misconfigured

    def compare(self, identity: tuple[int, int, str], gradients: dict[str, Any]) -> str | None:
        """Why rank ``identity``'s ``gradients`` cannot be averaged with the same rank of
        the groups that said hello before it (None: they can; the first is kept)."""
        group, rank, _ = identity
        with self._changed:
            first, theirs = self._gradients.setdefault(rank, (group, gradients))
            if theirs == gradients:
                return None
            why = (
                f"group {group} rank {rank} averages {described(gradients)}, but group "
                f"{first} rank {rank} averages {described(theirs)}: their gradients cannot be "
                "averaged together. Every group must build the same model and pass the same "
                "compression= to FaultTolerantOptimizer"
            )
            if self._misconfigured is None:
                self._misconfigured = (
                    f"group {group}'s gradients differ from group {first}'s at rank {rank} (the "
                    "lighthouse's refusal above says how): every group must build the same "
                    "model and pass the same compression= to FaultTolerantOptimizer"
                )
            return why

    def refused(self, peer: Any, why: str) -> None:
        """A connection that never became a member was closed (see :class:`Refused`)."""
        where = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else peer
        self._say(f"refused a connection from {where}: {why}")

    def _say(self, text: str) -> None:
        if self._log is not None:
            self._log(text)

    def _watch(self) -> None:
        """Expires silent groups and forms quorums whose wait a death ended."""
        while not self._closed.wait(self.heartbeat_interval):
            with self._changed:
                now = time.monotonic()
                for group in self.membership.expire(now):
                    self._say(
                        f"group {group} missed its heartbeats (silent past its deadline, "
                        f"{self.membership.deadline(group):.2f} s): out of the quorums until it "
                        "beats again"
                    )
                for group in self.membership.hung(now):
                    self._say(
                        f"group {group} silent for {self.membership.hang_timeout:g} s "
                        "(hung?): stopped, to be restarted"
                    )
                    self._hung.append(group)
                self._form()
                self._changed.notify_all()

    def _form(self) -> None:
        before, back = self.membership.last, self.membership.went_back
        lost = self.membership.state_lost
        quorum = self.membership.form(time.monotonic())
        if self.membership.state_lost is not None and lost is None:
            self._say(f"the job cannot go on: {self.cannot_go_on()}")
        if self.membership.went_back is not back and self.membership.went_back is not None:
            step, newest = self.membership.went_back
            self._say(
                f"no group holds the state of step {newest}: going on from step {step}, the "
                f"newest any group has (a checkpoint); steps {step}..{newest - 1} are done again"
            )
        if quorum is not None and (
            before is None or before.members != quorum.members or quorum.joining
        ):
            loads = "; ".join(
                f"group {g} loads group {d}'s state" for g, d in quorum.donors.items()
            )
            joining = f", joining {quorum.joining}" * bool(quorum.joining)
            self._say(
                f"step {quorum.step}: members {quorum.members}{joining}"
                + f" ({loads})" * bool(loads)
            )

    # -- requests (each from its connection's thread) --

    def hello(
        self, identity: tuple[int, int, str], size: int, address: list[Any]
    ) -> dict[str, Any]:
        group, rank, incarnation = identity
        with self._changed:
            self.membership.hello(group, rank, size, incarnation, address, time.monotonic())
            self._changed.notify_all()
        return {"ok": True, "heartbeat_interval": self.heartbeat_interval}

    def beat(self, identity: tuple[int, int, str]) -> dict[str, Any]:
        group, rank, incarnation = identity
        with self._changed:
            was_out = self.membership.counted_out(group, incarnation)
            member = self.membership.beat(group, rank, incarnation, time.monotonic())
            if was_out and member:
                self._say(f"group {group} beats again: it rejoins at the next step")
                self._changed.notify_all()  # its request, waiting for this
            return {
                "member": member,
                "alive": {str(g): i for g, i in self.membership.alive().items()},
                "last_aborted": self.membership.last_aborted,
            }

    def lost(self, identity: tuple[int, int, str]) -> None:
        group, rank, incarnation = identity
        with self._changed:
            if self.membership.alive().get(group) == incarnation or (
                self.membership.counted_out(group, incarnation)
            ):
                self._say(f"group {group} lost (rank {rank}'s connection closed)")
            self.membership.lost(group, incarnation)
            self._form()
            self._changed.notify_all()

    def quorum(self, identity: tuple[int, int, str], step: int) -> dict[str, Any]:
        group, _, incarnation = identity
        with self._changed:
            return self._quorum(group, incarnation, step)

    def _quorum(
        self, group: int, incarnation: str, step: int, asked: bool = False
    ) -> dict[str, Any]:
        """A quorum request's reply, waited for (with ``self._changed`` held); ``asked``:
        the vote that decided the last step requested it for this group already.

        A counted-out group's request waits until its beats bring it back (then it
        asks, and is admitted as a restarted group is), or it is found dead."""
        m = self.membership
        requested = asked
        if asked:
            self._form()
            self._changed.notify_all()
        while not self._closed.is_set():
            if m.state_lost is not None:
                return {"lost": m.state_lost}
            if not requested:
                ended = m.finished(group, step)
                if ended is not None:
                    return {"finished": ended}
                if m.request(group, incarnation, step, time.monotonic()):
                    requested = True
                    self._form()
                    self._changed.notify_all()
                    continue
                if not m.counted_out(group, incarnation):
                    return {"member": False}
            elif m.alive().get(group) == incarnation:
                assigned = m.assigned.get(group)
                if assigned is not None:
                    return {"quorum": m.quorums[assigned].view(group)}
            elif m.counted_out(group, incarnation):
                requested = False  # counted out while it waited: it asks again once back
            else:
                return {"member": False}
            # The wait ends on any change; the timeout lets a first quorum's join_timeout pass.
            self._changed.wait(self.heartbeat_timeout)
            self._form()
        return {"member": False}

    def vote(
        self, identity: tuple[int, int, str], quorum_id: int, ok: bool, then: int | None = None
    ) -> dict[str, Any]:
        """The outcome; with ``then`` also the next quorum, asked for at step ``then``
        (+ 1 if the step committed): once every member voted, it forms at once."""
        group, _, incarnation = identity
        with self._changed:
            outcome = self.membership.vote(group, incarnation, quorum_id, ok)
            if outcome is None and then is not None:
                self._then.setdefault(quorum_id, {})[group] = (incarnation, then, ok)
            elif outcome is not None:
                # The deciding vote asks for every member that waits on its own vote
                # too, so the next quorum forms in this thread: each waiting thread
                # then only wakes to write its reply (this thread no longer waits for
                # them to ask in turn: its vote took 55-60 us here instead of 100-140,
                # session 18, this 2-core VM).
                self._ask_for_waiting(quorum_id, outcome)
            self._changed.notify_all()
            while outcome is None and not self._closed.is_set():
                self._changed.wait(self.heartbeat_timeout)
                outcome = self.membership.outcome(quorum_id)
            if outcome is False and ok:
                self._say(f"step of quorum {quorum_id} discarded (a member failed or left)")
            # Decided by a death (no vote decided it): this thread asks for itself.
            self._ask_for_waiting(quorum_id, outcome)
            # Asked for already: this group waits for (or got) a quorum after this one.
            asked = group in self.membership.pending or (
                self.membership.assigned.get(group, quorum_id) > quorum_id
            )
            reply: dict[str, Any] = {"outcome": bool(outcome)}
            if then is not None and not self._closed.is_set():
                # A step is this group's if it committed and the group had its part
                # (a joining group that missed the state or the gradients has not).
                step = then + bool(outcome and ok)
                reply.update(self._quorum(group, incarnation, step, asked))
            return reply

    def _ask_for_waiting(self, quorum_id: int, outcome: bool | None) -> None:
        """Once ``quorum_id`` is decided: the next quorum's requests of its waiting voters."""
        waiting = self._then.pop(quorum_id, None)
        if outcome is None or waiting is None:
            return
        now = time.monotonic()
        for g, (incarnation, then, ok) in waiting.items():
            self.membership.request(g, incarnation, then + bool(outcome and ok), now)
        for old in [q for q in self._then if q < quorum_id - 8]:
            del self._then[old]

    def leave(self, identity: tuple[int, int, str], step: int) -> dict[str, Any]:
        group, _, incarnation = identity
        with self._changed:
            self.membership.leave(group, incarnation, step)
            self._form()
            self._changed.notify_all()
        return {"ok": True}


def print_event(text: str) -> None:
    """Writes a membership event to stderr, as ``mpxrun``'s lines are."""
    with contextlib.suppress(OSError):
        print(f"mpxrun: lighthouse: {text}", file=sys.stderr, flush=True)
