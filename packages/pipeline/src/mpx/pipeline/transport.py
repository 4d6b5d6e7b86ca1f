"""Point-to-point traffic between neighbouring stages, through mpx.collectives.

::

    stage s-1                         stage s                          stage s+1
    ---------                         -------                          ---------
    header ------------------------>  (once per call: shape, dtype)
    act j  ---- send(async) ------->  recv posted early into a pooled buffer
                                      ...                  header --->
                                      act j ---- send(async) ------>
                                      grad recv posted right after F(j) <--- grad j
    grad j <--- send(async) --------

``recv`` needs a preallocated tensor, so the sender opens each call with a
10-int header (dtype, ndim, dims); the receiver then posts the receives for the
call's micro-batches at once, into buffers drawn from a pool keyed by (shape,
dtype) and given back after the micro-batch's backward: a new shape allocates,
a repeated one reuses. Every message of micro-batch ``j`` carries its own tag,
so the order in which receives complete does not matter. Send handles are
polled and dropped as they finish and waited for at the end of each call.
"""

from __future__ import annotations

import time
import weakref
from collections import defaultdict
from typing import Any

import torch

from mpx.collectives import Communicator, Handle, recv, send
from mpx.collectives.building_blocks import HEADER_LEN, decode_header, usable_cores
from mpx.collectives.building_blocks import encode_header as _encode_header
from mpx.pipeline.errors import PipelineError, PipelineTypeError, PipelineValueError

__all__ = ["WAITED", "Inbox", "Outbox", "decode_header", "encode_header"]

_HEADER_TAG = 1
_NO_LIMIT_S = 10.0**9
_WINDOW = 8192  # micro-batches that may be in flight on one link at once
_TAG_BASE = {"act": _WINDOW, "grad": 2 * _WINDOW}


WAITED = [0.0]
"""Seconds this process has spent waiting for pipeline messages (busy-time accounting)."""


def _oversubscribed(comm: Communicator) -> bool:
    """More ranks on this node than cores this process may run on (cached per comm)."""
    known = comm.cached("pipeline.oversubscribed")
    if known is None:
        known = comm.cache("pipeline.oversubscribed", comm.node_size > usable_cores())
    return bool(known)


def _wait(handle: Handle[Any], comm: Communicator) -> None:
    """Waits for a message, spinning only when every rank has a core of its own.

    A stage waits a lot (the bubble, a neighbour's compute). With a core per
    rank, MPI's own spinning wait has the lowest latency. With more ranks than
    cores (CI runs 3 ranks on 2) a spinning rank takes the core from a
    computing one, so mpx's polling wait, which sleeps between polls, is used.
    """
    start = time.perf_counter()
    if comm.timeout is None and not _oversubscribed(comm):
        handle.wait()
    else:
        handle.wait(comm.timeout if comm.timeout is not None else _NO_LIMIT_S)
    WAITED[0] += time.perf_counter() - start


def _tag(kind: str, j: int) -> int:
    return _TAG_BASE[kind] + j % _WINDOW


