"""``impl="hier"``: shared memory within each node, the network across nodes.

Allreduce, with the same number of ranks L on every node, runs the
shared-memory algorithm of :mod:`mpx.collectives.impl.shm` piece by piece
and slips a cross-node step between its reduce and its copy-out: node rank i,
owner of chunk i of the piece, allreduces that chunk with node rank i of every
other node (its *lane*), so every inter-node link carries 1/L of the data::

    node A (ranks 0 1)          node B (ranks 2 3)
    1. copy in, barrier          same
    2. rank 0 reduces chunk 0    rank 2 reduces chunk 0      (within the node)
       rank 1 reduces chunk 1    rank 3 reduces chunk 1
    3. lane {0,2}: allreduce chunk 0;  lane {1,3}: allreduce chunk 1   (across)
    4. write the result to the slot, barrier, copy out every chunk      (within)

Nodes of unequal sizes fall back to: shared-memory allreduce within the node,
allreduce across the node leaders, shared-memory broadcast from the leader.
Broadcast goes across nodes along the root's lane, then within each node.
The cross-node step uses ``ring`` for chunks of at least
``MPX_AUTO_SMALL_BYTES`` and MPI's own allreduce below. 16-bit floats cross
nodes in float32, as they accumulate.
"""

from __future__ import annotations

import torch

from mpx.collectives.base import MPXValueError, Steps, accumulation_dtype
from mpx.collectives.core import Communicator, Hierarchy, choose
from mpx.collectives.impl import mpi as impl_mpi
from mpx.collectives.impl import ring as impl_ring
from mpx.collectives.impl import shm as impl_shm
from mpx.collectives.impl.shm import Workspace, slotted_allreduce

__all__ = ["allreduce", "broadcast"]


# What the policy may pick for a lane (ranks on separate nodes, one per node).
_ACROSS = {"mpi": impl_mpi, "ring": impl_ring}


def _hierarchy(comm: Communicator, op: str) -> Hierarchy:
    if comm.hierarchy is None:
        raise MPXValueError(
            f"{op}: impl='hier' needs a communicator spanning several nodes with more than one "
            f"rank on some node (this one: {comm.num_nodes} node(s), {comm.node_size} rank(s) "
            "here); use impl='shm', 'ring' or 'auto'"
        )
    return comm.hierarchy


def _across(lane: Communicator, x: torch.Tensor, op: str) -> Steps[torch.Tensor]:
    """Allreduce of ``x`` across nodes, in place (``avg`` is summed here, divided later)."""
    reduce_op = "sum" if op == "avg" else op
    # The policy picks the cross-node step as for any allreduce on the lane
    # (one rank per node: MPI's own for small chunks, the ring above).
    name = choose("allreduce", False, x.numel() * x.element_size(), lane, None, x.dtype, reduce_op)
    steps: Steps[torch.Tensor] = _ACROSS.get(name, impl_mpi).allreduce(lane, x, reduce_op)
    return steps


def allreduce(comm: Communicator, t: torch.Tensor, op: str) -> Steps[torch.Tensor]:
    hier = _hierarchy(comm, "allreduce")
    if t.numel() == 0:
        return t
    if hier.lanes is None:
        return (yield from _allreduce_by_leaders(comm, hier, t, op))
    lane = hier.lanes
    ws = yield from Workspace.ready(hier.node)
    return (
        yield from slotted_allreduce(
            ws,
            hier.node.rank,
            hier.node.size,
            t,
            op,
            across=lambda chunk: _across(lane, chunk, op),
            divisor=comm.size,
        )
    )


def _allreduce_by_leaders(
    comm: Communicator, hier: Hierarchy, t: torch.Tensor, op: str
) -> Steps[torch.Tensor]:
    """Unequal nodes: within, across the leaders, back within."""
    within = "sum" if op == "avg" else op
    acc_dtype = accumulation_dtype(t.dtype)
    work = t if acc_dtype == t.dtype else t.to(acc_dtype)
    if hier.node.size > 1:
        yield from impl_shm.allreduce(hier.node, work, within)
    if hier.leaders is not None:
        yield from _across(hier.leaders, work.reshape(-1), within)
    if hier.node.size > 1:
        yield from impl_shm.broadcast(hier.node, work, 0)
    if op == "avg":
        work.div_(comm.size)
    if work is not t:
        t.copy_(work)
    return t


def broadcast(comm: Communicator, t: torch.Tensor, root: int) -> Steps[torch.Tensor]:
    hier = _hierarchy(comm, "broadcast")
    if t.numel() == 0:
        return t
    if hier.lanes is None:
        return (yield from impl_mpi.broadcast(comm, t, root))
    root_node_rank, root_in_lane = hier.lane_position(root)
    if hier.node.rank == root_node_rank:
        lanes = hier.lanes
        name = choose("broadcast", False, t.numel() * t.element_size(), lanes, None, t.dtype)
        yield from _ACROSS.get(name, impl_mpi).broadcast(lanes, t, root_in_lane)
    if hier.node.size > 1:
        yield from impl_shm.broadcast(hier.node, t, root_node_rank)
    return t
