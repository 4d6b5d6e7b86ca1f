"""mpx-collectives: every collective on torch tensors over MPI.

Example::

    from mpx.collectives import allreduce, world
    grad = allreduce(grad, "avg")                 # impl="auto": mpi, ring or shm
    print(world().rank, world().size)

Packages built on mpx-collectives also use :mod:`mpx.collectives.building_blocks`;
the other modules are internal: other packages must not import them.
"""

from importlib import metadata as _metadata

from mpx.collectives.base import (
    CollectiveTimeout,
    CommunicatorBroken,
    Handle,
    MismatchError,
    MPXError,
    MPXTypeError,
    MPXValueError,
    RemoteError,
)
from mpx.collectives.core import (
    IMPLEMENTATIONS,
    CommLike,
    Communicator,
    Implementation,
    all_implementations,
    allgather,
    allreduce,
    alltoall,
    as_communicator,
    barrier,
    broadcast,
    bytes_communicated,
    empty_shared,
    free_shared,
    recv,
    reduce,
    reduce_scatter,
    send,
    world,
)
from mpx.collectives.p2p import Channel
from mpx.collectives.torch import init_process_group, register_torch_backend

__all__ = [
    "IMPLEMENTATIONS",
    "Channel",
    "CollectiveTimeout",
    "CommLike",
    "Communicator",
    "CommunicatorBroken",
    "Handle",
    "Implementation",
    "MPXError",
    "MPXTypeError",
    "MPXValueError",
    "MismatchError",
    "RemoteError",
    "__version__",
    "all_implementations",
    "allgather",
    "allreduce",
    "alltoall",
    "as_communicator",
    "barrier",
    "broadcast",
    "bytes_communicated",
    "empty_shared",
    "free_shared",
    "init_process_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "register_torch_backend",
    "send",
    "world",
]

# pyproject.toml's version, as installed: the one place it is written.
__version__ = _metadata.version("mpx-collectives")
