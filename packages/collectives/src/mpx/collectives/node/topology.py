"""Where a communicator's ranks run: their node, and the host's cores.

What :class:`~mpx.collectives.Communicator` finds out about the machine when
it is created, apart from the communicator itself::

    split_node()       the ranks sharing memory with this one (MPI_COMM_TYPE_SHARED),
                       or a simulated node of them (MPX_RANKS_PER_NODE)
    note_host_ranks()  the most ranks of this job seen sharing this host
    usable_cores()     the cores this process may run on
    waits_yielding()   whether blocking waits poll and sleep (MPX_WAIT) rather
                       than spin, given the two above
"""

from __future__ import annotations

import os

from mpi4py import MPI

from mpx.collectives import settings

__all__ = ["note_host_ranks", "split_node", "usable_cores", "waits_yielding"]


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask; all of them off Linux)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# The most ranks of this job seen sharing this host (MPI_COMM_TYPE_SHARED of
# any communicator created here, world first): a sub-communicator's own node
# part undercounts the ranks competing for the cores.
_host_ranks = [1]


def note_host_ranks(host_size: int) -> int:
    """Records that ``host_size`` ranks of this job share this host; returns the most seen."""
    _host_ranks[0] = max(_host_ranks[0], host_size)
    return _host_ranks[0]


def waits_yielding(host_ranks: int, cores: int | None = None) -> bool:
    """Whether blocking waits should yield: ``MPX_WAIT``, or with ``auto`` whether
    ``host_ranks`` ranks on this host outnumber the ``cores`` (this process's
    affinity mask by default)."""
    mode = settings.WAIT.get()
    if mode != "auto":
        return mode == "yield"
    return host_ranks > (usable_cores() if cores is None else cores)


def split_node(mpi_comm: MPI.Intracomm, rank: int) -> tuple[MPI.Intracomm, int]:
    """The ranks sharing memory with this one, and how many share the real host.

    ``MPX_RANKS_PER_NODE`` simulates nodes.

    With ``MPX_RANKS_PER_NODE=k`` world ranks ``0..k-1`` count as one node,
    ``k..2k-1`` as the next, and so on (within the real node): the hierarchical
    algorithms can then be tested on one machine.
    """
    shared = MPI.Intracomm(mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank))
    host_size: int = shared.Get_size()
    per_node = settings.RANKS_PER_NODE.get()
    if per_node is None:
        return shared, host_size
    fake = MPI.Intracomm(shared.Split(MPI.COMM_WORLD.Get_rank() // per_node, rank))
    shared.Free()
    return fake, host_size
