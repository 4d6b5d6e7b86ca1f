"""``gloo`` and ``nccl``: torch's own process groups as implementations, as TorchMPI had.

TorchMPI ran NCCL and Gloo collectives beside its MPI ones, so a user could
pick per call and compare. Here ``impl="gloo"`` runs a call on a
``ProcessGroupGloo`` (CPU tensors) and ``impl="nccl"`` on a
``ProcessGroupNCCL`` (CUDA tensors) made over the same ranks as the
communicator -- no ``init_process_group`` needed::

    communicator (MPI)  --first gloo/nccl call, collective-->  TCPStore on rank 0
                                                                (address by MPI bcast)
                                                            --> ProcessGroupGloo/NCCL
    allreduce(t, impl="gloo") --> pg.allreduce([t]) --> Work, polled as a step

``auto`` never picks them (MPI's own and mpx's are faster on CPU here:
``benchmarks/bench_allreduce.py``); name them with ``impl=`` or
``MPX_COLLECTIVES_IMPL``. Ops they do not run (point-to-point, barrier,
reduce_scatter) fall back to the policy's default for the device. The group's
transport binds loopback when every rank shares this node, the host's name
otherwise.
"""

from __future__ import annotations

import datetime
import socket
from typing import Any

import torch

from mpx.collectives.base import Pending, Steps, gloo_process_group
from mpx.collectives.core import Communicator, PolicyError

__all__ = ["GLOO", "NCCL", "C10dImplementation", "WorkStep"]

# A group's operations, and the store it meets through, give up after this
# (mpx's own timeout= still bounds each call through its handle).
_GROUP_TIMEOUT = datetime.timedelta(minutes=30)


class WorkStep(Pending):
    """A step that waits for a torch ``Work`` (what c10d process groups return)."""

    __slots__ = ("work",)

    def __init__(self, work: Any) -> None:
        self.work = work

    def test(self) -> bool:
        return bool(self.work.is_completed())

    def wait(self) -> None:
        self.work.wait()


_REDUCE_OPS = {"sum": "SUM", "avg": "SUM", "max": "MAX", "min": "MIN", "prod": "PRODUCT"}


class C10dImplementation:
    """The op functions of one torch backend (``"gloo"`` or ``"nccl"``), per communicator."""

    def __init__(self, backend: str) -> None:
        self.backend = backend

    def group(self, comm: Communicator) -> Any:
        """This communicator's process group of the backend. Collective on first use."""
        key = f"mpx.collectives.c10d.{self.backend}"
        found = comm.cached(key)
        if found is not None:
            return found.value
        # TCPStore, PrefixStore and ProcessGroupNCCL are public but not in torch's
        # stubs (nor is NCCL in a CPU build): reached through an untyped name.
        import torch.distributed

        dist: Any = torch.distributed
        host = "127.0.0.1" if comm.single_node else socket.gethostname()
        host = comm.mpi.bcast(host, 0)
        store = None
        if comm.rank == 0:
            store = dist.TCPStore(
                host, 0, comm.size, True, timeout=_GROUP_TIMEOUT, wait_for_workers=False
            )
        port = comm.mpi.bcast(store.port if store is not None else None, 0)
        if store is None:
            store = dist.TCPStore(host, port, comm.size, False, timeout=_GROUP_TIMEOUT)
        prefixed = dist.PrefixStore(f"mpx/{self.backend}", store)
        if self.backend == "gloo":
            mine = socket.gethostname() if not comm.single_node else "127.0.0.1"
            group = gloo_process_group(prefixed, comm.rank, comm.size, _GROUP_TIMEOUT, mine)
        else:
            if not hasattr(dist, "ProcessGroupNCCL"):
                raise PolicyError(
                    "impl='nccl' needs a torch built with NCCL (a CUDA wheel); this torch "
                    f"{torch.__version__} has none: use impl='staged' or 'auto'"
                )
            group = dist.ProcessGroupNCCL(
                prefixed, comm.rank, comm.size, dist.ProcessGroupNCCL.Options()
            )
        # The store lives as long as the group: rank 0's serves the others.
        comm.cache(key + ".store", _Kept(store))
        return comm.cache(key, _Kept(group)).value

    def allreduce(self, comm: Communicator, t: torch.Tensor, op: str) -> Steps[torch.Tensor]:
        import torch.distributed as dist

        options = dist.AllreduceOptions()
        options.reduceOp = getattr(dist.ReduceOp, _REDUCE_OPS[op])
        yield WorkStep(self.group(comm).allreduce([t], options))
        if op == "avg":
            t.div_(comm.size)
        return t

    def broadcast(self, comm: Communicator, t: torch.Tensor, root: int) -> Steps[torch.Tensor]:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = root
        yield WorkStep(self.group(comm).broadcast([t], options))
        return t

    def reduce(
        self, comm: Communicator, t: torch.Tensor, root: int, op: str
    ) -> Steps[torch.Tensor]:
        import torch.distributed as dist

        options = dist.ReduceOptions()
        options.rootRank = root
        options.reduceOp = getattr(dist.ReduceOp, _REDUCE_OPS[op])
        # gloo's reduce works in its input on every rank: the other ranks' tensors came
        # back holding partial sums, where mpx's reduce leaves them unchanged.
        work = t if comm.rank == root else t.clone()
        yield WorkStep(self.group(comm).reduce([work], options))
        if op == "avg" and comm.rank == root:
            t.div_(comm.size)
        return t

    def allgather(self, comm: Communicator, t: torch.Tensor) -> Steps[torch.Tensor]:
        out = torch.empty((comm.size, *t.shape), dtype=t.dtype, device=t.device)
        yield WorkStep(self.group(comm).allgather([list(out.unbind(0))], [t]))
        return out

    def alltoall(self, comm: Communicator, t: torch.Tensor) -> Steps[torch.Tensor]:
        out = torch.empty_like(t)
        yield WorkStep(self.group(comm).alltoall_base(out, t, [], []))
        return out


class _Kept:
    """Holds a torch object in the communicator's cache (``free()`` calls ``free``s only)."""

    def __init__(self, value: Any) -> None:
        self.value = value


GLOO = C10dImplementation("gloo")
NCCL = C10dImplementation("nccl")
