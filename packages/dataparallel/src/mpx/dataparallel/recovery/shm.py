"""The gradient exchange's same-host path: each rank's gradients in a shared-memory segment.

Over TCP the failure-free step spent ~3.3 ms a step sending and receiving
5 MB (the bench's model, session 17's profile: the copies into and out of the
kernel) and waited for the peers twice, at the exchange and at the vote. When
two groups' ranks share a host, each rank instead keeps its two gradient
buffers (see ``FaultTolerantOptimizer._reduce``: one is published while the
step's sum is written into the other) in one ``memfd`` segment, and its peers
map it through ``/proc/<pid>/fd/<fd>``: one wait a step, at the vote.

No frame carries them: a rank stamps the buffer with the step's quorum and
only then votes (the vote goes to the lighthouse over TCP, which answers
once every member voted): a commit says every member's buffer of that quorum
is complete, and the members read each other's after it (the send and receive
system calls order the writes before the reads). A member killed before its
vote never votes: the lighthouse sees its closed connections and the step is
discarded; one killed after its vote leaves its mapped memory to the readers
(a commit stands, as on TCP). A writer rewrites a buffer only after the next
commit, which needs every reader's vote, sent after its last read of it. The
TCP links stay the liveness channel and carry the handshake below; pairs that
cannot map each other (another host, another pid namespace, ``MPX_FT_SHM=0``)
exchange the bytes over TCP before the vote. An anonymous memfd leaves nothing
behind in /dev/shm when a process is SIGKILLed.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import secrets
import struct
from collections.abc import Callable
from typing import Any

import torch

from mpx.dataparallel.errors import DataParallelError
from mpx.dataparallel.recovery.links import SHM, PeerLost, exchange
from mpx.dataparallel.settings import FT_SHM

__all__ = ["PeerSegment", "Segment", "negotiate", "shm_wanted"]

# Header: a token (a peer checks it: the pid and fd it opened are this segment's,
# not a reused pid's), then one stamp per buffer (the quorum its data is of).
_HEADER = struct.Struct("16sqq")
_DATA = 64  # the first buffer's offset (and the alignment of the second)


def shm_wanted() -> bool:
    """Whether this rank offers its segment to its peers (``MPX_FT_SHM``, default on)."""
    return FT_SHM.get() and hasattr(os, "memfd_create")


def _aligned(n: int) -> int:
    return -(-n // _DATA) * _DATA


def _tensors(memory: mmap.mmap, numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
    size = numel * torch.empty(0, dtype=dtype).element_size()
    second = _DATA + _aligned(size)
    return [
        torch.frombuffer(memory, dtype=dtype, count=numel, offset=at)
        if numel
        else torch.empty(0, dtype=dtype)
        for at in (_DATA, second)
    ]


class Segment:
    """This rank's two gradient buffers, in shared memory when it can be made."""

    def __init__(self, numel: int, dtype: torch.dtype, shared: bool) -> None:
        self.numel = numel
        self.dtype = dtype
        self.token = secrets.token_bytes(16)
        self._memory: mmap.mmap | None = None
        self._fd = -1
        if shared:
            size = numel * torch.empty(0, dtype=dtype).element_size()
            length = _DATA + 2 * _aligned(max(size, 1))
            try:
                self._fd = os.memfd_create("mpx-ft-gradients")
                os.ftruncate(self._fd, length)
                self._memory = mmap.mmap(self._fd, length)
            except OSError:
                if self._fd >= 0:
                    os.close(self._fd)
                self._fd = -1
        if self._memory is not None:
            _HEADER.pack_into(self._memory, 0, self.token, -1, -1)
            self.buffers = _tensors(self._memory, numel, dtype)
            for buffer in self.buffers:
                buffer.zero_()  # its pages touched now, not in the first step
        else:
            self.buffers = [torch.zeros(numel, dtype=dtype) for _ in range(2)]

    @property
    def shared(self) -> bool:
        return self._memory is not None

    def describe(self) -> dict[str, Any] | None:
        """What a peer needs to map it (None: not shared)."""
        if self._memory is None:
            return None
        return {"pid": os.getpid(), "fd": self._fd, "token": self.token.hex(), "numel": self.numel}

    def stamp(self, index: int, quorum: int) -> None:
        """Marks buffer ``index`` as holding quorum ``quorum``'s gradients."""
        if self._memory is not None:
            struct.pack_into("q", self._memory, 16 + 8 * index, quorum)

    def close(self) -> None:
        self.buffers = []
        if self._memory is not None:
            with contextlib.suppress(BufferError):  # a tensor the caller still holds
                self._memory.close()
            os.close(self._fd)
            self._memory = None


