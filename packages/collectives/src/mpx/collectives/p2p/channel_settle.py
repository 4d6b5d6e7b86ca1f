"""Settling a :class:`~mpx.collectives.Channel`: completing whatever is in flight on its links.

After a failure (a wait that timed out, a message that was not what its
receive expected) or at the end of a phase, the messages posted on each link
no longer match the receives posted on the other side. Settling matches them
from every rank's *ledger* (messages posted to and receives posted from each
peer, per tag): a message nobody expected is received and dropped, a receive
nothing will match gets an empty message, and then the channel forgets it all
and starts afresh. ``drain`` does it collectively, and raises every rank's
error on every rank.

:class:`Settling` is a base class of :class:`~mpx.collectives.Channel`, which
holds the state it declares; it is not used on its own.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from mpx.collectives.base import MPXError, MPXValueError, summarize
from mpx.collectives.core import Communicator, send
from mpx.collectives.p2p.channel_state import (
    Entry,
    Incoming,
    Ledger,
    Pool,
    Sent,
    Unfinished,
    complete,
    raise_failures,
    take_unexpected,
    unreported,
)

__all__ = ["Settling"]


class Settling:
    """A channel's ledger, settling and drain (see the module docstring)."""

    comm: Communicator
    _pool: Pool
    _sent: Counter[tuple[int, int]]
    _posted: Counter[tuple[int, int]]
    _sending: list[Sent]
    _incoming: list[Incoming]
    _settling: list[Entry]
    _last_out: dict[tuple[int, int], tuple[Any, list[tuple[torch.Size, torch.dtype]]]]
    _last_in: dict[tuple[int, int], tuple[list[tuple[torch.Size, torch.dtype]], Any]]
    _order: dict[tuple[int, int], deque[Incoming]]

    if TYPE_CHECKING:

        @property
        def timeout(self) -> float | None: ...

        def release(self, tensors: Sequence[torch.Tensor]) -> None: ...

    def ledger(self) -> Ledger:
        """Messages posted to and receives posted from each peer, per tag."""
        sent: dict[int, dict[int, int]] = {}
        for (p, t), n in self._sent.items():
            sent.setdefault(p, {})[t] = n
        posted: dict[int, dict[int, int]] = {}
        for (p, t), n in self._posted.items():
            posted.setdefault(p, {})[t] = n
        return {"sent": sent, "posted": posted}

    def settle_link(
        self,
        peer: int,
        sent: dict[int, int] | None = None,
        posted: dict[int, int] | None = None,
    ) -> None:
        """Matches what ``peer``'s ledger says is unmatched on the link with it.

        Args:
            sent: messages ``peer`` posted to this rank, per tag: those beyond
                this rank's receives are received (whatever their size) and dropped.
            posted: receives ``peer`` posted from this rank, per tag: those
                beyond this rank's messages get an empty one.
        """
        for tag, count in (sent or {}).items():
            for _ in range(count - self._posted[(peer, tag)]):
                self._settling.append(take_unexpected(self.comm, peer, tag, self.timeout))
        for tag, count in (posted or {}).items():
            for _ in range(count - self._sent[(peer, tag)]):
                empty = torch.empty(0)
                handle = send(empty, peer, tag, comm=self.comm, async_op=True)
                self._settling.append((empty, handle))

    def settle(self, ledgers: Sequence[Ledger]) -> None:
        """Completes every message in flight on this rank's links and forgets them all.

        Args:
            ledgers: every rank's :meth:`ledger`, by rank (an allgather of them).

        Raises:
            CollectiveTimeout: a message did not complete in time.
            MPXValueError: a message settled here (expected, never received)
                was not what its receive expected; the channel is settled all
                the same.
        """
        found = self._settle(ledgers)
        if found is not None:
            raise found

    def _settle(self, ledgers: Sequence[Ledger]) -> MPXValueError | None:
        """:meth:`settle`; returns the mismatches found, if any, as one error."""
        me = self.comm.rank
        peers = {p for p, _ in self._sent} | {p for p, _ in self._posted}
        peers |= {r for r, ledger in enumerate(ledgers) if me in ledger["sent"]}
        peers |= {r for r, ledger in enumerate(ledgers) if me in ledger["posted"]}
        for peer in sorted(peers):
            self.settle_link(
                peer, ledgers[peer]["sent"].get(me, {}), ledgers[peer]["posted"].get(me, {})
            )
        complete([handle for _, handle in self.in_flight()], self.timeout, sorted(peers))
        # A message nobody received may still be the wrong one: not lost here.
        errors = [unreported(incoming, self._pool) for incoming in self._incoming]
        found = [str(error) for error in errors if error is not None]
        self.reset()
        return MPXValueError("; ".join(found)) if found else None

    def drain(self, error: BaseException | str | None = None, what: str = "Channel") -> None:
        """Completes everything outstanding; raises every rank's error on every rank. Collective.

        Every rank of the communicator calls it (with its own failure, or
        None). Receives posted and not taken are completed and dropped, so are
        messages nobody expected; afterwards nothing is in flight and the
        channel starts afresh (headers included).

        Raises:
            MPXValueError: on a rank that expected a message it never received
                (and :meth:`receive` did not already raise for), which was not
                what its receive expected (names both sides); the other ranks
                raise RemoteError naming it.
            RemoteError: some rank passed an error (names the ranks and errors).
            CollectiveTimeout: the ranks or their messages did not arrive in time.
        """
        summary = None if error is None else summarize(error)
        every = self.comm.allgather_object((summary, self.ledger()), timeout=self.timeout)
        found = self._settle([ledger for _, ledger in every])
        # Found only now, on the receiving rank: one more exchange so every rank raises.
        mismatches = self.comm.allgather_object(
            None if found is None else summarize(found), timeout=self.timeout
        )
        raise_failures(what, error, [text for text, _ in every], mismatches, found)

    def in_flight(self) -> list[Entry]:
        """Every message not known to be complete, with its tensor."""
        return list(Unfinished(self._sending, self._incoming, self._settling))

    def reset(self) -> None:
        """Forgets everything in progress; every message must have completed.

        Raises:
            MPXError: a message is still in flight (:meth:`settle` first).
        """
        if not all(h.completed for _, h in self.in_flight()):
            raise MPXError("Channel.reset: messages are still in flight; drain() first")
        for incoming in self._incoming:
            incoming.taken = True
            if incoming.head is not None:
                self._pool.give_head(incoming.head[0], incoming.head[1].raw)
            if incoming.pooled:
                self.release([buf for buf, _ in incoming.entries])
        self._incoming.clear()
        self._sending.clear()
        self._settling.clear()
        self._sent.clear()
        self._posted.clear()
        self._last_out.clear()
        self._last_in.clear()
        self._order.clear()
