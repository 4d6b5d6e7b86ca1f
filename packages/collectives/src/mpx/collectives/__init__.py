"""mpx-collectives: every collective on torch tensors over MPI.

Example::

    from mpx.collectives import allreduce, world
    grad = allreduce(grad, "avg")                 # impl="auto": mpi, ring or shm
    print(world().rank, world().size)

Packages built on mpx-collectives also use :mod:`mpx.collectives.building_blocks`;
the other modules are internal: other packages must not import them.
"""

from importlib import metadata as _metadata

from mpx.collectives.channel import Channel
from mpx.collectives.communicator import CommLike, Communicator, as_communicator, world
from mpx.collectives.errors import (
    CollectiveTimeout,
    CommunicatorBroken,
    MismatchError,
    MPXError,
    MPXTypeError,
    MPXValueError,
    RemoteError,
)
from mpx.collectives.handle import Handle
from mpx.collectives.ops import (
    allgather,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    bytes_communicated,
    recv,
    reduce,
    reduce_scatter,
    send,
)
from mpx.collectives.policy import IMPLEMENTATIONS
from mpx.collectives.registry import Implementation, all_implementations
from mpx.collectives.shared_memory import empty_shared, free_shared
from mpx.collectives.torch_backend import init_process_group, register_torch_backend

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
