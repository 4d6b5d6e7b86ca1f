"""``ParameterServer``: tensors sharded across ranks, served by a progress thread.

Every registered tensor is flattened and cut into one contiguous shard per
rank; rank r *serves* shard r and every rank is a *client* of all shards::

    tensor (n = 10, 3 ranks):  [ 0 1 2 3 | 4 5 6 | 7 8 9 ]
                                 rank 0    rank 1  rank 2     (owners)

    client c                              server thread of rank r
    --------                              -----------------------
    push(key, t, "add"): Isend header  -> Iprobe, Recv header, Recv payload
                         Isend t[r's]  -> shard += payload    (under a lock)
    pull(key, out):      Irecv out[r's]
                         Isend header  -> Send shard           (reply)
    (own shard: applied or read directly, under the same lock)

Each rank runs one daemon thread that polls its own duplicate of the
communicator (MPI_THREAD_MULTIPLE, mpi4py's default), so servers answer while
their own training loop computes: nothing on the client side has to call
into the library for requests to make progress. MPI keeps messages from one
source in order, so a client's push and a later pull of the same shard are
served in that order. ``fence()`` (collective) returns once every request
sent before it, by any rank, has been applied.

Rules: ``"add"`` (shard += data), ``"copy"`` (shard = data), ``"zero"``
(shard = 0, no payload): TorchMPI's parameter-server update rules.
"""

from __future__ import annotations

import atexit
import threading
import time
from typing import Any, Generic, Literal, TypeVar, cast, overload

import numpy as np
import torch
from mpi4py import MPI

from mpx.collectives import CollectiveTimeout, CommLike
from mpx.dataparallel.errors import (
    DataParallelTypeError,
    DataParallelValueError,
    ParameterServerError,
)
from mpx.dataparallel.runtime import default_comm

__all__ = ["RULES", "PSHandle", "ParameterServer"]

RULES = ("add", "copy", "zero")
"""The ways a push updates the server's copy (``rule=``): add to it, copy over it, zero it."""
_PUSH, _PULL, _FENCE = 1, 2, 3
_TAG_REQUEST, _TAG_PAYLOAD, _TAG_REPLY = 11, 12, 13
_MIN_SLEEP_S, _MAX_SLEEP_S = 2e-5, 1e-3

T = TypeVar("T")