def encode_header(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """The header of an activation (:func:`mpx.collectives.building_blocks.encode_header`).

    Raises:
        PipelineValueError: more dimensions than a header holds.
        PipelineTypeError: a dtype no operation takes.
    """
    try:
        return _encode_header(shape, dtype)
    except TypeError as exc:
        raise PipelineTypeError(f"an activation cannot cross a stage border: {exc}") from exc
    except ValueError as exc:
        raise PipelineValueError(f"an activation cannot cross a stage border: {exc}") from exc


_ORPHANS: list[tuple[torch.Tensor, Handle[Any]]] = []
"""Messages still in flight when their box was dropped (a Pipeline discarded
without ``flush``): their tensors stay alive here until MPI is done with them,
so MPI never reads or writes freed memory. Reaped by every box's progress."""


def _adopt(state: dict[str, Any]) -> None:
    """A box's finalizer: keeps the tensors of its unfinished messages alive."""
    entries: list[tuple[torch.Tensor, Handle[Any]]] = [
        *state.get("_inflight", {}).values(),
        *state.get("_headers", []),
        *state.get("_pending", {}).values(),
    ]
    if state.get("_header_handle") is not None:
        entries.append((state["_header"], state["_header_handle"]))
    _ORPHANS.extend(entry for entry in entries if not entry[1].completed)


def _reap_orphans() -> None:
    if _ORPHANS:
        _ORPHANS[:] = [(t, h) for t, h in _ORPHANS if not h.done()]


class _Pool:
    """Free receive buffers by (shape, dtype)."""

    def __init__(self) -> None:
        self._free: dict[tuple[torch.Size, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        self.allocated = 0

    def take(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        free = self._free[(shape, dtype)]
        if free:
            return free.pop()
        self.allocated += 1
        return torch.empty(shape, dtype=dtype)

    def give(self, buf: torch.Tensor) -> None:
        self._free[(buf.shape, buf.dtype)].append(buf)


class Inbox:
    """Receives from one neighbour: activations (with headers) or gradients."""

    def __init__(self, comm: Communicator, peer: int, kind: str) -> None:
        self.comm, self.peer, self.kind = comm, peer, kind
        self.pool = _Pool()
        self._header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        self._header_handle: Handle[torch.Tensor] | None = None
        self._expect: list[int] = []
        self._pending: dict[int, tuple[torch.Tensor, Handle[torch.Tensor]]] = {}
        # Dropped with receives posted: their buffers must outlive them.
        weakref.finalize(self, _adopt, self.__dict__)

    def expect(self, ids: list[int]) -> None:
        """Activations: posts the header receive of a call carrying micro-batches ``ids``."""
        if not ids:
            return
        self._expect = ids
        self._header_handle = recv(
            self._header, self.peer, _HEADER_TAG, comm=self.comm, async_op=True
        )

    def _post_expected(self) -> None:
        assert self._header_handle is not None
        _wait(self._header_handle, self.comm)
        self._header_handle = None
        shape, dtype = decode_header(self._header)
        for j in self._expect:
            self.post(j, shape, dtype)
        self._expect = []

    def post(self, j: int, shape: torch.Size, dtype: torch.dtype) -> None:
        """Posts the receive of micro-batch ``j`` into a pooled buffer."""
        buf = self.pool.take(shape, dtype)
        handle = recv(buf, self.peer, _tag(self.kind, j), comm=self.comm, async_op=True)
        self._pending[j] = (buf, handle)

    def get(self, j: int) -> torch.Tensor:
        """Waits for micro-batch ``j``; the buffer is ours until :meth:`release`."""
        if j not in self._pending and self._header_handle is not None:
            self._post_expected()
        if j not in self._pending:
            raise PipelineError(f"internal: no receive posted for micro-batch {j}")
        buf, handle = self._pending.pop(j)
        _wait(handle, self.comm)
        return buf

    def release(self, buf: torch.Tensor) -> None:
        self.pool.give(buf)

    def progress(self) -> None:
        """Lets MPI move the messages in flight (a test per pending receive)."""
        for _, handle in self._pending.values():
            handle.done()
        _reap_orphans()


class Outbox:
    """Sends to one neighbour, asynchronously; holds each tensor until its send is done."""

    def __init__(self, comm: Communicator, peer: int, kind: str) -> None:
        self.comm, self.peer, self.kind = comm, peer, kind
        self._needs_header = False
        self._inflight: dict[int, tuple[torch.Tensor, Handle[None]]] = {}
        self._headers: list[tuple[torch.Tensor, Handle[None]]] = []
        # Dropped with sends in flight: hand them over instead of freeing them.
        weakref.finalize(self, _adopt, self.__dict__)

    def new_call(self) -> None:
        """Activations: the next send opens with a header."""
        self._needs_header = True

    def send(self, j: int, t: torch.Tensor) -> None:
        t = t.detach().contiguous()
        if self._needs_header:
            header = encode_header(t.shape, t.dtype)
            handle = send(header, self.peer, _HEADER_TAG, comm=self.comm, async_op=True)
            self._headers.append((header, handle))
            self._needs_header = False
        handle = send(t, self.peer, _tag(self.kind, j), comm=self.comm, async_op=True)
        self._inflight[j] = (t, handle)
        self._reap()

    def progress(self) -> None:
        """Lets MPI move the messages in flight; drops the finished ones."""
        self._reap()

    def _reap(self) -> None:
        for j in [j for j, (_, h) in self._inflight.items() if h.done()]:
            del self._inflight[j]
        self._headers = [(t, h) for t, h in self._headers if not h.done()]
        _reap_orphans()

    def wait(self, j: int) -> None:
        entry = self._inflight.pop(j, None)
        if entry is not None:
            _wait(entry[1], self.comm)

    def wait_all(self) -> None:
        for _, handle in self._headers:
            _wait(handle, self.comm)
        for _, handle in self._inflight.values():
            _wait(handle, self.comm)
        self._headers.clear()
        self._inflight.clear()
