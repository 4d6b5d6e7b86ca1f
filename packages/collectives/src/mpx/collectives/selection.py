"""Which implementation runs an operation: ``impl=``, ``MPX_COLLECTIVES_IMPL``, or ``auto``.

``auto`` decides per call, from the device, the size and the topology; every
rank reaches the same decision because shapes and dtypes agree across ranks::

    device  bytes                   ranks on one node   ranks on several nodes
    ------  ----------------------  ------------------  --------------------------
    cpu     < MPX_AUTO_SMALL_BYTES  mpi                 mpi
    cpu     >= (256 KiB default)    shm                 hier (ring if 1 rank/node)
    cuda    any                     staged (mpi if MPX_CUDA_AWARE=1)

Small messages go to the MPI library, whose latency no Python algorithm beats
(TorchMPI made the same cut at 64 Ki elements). ``ipc`` (CUDA IPC within a
node) is chosen only by name: it needs every rank to see its peers' GPUs.
Operations an implementation does not provide (e.g. ``alltoall`` in ``shm``)
run on ``mpi`` for CPU tensors and ``staged`` for CUDA ones.
"""

from __future__ import annotations

from types import ModuleType

import torch

from mpx.collectives import impl_hier, impl_ipc, impl_mpi, impl_ring, impl_shm, impl_staged
from mpx.collectives.communicator import Communicator
from mpx.collectives.settings import read
from mpx.collectives.thresholds import small_bytes

__all__ = ["IMPLEMENTATIONS", "choose", "small_bytes"]

IMPLEMENTATIONS: dict[str, ModuleType] = {
    "mpi": impl_mpi,
    "ring": impl_ring,
    "shm": impl_shm,
    "hier": impl_hier,
    "staged": impl_staged,
    "ipc": impl_ipc,
}
_NAMES = ("auto", *IMPLEMENTATIONS)
_CUDA_IMPLS = ("staged", "ipc")


def _auto(op: str, t: torch.Tensor | None, comm: Communicator) -> str:
    if t is not None and t.is_cuda:
        return "mpi" if impl_mpi.cuda_aware() else "staged"
    if t is None or comm.size == 1:
        return "mpi"
    if t.numel() * t.element_size() < small_bytes():
        return "mpi"
    if comm.single_node:
        return "shm"
    return "hier" if comm.hierarchy is not None else "ring"


def choose(
    op: str, t: torch.Tensor | None, comm: Communicator, impl: str | None
) -> tuple[str, ModuleType]:
    """The implementation's name and module for this call.

    Raises:
        ValueError: an unknown name, ``shm``/``ipc`` across nodes, ``hier``
            on one node, or a device the implementation cannot take.
    """
    name = impl or read("MPX_COLLECTIVES_IMPL", "auto") or "auto"
    if name not in _NAMES:
        raise ValueError(
            f"{op}: impl must be one of {', '.join(_NAMES)}, got {name!r} "
            "(from impl= or MPX_COLLECTIVES_IMPL)"
        )
    if name == "auto":
        name = _auto(op, t, comm)
    if name in ("shm", "ipc") and not comm.single_node:
        raise ValueError(
            f"{op}: impl={name!r} needs every rank on one node, but this communicator spans "
            f"{comm.num_nodes} nodes; use impl='hier', 'ring' or 'auto'"
        )
    if name == "hier" and comm.hierarchy is None:
        raise ValueError(
            f"{op}: impl='hier' needs ranks on several nodes with more than one rank on some "
            f"node; this communicator has {comm.num_nodes} node(s) of {comm.node_size} rank(s) "
            "here; use impl='shm', 'ring' or 'auto'"
        )
    cuda = t is not None and t.is_cuda
    if cuda and name not in _CUDA_IMPLS and not (name == "mpi" and impl_mpi.cuda_aware()):
        raise ValueError(
            f"{op}: impl={name!r} takes CPU tensors; for a CUDA tensor use impl='staged' "
            "(or 'auto'), 'ipc' within a node, or 'mpi' with a CUDA-aware MPI "
            "(MPX_CUDA_AWARE=1); or move it with t.cpu()"
        )
    if t is not None and not cuda and name in _CUDA_IMPLS:
        raise ValueError(
            f"{op}: impl={name!r} takes CUDA tensors, got one on {t.device}; use impl='auto'"
        )
    module = IMPLEMENTATIONS[name]
    if not hasattr(module, op):
        name = "staged" if cuda and not impl_mpi.cuda_aware() else "mpi"
        module = IMPLEMENTATIONS[name]
    return name, module
