"""The core every implementation plugs into: the communicator, the operations
(``ops``, generated from the table of op specs ``op_specs`` by ``ops_source``)
and the dispatch of each call, the registry of implementations, the policy
that chooses among them, the cross-rank checks of calls (``consistency``,
``call_checks``) and agreement, MPI's reduction ops, node-shared tensors
(``shared_memory``), and the compiled fast path of small calls (``fast_path``,
Cython's pure-Python mode).

May import: ``node``, ``base`` (and the top-level ``settings``). The
implementations are loaded by name through the registry, never imported.
"""

from mpx.collectives.core.communicator import (
    CommLike,
    Communicator,
    Hierarchy,
    as_communicator,
    world,
)
from mpx.collectives.core.dispatch import count_payload
from mpx.collectives.core.mpi_ops import mpi_op
from mpx.collectives.core.ops import (
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
from mpx.collectives.core.policy import (
    COMPARE_ONLY,
    IMPLEMENTATIONS,
    TUNABLE,
    PolicyError,
    choose,
    default_policy_file,
    layout_key,
    small_bytes,
)
from mpx.collectives.core.policy import current as current_policy
from mpx.collectives.core.registry import Implementation, all_implementations, blocking
from mpx.collectives.core.registry import get as implementation
from mpx.collectives.core.shared_memory import SharedBuffers, empty_shared, free_shared

__all__ = [
    "COMPARE_ONLY",
    "IMPLEMENTATIONS",
    "TUNABLE",
    "CommLike",
    "Communicator",
    "Hierarchy",
    "Implementation",
    "PolicyError",
    "SharedBuffers",
    "all_implementations",
    "allgather",
    "allreduce",
    "alltoall",
    "as_communicator",
    "barrier",
    "blocking",
    "broadcast",
    "bytes_communicated",
    "choose",
    "count_payload",
    "current_policy",
    "default_policy_file",
    "empty_shared",
    "free_shared",
    "implementation",
    "layout_key",
    "mpi_op",
    "recv",
    "reduce",
    "reduce_scatter",
    "send",
    "small_bytes",
    "world",
]
