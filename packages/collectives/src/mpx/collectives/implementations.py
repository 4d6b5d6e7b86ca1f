"""The implementation modules by name, and what every one of them provides.

:mod:`mpx.collectives.policy` decides which implementation runs a call, by
name, knowing no module; this table turns the name into the module whose op
functions run it. Each op function takes the communicator, the tensor and the
op's own arguments and returns a generator of steps
(:class:`mpx.collectives.handle.Steps`), which the communicator drives.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from mpx.collectives import impl_hier, impl_ipc, impl_mpi, impl_ring, impl_shm, impl_staged
from mpx.collectives.communicator import Communicator
from mpx.collectives.handle import Steps
from mpx.collectives.impl_c10d import GLOO, NCCL

__all__ = ["MODULES", "Implementation"]


class Implementation(Protocol):
    """An implementation module: each op it provides is a generator of steps.

    Every implementation provides allreduce and broadcast (mypy checks each
    module of :data:`MODULES` against this protocol); the others, where
    :data:`mpx.collectives.policy.PROVIDES` says so, have the same shape with
    their own arguments (``reduce(comm, t, root, op)``, ``send(comm, t, dest,
    tag)``, ...) and are found by name.
    """

    def allreduce(self, comm: Communicator, t: torch.Tensor, op: str) -> Steps[torch.Tensor]: ...

    def broadcast(self, comm: Communicator, t: torch.Tensor, root: int) -> Steps[torch.Tensor]: ...


MODULES: Mapping[str, Implementation] = {
    "mpi": impl_mpi,
    "ring": impl_ring,
    "shm": impl_shm,
    "hier": impl_hier,
    "staged": impl_staged,
    "ipc": impl_ipc,
    "gloo": GLOO,
    "nccl": NCCL,
}
