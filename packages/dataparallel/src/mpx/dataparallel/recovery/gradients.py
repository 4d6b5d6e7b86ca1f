"""A rank's gradients across the replica groups: its buffers, their exchange, their sum.

:class:`GradientExchange` is the data path of
:class:`~mpx.dataparallel.recovery.optimizer.FaultTolerantOptimizer`'s step (the
optimizer keeps the protocol: membership, votes, the state of a restarted
group). Each rank has two gradient buffers in one segment its peers on this host
map (:mod:`~mpx.dataparallel.recovery.shm`), used in turn: a step's gradients,
divided by the members' number, are published in one, and once the lighthouse
commits the step every member sums the members' parts in their order into the
other, which becomes the gradients. Peers that cannot map each other (another
host) swap the bytes over their TCP link before the vote. Every member adds the
same operands in the same order: every replica gets the same bytes.

With ``compression`` (an ``mpx.quantize.CompressionConfig``) the gradients sent
over TCP are quantized (``bits`` per value, buckets of ``bucket_size``): each
member quantizes its part and replaces it with its dequantized self before
publishing, so the peers reading it in shared memory and those decoding its
bytes from TCP sum the same values, and every replica still gets the same
bytes. Stochastic rounding is seeded by the quorum and the group.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
from collections.abc import Callable
from typing import Any

import torch

from mpx.dataparallel.recovery.links import GRAD, PeerLost, exchange, recv_frame, send_frame
from mpx.dataparallel.recovery.shm import PeerSegment, Segment, negotiate, shm_wanted
from mpx.dataparallel.synchronous import quantize_module

__all__ = ["GradientExchange"]


class GradientExchange:
    """The gradients of ``params`` (one dtype) across ``groups`` replica groups.

    After the first step a step allocates nothing (no zero-fill, no page faults):
    the buffers and each peer's receive buffer are kept from step to step.
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        dtype: torch.dtype,
        group: int,
        groups: int,
        compression: Any = None,
    ) -> None:
        self.params = params
        self.group = group
        self.segment = Segment(sum(p.numel() for p in params), dtype, shared=shm_wanted())
        self.cur = 0
        self._views = [self._split(buffer) for buffer in self.segment.buffers]
        # Each peer's segment, mapped, and the link it was agreed on (None: TCP).
        self.shared: dict[int, tuple[socket.socket, PeerSegment | None]] = {}
        # What average() sums once the step commits: members, quorum, readers, TCP payloads,
        # whether those are quantized.
        self._pending: (
            tuple[list[int], int, dict[int, PeerSegment | None], dict[int, Any], bool] | None
        ) = None
        self._compression = compression
        needed_by = "FaultTolerantOptimizer(compression=...)"
        self._quantize = quantize_module(needed_by) if compression is not None else None
        flat = self.segment.buffers[0]
        # Made (and their pages touched) now rather than in the first step: a
        # restarted group's first step is its rejoin's, and counts.
        self._inbox = {g: torch.zeros_like(flat) for g in range(groups) if g != group}
        self._packed: dict[int, torch.Tensor] = {}
        self._mine: Any = None  # this rank's quantized part, kept from step to step
        if self._quantize is not None:
            self._mine = self._encode(flat, 0)
            nbytes = self._mine.buffer.numel()
            self._packed = {g: torch.zeros(nbytes, dtype=torch.uint8) for g in self._inbox}

    @property
    def nbytes(self) -> int:
        """Bytes of one buffer (the model's gradients, uncompressed)."""
        return int(self.segment.buffers[0].nbytes)

    def _split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat``'s per-parameter views."""
        offsets = itertools.accumulate((p.numel() for p in self.params), initial=0)
        return [
            flat[o : o + p.numel()].view(p.shape)
            for o, p in zip(offsets, self.params, strict=False)
        ]

    def _encode(self, flat: torch.Tensor, seed: int, out: Any = None) -> Any:
        config = self._compression
        return self._quantize.quantize(  # type: ignore[union-attr]
            flat,
            bits=config.bits,
            bucket_size=config.bucket_size,
            stochastic=config.stochastic,
            seed=seed,
            out=out,
        )

    def _gather(self, members: int) -> torch.Tensor:
        """This rank's gradients divided by ``members``, in the current buffer.

        Divided here, in the copy it needs anyway, rather than after the sum: one
        pass over the gradients less a step (the sum of the members' quotients,
        added in the same order on every member, is the average). A CPU
        parameter's gradient is left a view of its slot by the last step (see
        use): with ``zero_grad(set_to_none=False)`` backward accumulates in
        place there and is divided in place; a fresh gradient is copied in once.
        """
        with torch.no_grad():
            for p, view in zip(self.params, self._views[self.cur], strict=True):
                if p.grad is None:
                    view.zero_()
                elif p.grad is view:
                    if members > 1:
                        view.div_(members)
                elif members > 1:
                    torch.div(p.grad, members, out=view)
                else:
                    view.copy_(p.grad)
        return self.segment.buffers[self.cur]

    def _shared_with(
        self,
        links: dict[int, socket.socket],
        qid: int,
        check: Callable[[], None],
        joining: dict[int, socket.socket] | None = None,
        check_joining: Callable[[], None] | None = None,
    ) -> dict[int, PeerSegment | None]:
        """Each peer's mapped segment (None: its gradients go over TCP), agreed once a link;
        a joining group's link whose agreement fails (it is gone) is left out, not the step."""
        joining = joining or {}
        every = {**links, **joining}
        for g in [g for g, (sock, _) in self.shared.items() if every.get(g) is not sock]:
            old = self.shared.pop(g)[1]
            if old is not None:
                old.close()
        for part, part_check in ((links, check), (joining, check_joining or check)):
            new = {g: sock for g, sock in part.items() if g not in self.shared}
            try:
                agreed = negotiate(new, self.group, qid, self.segment, part_check)
            except PeerLost:
                if part is links:
                    raise
                continue  # a joining group gone: it misses this step, the members do not
            for g, reader in agreed.items():
                self.shared[g] = (new[g], reader)
        return {g: self.shared[g][1] for g in every if g in self.shared}

    def reduce(
        self,
        members: list[int],
        qid: int,
        links: dict[int, socket.socket],
        check: Callable[[], None],
        joining: dict[int, socket.socket] | None = None,
        check_joining: Callable[[], None] | None = None,
    ) -> None:
        """Publishes this rank's gradients (and receives its TCP peers'); the sum waits
        for the commit (:meth:`average`). ``links``: one per other member; ``joining``:
        one per joining group (see :meth:`receive`), which gets them too, and whose
        loss (``check_joining`` raises, or its link breaks) costs it the step, not the
        members.

        Raises:
            PeerLost: a member is gone, or sent gradients of the wrong size.
        """
        joining = joining or {}
        flat = self._gather(len(members))
        self._pending = None
        if len(members) == 1 and not joining:
            self.use(self.cur)
            return
        # A member alone sends its gradients as they are: its step is what it would be
        # without the joining group.
        quantized = self._quantize is not None and len(members) > 1
        payload = _bytes(flat)
        if quantized:
            assert self._quantize is not None
            # Every member sums the values the others decode from its bytes.
            seed = (qid << 16) + self.group
            self._mine = self._encode(flat, seed, self._mine)
            self._quantize.dequantize(self._mine, out=flat)
            payload = _bytes(self._mine.buffer)
        shared = self._shared_with(links, qid, check, joining, check_joining)
        # A peer on this host reads the gradients in place, after the commit:
        # this rank votes only once they are written, so a commit says every
        # member's are complete (see shm). No frame, no wait here.
        self.segment.stamp(self.cur, qid)
        tcp = {g: sock for g, sock in links.items() if shared[g] is None}
        inbox = self._packed if quantized else self._inbox
        # Every TCP peer is received into its kept buffer, of this rank's payload's size:
        # exchange refuses a frame of any other length (PeerLost) before reading it.
        got = (
            exchange(tcp, qid, GRAD, payload, check, {g: _bytes(inbox[g]) for g in tcp})
            if tcp
            else {}
        )
        for g, sock in joining.items():
            if g in shared and shared[g] is None:  # over TCP: it reads them before its vote
                # Gone: it misses this step, the members do not.
                with contextlib.suppress(PeerLost):
                    send_frame(sock, qid, GRAD, payload, check_joining or check)
        self._pending = (members, qid, shared, got, quantized)

    def receive(
        self,
        members: list[int],
        qid: int,
        links: dict[int, socket.socket],
        check: Callable[[], None],
    ) -> None:
        """A joining group's side of :meth:`reduce`: the members' gradients, none of its
        own; summed after the commit (:meth:`average`) as every member sums them.
        ``links``: one per member.

        Raises:
            PeerLost: a member is gone, or sent gradients of the wrong size.
        """
        self._pending = None
        quantized = self._quantize is not None and len(members) > 1
        shared = self._shared_with(links, qid, check)
        inbox = self._packed if quantized else self._inbox
        got: dict[int, Any] = {}
        for g, sock in links.items():
            if shared[g] is not None:
                continue  # read in place after the commit
            expected = _bytes(inbox[g])
            kind, payload = recv_frame(sock, qid, check, into=expected, limit=len(expected))
            if kind != GRAD or len(payload) != len(expected):
                raise PeerLost(f"group {g} sent no gradients of {len(expected)} bytes")
            got[g] = payload
        self._pending = (members, qid, shared, got, quantized)

    def average(self) -> None:
        """After a commit: the members' gradients (divided by their number already, see
        _gather) summed in their order into the other buffer, which becomes the gradients."""
        if self._pending is None:
            return
        members, qid, shared, got, quantized = self._pending
        self._pending = None
        flat = self.segment.buffers[self.cur]
        parts = []
        for g in members:
            reader = shared.get(g)
            if g == self.group:
                parts.append(flat)
            elif reader is not None:
                parts.append(reader.holding(qid))
            elif quantized:
                assert self._quantize is not None
                packed = self._quantize.QuantizedTensor(
                    self._packed[g],
                    flat.shape,
                    flat.dtype,
                    self._compression.bits,
                    self._compression.bucket_size,
                )
                parts.append(self._quantize.dequantize(packed, out=self._inbox[g]))
            else:
                parts.append(torch.frombuffer(got[g], dtype=flat.dtype))
        self.cur = 1 - self.cur
        with torch.no_grad():
            _sum_into(parts, self.segment.buffers[self.cur])
        self.use(self.cur)

    def discard(self) -> None:
        """The step did not commit: nothing of it is summed."""
        self._pending = None

    def use(self, index: int) -> None:
        """Buffer ``index`` becomes the gradients."""
        with torch.no_grad():
            for p, view in zip(self.params, self._views[index], strict=True):
                if p.device.type == "cpu":
                    # The average's slot becomes the gradient: nothing copied back.
                    p.grad = view
                elif p.grad is None:
                    p.grad = view.to(p.device)
                else:
                    p.grad.copy_(view)

    def close(self) -> None:
        for _, reader in self.shared.values():
            if reader is not None:
                reader.close()
        self.shared.clear()
        self.segment.close()


def _sum_into(parts: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """``out = (parts[0] + parts[1]) + ...``, added in that order, ``parts`` untouched.

    Every member adds the same operands in the same order, so every replica
    gets the same bytes (NaN included); ``out`` is none of the parts: a peer
    may still be reading this rank's (see shm). One part (a member alone, with
    a joining group) is copied.
    """
    if len(parts) == 1:
        return out.copy_(parts[0])
    torch.add(parts[0], parts[1], out=out)
    for part in parts[2:]:
        torch.add(out, part, out=out)
    return out


def _bytes(tensor: torch.Tensor) -> memoryview:
    return tensor.numpy().data.cast("B")
