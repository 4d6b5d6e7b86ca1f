"""Which implementation runs an operation: ``impl=``, ``MPX_COLLECTIVES_IMPL``, or ``auto``.

``auto`` decides per call, from the device, the size and the topology; every
rank reaches the same decision because shapes and dtypes agree across ranks::

    device  bytes                   ranks on one node   ranks on several nodes
    ------  ----------------------  ------------------  ----------------------
    cpu     < MPX_AUTO_SMALL_BYTES  mpi                 mpi
    cpu     >= (256 KiB default)    shm                 ring
    cuda    any                     mpi if MPX_CUDA_AWARE=1, else not yet supported

Small messages go to the MPI library, whose latency no Python algorithm beats
(TorchMPI made the same cut at 64 Ki elements). Operations an implementation
does not provide (e.g. ``alltoall`` in ``shm``) run on ``mpi``.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from mpx.collectives import impl_mpi, impl_ring, impl_shm
from mpx.collectives.communicator import Communicator

__all__ = ["IMPLEMENTATIONS", "choose", "small_bytes"]

IMPLEMENTATIONS: dict[str, ModuleType] = {"mpi": impl_mpi, "ring": impl_ring, "shm": impl_shm}
_NAMES = ("auto", *IMPLEMENTATIONS)


def small_bytes() -> int:
    """Below this many bytes ``auto`` uses MPI's own collectives."""
    return int(os.environ.get("MPX_AUTO_SMALL_BYTES", str(256 << 10)))


def _auto(op: str, t: torch.Tensor | None, comm: Communicator) -> str:
    if t is None or comm.size == 1 or t.is_cuda:
        return "mpi"
    if t.numel() * t.element_size() < small_bytes():
        return "mpi"
    return "shm" if comm.single_node else "ring"


def choose(
    op: str, t: torch.Tensor | None, comm: Communicator, impl: str | None
) -> tuple[str, ModuleType]:
    """The implementation's name and module for this call.

    Raises:
        ValueError: an unknown name, ``shm`` across nodes, or CUDA on an
            implementation that cannot take it.
    """
    name = impl or os.environ.get("MPX_COLLECTIVES_IMPL", "auto") or "auto"
    if name not in _NAMES:
        raise ValueError(
            f"{op}: impl must be one of {', '.join(_NAMES)}, got {name!r} "
            "(from impl= or MPX_COLLECTIVES_IMPL)"
        )
    if name == "auto":
        name = _auto(op, t, comm)
    if name == "shm" and not comm.single_node:
        raise ValueError(
            f"{op}: impl='shm' needs every rank on one node, but this communicator spans "
            f"{comm.num_nodes} nodes; use impl='ring' or 'auto'"
        )
    if t is not None and t.is_cuda and not (name == "mpi" and impl_mpi.cuda_aware()):
        raise ValueError(
            f"{op}: a CUDA tensor needs a CUDA-aware MPI (set MPX_CUDA_AWARE=1 if yours is) "
            f"for impl='mpi'; impl={name!r} takes CPU tensors; move it with t.cpu()"
        )
    module = IMPLEMENTATIONS[name]
    if not hasattr(module, op):
        name, module = "mpi", impl_mpi
    return name, module
