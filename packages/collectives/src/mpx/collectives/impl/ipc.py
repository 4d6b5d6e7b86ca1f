"""``impl="ipc"``: CUDA tensors of ranks on one node, reduced on the GPU through CUDA IPC.

Each rank allocates two slots of ``MPX_IPC_SLOT_MB`` (16 MiB) on its GPU and
exports them with CUDA IPC; every rank maps every peer's slots once (the
handles travel by MPI). The algorithm is the shared-memory one of
:mod:`mpx.collectives.impl.shm`, on device memory::

    rank r, GPU r                     rank s, GPU s
    [slot 0 | slot 1] <--- mapped --- reads r's chunk s (peer-to-peer copy)
    1. copy the chunks others own into my slot; sync stream; barrier
    2. reduce my chunk: my data + each peer's slot (copied to my GPU first)
    3. result into my slot; sync stream; barrier; copy every chunk out

A barrier is an MPI ``Ibarrier`` after ``stream.synchronize()``, so a peer
never reads a slot whose copy is still queued. Every rank must *see* the GPUs
of its peers: run with all devices visible (``mpxrun --gpus none``) and pick
the device by local rank, or put several ranks on one GPU.
"""

from __future__ import annotations

import torch

from mpx.collectives import settings
from mpx.collectives.base import (
    MPXValueError,
    Requests,
    Steps,
    export_cuda_storage,
    open_cuda_storage,
)
from mpx.collectives.core import Communicator
from mpx.collectives.impl.shm import slotted_allreduce, slotted_broadcast

__all__ = ["IpcWorkspace", "allreduce", "broadcast"]

_ALIGN = 256


def _slot_bytes() -> int:
    return settings.IPC_SLOT.get() // _ALIGN * _ALIGN


class IpcWorkspace:
    """Two device slots per rank, mapped by every rank of the node.

    Example::

        ws = yield from IpcWorkspace.ready(comm, torch.device("cuda", 0))   # in steps
        peer = ws.slot(1, 0, torch.float32)                   # rank 1's slot 0
    """

    def __init__(self, comm: Communicator, device: torch.device) -> None:
        self.comm, self.device = comm, device
        self.bytes = _slot_bytes()
        self._own = torch.zeros(2 * self.bytes, dtype=torch.uint8, device=device)
        handles = comm.mpi.allgather(export_cuda_storage(self._own))
        self._raw: list[torch.Tensor] = []
        for r, handle in enumerate(handles):
            if r == comm.rank:
                self._raw.append(self._own)
                continue
            storage = open_cuda_storage(handle)
            self._raw.append(torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage))
        self.calls = 0
        torch.cuda.current_stream(device).synchronize()
        comm.mpi.Barrier()

    @classmethod
    def ready(cls, comm: Communicator, device: torch.device) -> Steps[IpcWorkspace]:
        """The workspace on ``device``; the first call creates it (collective).

        Creation exchanges handles with blocking MPI calls that no deadline
        reaches: every rank first arrives at a non-blocking barrier, polled
        under the operation's timeout (as ``shm``'s ``Workspace.ready``).
        """
        key = f"ipc:{device}"
        found = comm.cached(key)
        if isinstance(found, IpcWorkspace):
            return found
        yield Requests([comm.mpi.Ibarrier()])
        return comm.cache(key, cls(comm, device))

    def slot(self, rank: int, buf: int, dtype: torch.dtype) -> torch.Tensor:
        raw = self._raw[rank][buf * self.bytes : (buf + 1) * self.bytes]
        return raw.view(dtype)

    def barrier(self) -> Requests:
        torch.cuda.current_stream(self.device).synchronize()
        return Requests([self.comm.mpi.Ibarrier()])

    def local(self, x: torch.Tensor) -> torch.Tensor:
        # Elementwise kernels need their operands on one device: a peer's slot
        # on another GPU comes over by a peer-to-peer copy first.
        return x if x.device == self.device else x.to(self.device)

    def publish(self, rank: int, buf: int, piece: torch.Tensor) -> bool:
        return False  # device data always goes through the mapped slots

    def source(self, rank: int, buf: int, dtype: torch.dtype, n: int) -> torch.Tensor:
        return self.slot(rank, buf, dtype)[:n]

    def free(self) -> None:
        self._raw.clear()


def _check(comm: Communicator, t: torch.Tensor, op: str) -> None:
    if not t.is_cuda:
        raise MPXValueError(
            f"{op}: impl='ipc' takes CUDA tensors, got one on {t.device}; "
            "use impl='auto' for other tensors"
        )
    if not comm.single_node:
        raise MPXValueError(
            f"{op}: impl='ipc' needs every rank on one node, but this communicator spans "
            f"{comm.num_nodes} nodes; use impl='staged' or 'auto'"
        )


def allreduce(comm: Communicator, t: torch.Tensor, op: str) -> Steps[torch.Tensor]:
    _check(comm, t, "allreduce")
    if comm.size == 1 or t.numel() == 0:
        return t.div_(1) if op == "avg" else t
    ws = yield from IpcWorkspace.ready(comm, t.device)
    result = yield from slotted_allreduce(ws, comm.rank, comm.size, t, op)
    torch.cuda.current_stream(t.device).synchronize()
    return result


def broadcast(comm: Communicator, t: torch.Tensor, root: int) -> Steps[torch.Tensor]:
    _check(comm, t, "broadcast")
    if comm.size == 1 or t.numel() == 0:
        return t
    ws = yield from IpcWorkspace.ready(comm, t.device)
    result = yield from slotted_broadcast(ws, comm.rank, t, root)
    torch.cuda.current_stream(t.device).synchronize()
    return result