def _bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor, as a numpy view MPI can read or fill."""
    return t.view(torch.uint8).numpy()


class PSHandle(Generic[T]):
    """A push or pull in flight; ``wait()`` completes it (and returns the pulled tensor).

    Example::

        h = ps.pull(key, out=buffer, async_op=True)
        loss = compute()
        buffer = h.wait()
    """

    def __init__(
        self, server: ParameterServer, requests: list[MPI.Request], keep: list[Any], result: Any
    ) -> None:
        self._server = server
        self._requests = requests
        self._keep = keep  # buffers MPI reads or writes until completion
        self._result = result

    def done(self) -> bool:
        self._server._check()
        if self._requests and not MPI.Request.Testall(self._requests):
            return False
        self._requests, self._keep = [], []
        return True

    def wait(self, timeout: float | None = None) -> T:
        """Waits (polling, so the server thread keeps the GIL half the time) and returns."""
        limit = self._server.timeout if timeout is None else timeout
        deadline = None if limit is None else time.monotonic() + limit
        sleep = _MIN_SLEEP_S
        while not self.done():
            if deadline is not None and time.monotonic() > deadline:
                raise CollectiveTimeout("parameter server request", "ps", float(limit or 0), [])
            time.sleep(sleep)
            sleep = min(2 * sleep, _MAX_SLEEP_S)
        return cast(T, self._result)


class ParameterServer:
    """Tensors sharded across the ranks; any rank pushes to and pulls from them.

    Args:
        comm: the ranks that serve and use the tensors (world by default).
            Collective: every rank creates it.
        timeout: seconds a client waits for a server (``comm.timeout`` by default).

    Example::

        ps = ParameterServer()
        key = ps.register(torch.zeros(1000))      # collective
        ps.push(key, grad, rule="add"); ps.pull(key, out=weights)
    """

    def __init__(self, comm: CommLike | None = None, timeout: float | None = None) -> None:
        comm = default_comm(comm)
        if comm.size > 1 and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise ParameterServerError(
                "ParameterServer needs MPI_THREAD_MULTIPLE (its progress thread talks MPI while "
                f"the training loop does); MPI was initialised with level {MPI.Query_thread()}: "
                "do not set mpi4py.rc.thread_level lower"
            )
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size
        self.timeout = comm.timeout if timeout is None else timeout
        # A private communicator: the thread's probes match only server traffic.
        self._mpi = comm.mpi.Dup()
        self._shards: list[torch.Tensor] = []
        self._layouts: list[tuple[torch.Size, torch.dtype, list[int]]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._pending: list[PSHandle[Any]] = []
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="mpx-ps-progress", daemon=True)
        self._thread.start()
        # Without close(), stop the thread before mpi4py finalizes MPI at exit
        # (atexit runs handlers last-registered first, so this one comes before).
        atexit.register(self._halt)

    # -- registration ----------------------------------------------------------------

    def register(self, tensor: torch.Tensor) -> int:
        """Shards ``tensor`` across the ranks; returns its key. Collective.

        Every rank passes a tensor of the same shape and dtype; rank r's shard
        starts from rank r's values (synchronize them first to start equal).
        """
        self._check()
        if not isinstance(tensor, torch.Tensor):
            raise DataParallelTypeError(
                f"register: expected a torch.Tensor, got {type(tensor).__name__}; "
                "convert it with torch.as_tensor(...)"
            )
        mine = (tuple(tensor.shape), str(tensor.dtype))
        every = self._mpi.allgather(mine)
        if any(x != every[0] for x in every):
            raise DataParallelValueError(
                f"register: ranks passed different tensors: {sorted(set(every))}; every rank "
                "must register the same shape and dtype, in the same order"
            )
        n = tensor.numel()
        base, extra = divmod(n, self.size)
        bounds = [r * base + min(r, extra) for r in range(self.size + 1)]
        flat = tensor.detach().reshape(-1)
        shard = flat[bounds[self.rank] : bounds[self.rank + 1]].to("cpu", copy=True).contiguous()
        with self._lock:
            self._shards.append(shard)
            self._layouts.append((tensor.shape, tensor.dtype, bounds))
        self._mpi.Barrier()  # nobody pushes a key before its owner holds it
        return len(self._shards) - 1

    # -- client operations -----------------------------------------------------------

    @overload
    def push(
        self, key: int, tensor: torch.Tensor | None, rule: str = ..., async_op: Literal[False] = ...
    ) -> None: ...

    @overload
    def push(
        self, key: int, tensor: torch.Tensor | None, rule: str, async_op: Literal[True]
    ) -> PSHandle[None]: ...

    @overload
    def push(
        self, key: int, tensor: torch.Tensor | None, rule: str = ..., *, async_op: Literal[True]
    ) -> PSHandle[None]: ...

    @overload
    def push(
        self, key: int, tensor: torch.Tensor | None, rule: str = ..., async_op: bool = ...
    ) -> PSHandle[None] | None: ...

    def push(
        self, key: int, tensor: torch.Tensor | None, rule: str = "add", async_op: bool = False
    ) -> PSHandle[None] | None:
        """Applies ``rule`` with ``tensor`` to the stored tensor (each shard at its owner).

        ``tensor`` is copied before this returns, so it may change at once.
        ``rule="zero"`` takes no tensor (pass None).
        """
        shape, dtype, bounds = self._layout(key)
        if rule not in RULES:
            raise DataParallelValueError(
                f"push: rule must be one of {', '.join(RULES)}, got {rule!r}"
            )
        if rule == "zero":
            flat = None
        else:
            if not isinstance(tensor, torch.Tensor) or tensor.numel() != bounds[-1]:
                got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else tensor
                raise DataParallelValueError(
                    f"push: key {key} holds shape {tuple(shape)}, got {got}; push a tensor of "
                    f"{bounds[-1]} elements"
                )
            flat = tensor.detach().reshape(-1).to("cpu", dtype, copy=True).contiguous()
        requests: list[MPI.Request] = []
        keep: list[Any] = []
        for r in range(self.size):
            a, b = bounds[r], bounds[r + 1]
            if a == b:
                continue
            part = None if flat is None else flat[a:b]
            if r == self.rank:
                with self._lock:
                    self._apply(key, RULES.index(rule), part)
                continue
            header = np.array([_PUSH, key, RULES.index(rule), 0], dtype=np.int64)
            requests.append(self._mpi.Isend(header, dest=r, tag=_TAG_REQUEST))
            keep.append(header)
            if part is not None:
                requests.append(self._mpi.Isend(_bytes(part), dest=r, tag=_TAG_PAYLOAD))
        keep.append(flat)
        return self._finish(PSHandle[None](self, requests, keep, None), async_op)

    @overload
    def pull(
        self, key: int, out: torch.Tensor | None = ..., async_op: Literal[False] = ...
    ) -> torch.Tensor: ...

    @overload
    def pull(
        self, key: int, out: torch.Tensor | None, async_op: Literal[True]
    ) -> PSHandle[torch.Tensor]: ...

    @overload
    def pull(
        self, key: int, out: torch.Tensor | None = ..., *, async_op: Literal[True]
    ) -> PSHandle[torch.Tensor]: ...

    @overload
    def pull(
        self, key: int, out: torch.Tensor | None = ..., async_op: bool = ...
    ) -> torch.Tensor | PSHandle[torch.Tensor]: ...

    def pull(
        self, key: int, out: torch.Tensor | None = None, async_op: bool = False
    ) -> torch.Tensor | PSHandle[torch.Tensor]:
        """The stored tensor, gathered from its owners (into ``out`` when given)."""
        shape, dtype, bounds = self._layout(key)
        if out is not None and (out.shape != shape or out.dtype != dtype):
            raise DataParallelValueError(
                f"pull: out is {tuple(out.shape)} {out.dtype}, key {key} holds "
                f"{tuple(shape)} {dtype}"
            )
        flat = torch.empty(bounds[-1], dtype=dtype)
        requests: list[MPI.Request] = []
        keep: list[Any] = []
        for r in range(self.size):
            a, b = bounds[r], bounds[r + 1]
            if a == b:
                continue
            if r == self.rank:
                with self._lock:
                    flat[a:b].copy_(self._shards[key])
                continue
            # Receive posted before the request: the reply never waits for a buffer.
            requests.append(self._mpi.Irecv(_bytes(flat[a:b]), source=r, tag=_TAG_REPLY))
            header = np.array([_PULL, key, 0, 0], dtype=np.int64)
            requests.append(self._mpi.Isend(header, dest=r, tag=_TAG_REQUEST))
            keep.append(header)
        result = _Deliver(flat, shape, out)
        handle = _PullHandle(self, requests, keep, result)
        return self._finish(handle, async_op)

    def fence(self) -> None:
        """Returns once every request sent before it by any rank is applied. Collective."""
        self._check()
        for handle in self._pending:
            handle.wait()
        self._pending.clear()
        requests: list[MPI.Request] = []
        keep: list[Any] = []
        for r in range(self.size):
            if r == self.rank:
                continue
            ack = np.zeros(1, dtype=np.int64)
            requests.append(self._mpi.Irecv(ack, source=r, tag=_TAG_REPLY))
            header = np.array([_FENCE, 0, 0, 0], dtype=np.int64)
            requests.append(self._mpi.Isend(header, dest=r, tag=_TAG_REQUEST))
            keep += [ack, header]
        PSHandle[None](self, requests, keep, None).wait()
        barrier = self._mpi.Ibarrier()
        PSHandle[None](self, [barrier], [], None).wait()

    def close(self) -> None:
        """Fences, stops the progress thread and frees the communicator. Collective, idempotent.

        The communicator freed is the server's own duplicate: ``comm`` stays open.
        """
        if self._closed:
            return
        self.fence()
        self._halt()
        self._closed = True
        self._mpi.Free()
        atexit.unregister(self._halt)

    def __enter__(self) -> ParameterServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def shard(self, key: int) -> torch.Tensor:
        """A copy of this rank's shard of ``key`` (what this rank serves)."""
        self._layout(key)
        with self._lock:
            return self._shards[key].clone()

    # -- internals -------------------------------------------------------------------

    def _halt(self) -> None:
        """Stops the progress thread (not collective: requests still in flight are dropped)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def _layout(self, key: int) -> tuple[torch.Size, torch.dtype, list[int]]:
        self._check()
        if not isinstance(key, int) or not 0 <= key < len(self._layouts):
            raise DataParallelValueError(
                f"unknown key {key!r}: {len(self._layouts)} tensors are registered "
                "(keys come from register())"
            )
        return self._layouts[key]

    def _check(self) -> None:
        if self._error is not None:
            raise ParameterServerError(
                f"the parameter server's progress thread on rank {self.rank} failed: "
                f"{type(self._error).__name__}: {self._error}"
            ) from self._error
        if self._closed:
            raise ParameterServerError(
                "the parameter server is closed: close() freed its communicator and stopped "
                "its progress thread; create a new ParameterServer (collective) to go on"
            )

    def _finish(self, handle: PSHandle[T], async_op: bool) -> T | PSHandle[T]:
        if async_op:
            self._pending = [h for h in self._pending if not h.done()]
            self._pending.append(handle)
            return handle
        return handle.wait()

    def _apply(self, key: int, rule: int, data: torch.Tensor | None) -> None:
        shard = self._shards[key]
        if rule == 0:
            assert data is not None
            shard.add_(data)
        elif rule == 1:
            assert data is not None
            shard.copy_(data)
        else:
            shard.zero_()

    def _serve(self) -> None:
        """The progress thread: answers requests until close()."""
        status = MPI.Status()
        header = np.zeros(4, dtype=np.int64)
        sleep = _MIN_SLEEP_S
        try:
            while not self._stop.is_set():
                if not self._mpi.Iprobe(MPI.ANY_SOURCE, _TAG_REQUEST, status):
                    # Back off while idle: the training loop needs the core and the GIL.
                    time.sleep(sleep)
                    sleep = min(2 * sleep, _MAX_SLEEP_S)
                    continue
                sleep = _MIN_SLEEP_S
                source = status.Get_source()
                self._mpi.Recv(header, source=source, tag=_TAG_REQUEST)
                kind, key, rule = int(header[0]), int(header[1]), int(header[2])
                if kind == _PUSH:
                    data = None
                    if rule != 2:
                        data = torch.empty_like(self._shards[key])
                        self._mpi.Recv(_bytes(data), source=source, tag=_TAG_PAYLOAD)
                    with self._lock:
                        self._apply(key, rule, data)
                elif kind == _PULL:
                    with self._lock:
                        reply = self._shards[key].clone()
                    self._mpi.Send(_bytes(reply), dest=source, tag=_TAG_REPLY)
                elif kind == _FENCE:
                    self._mpi.Send(np.ones(1, dtype=np.int64), dest=source, tag=_TAG_REPLY)
                else:
                    raise ParameterServerError(f"unknown request kind {kind} from rank {source}")
        except BaseException as error:  # reported to the client by _check()
            self._error = error


class _Deliver:
    """What a pull hands back once its pieces have arrived."""

    def __init__(self, flat: torch.Tensor, shape: torch.Size, out: torch.Tensor | None) -> None:
        self.flat, self.shape, self.out = flat, shape, out

    def value(self) -> torch.Tensor:
        if self.out is None:
            return self.flat.view(self.shape)
        with torch.no_grad():
            self.out.copy_(self.flat.view(self.shape))
        return self.out


class _PullHandle(PSHandle[torch.Tensor]):
    def wait(self, timeout: float | None = None) -> torch.Tensor:
        deliver = self._result
        assert isinstance(deliver, _Deliver)
        super().wait(timeout)
        return deliver.value()