class PeerSegment:
    """A peer's :class:`Segment`, mapped (raises OSError/ValueError if it cannot be)."""

    def __init__(self, where: dict[str, Any], numel: int, dtype: torch.dtype) -> None:
        if int(where["numel"]) != numel:
            # Another model: over TCP its frames' length says so, and every step is discarded.
            raise ValueError(f"a segment of {where['numel']} gradients, not {numel}")
        path = f"/proc/{int(where['pid'])}/fd/{int(where['fd'])}"
        fd = os.open(path, os.O_RDWR)
        try:
            self._memory = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        size = numel * torch.empty(0, dtype=dtype).element_size()
        if len(self._memory) < _DATA + 2 * _aligned(max(size, 1)):
            self.close()
            raise ValueError("the segment is smaller than this rank's gradients")
        if _HEADER.unpack_from(self._memory)[0] != bytes.fromhex(str(where["token"])):
            self.close()
            raise ValueError("another process's segment (its token differs)")
        self.buffers = _tensors(self._memory, numel, dtype)

    def holding(self, quorum: int) -> torch.Tensor:
        """The buffer the peer stamped with ``quorum`` (read after that quorum committed)."""
        stamps = _HEADER.unpack_from(self._memory)[1:]
        if quorum not in stamps:
            # The peer voted for this quorum after stamping: a missing stamp is a bug.
            raise DataParallelError(
                f"FaultTolerantOptimizer: a peer's shared gradients of quorum {quorum} are "
                f"missing (its buffers hold quorums {list(stamps)}); report this with MPX_FT_SHM=0 "
                "as a workaround"
            )
        return self.buffers[stamps.index(quorum)]

    def close(self) -> None:
        self.buffers = []
        with contextlib.suppress(BufferError):
            self._memory.close()


def negotiate(
    links: dict[int, Any],
    group: int,
    quorum: int,
    mine: Segment,
    check: Callable[[], None],
) -> dict[int, PeerSegment | None]:
    """For each new link: the peer's mapped segment if both ends read each other's, else None.

    Two small exchanges: the segments' descriptions, then which of them each end
    could map. A pair uses shared memory only both ways, so that both ends agree
    on whether GRAD frames pass between them.
    """
    if not links:
        return {}
    theirs = exchange(links, quorum, SHM, json.dumps(mine.describe()).encode(), check)
    mapped: dict[int, PeerSegment] = {}
    for peer, payload in theirs.items():
        try:
            where = json.loads(bytes(payload))
            if where is not None and mine.shared:
                mapped[peer] = PeerSegment(where, mine.numel, mine.dtype)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # another host or namespace: TCP for this pair
    both: dict[int, PeerSegment | None] = {}
    try:
        verdicts = exchange(links, quorum, SHM, json.dumps(sorted(mapped)).encode(), check)
        for peer in links:
            try:
                read_mine = group in json.loads(bytes(verdicts[peer]))
            except (ValueError, TypeError) as exc:
                raise PeerLost(f"group {peer} sent a malformed shared-memory reply") from exc
            reader = mapped.pop(peer, None)
            if reader is not None and not read_mine:
                reader.close()
                reader = None
            both[peer] = reader
    except BaseException:
        for reader in [*mapped.values(), *both.values()]:
            if reader is not None:
                reader.close()
        raise
    return both
