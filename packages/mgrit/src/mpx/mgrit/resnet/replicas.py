"""Layer parallel x data parallel: R replicas of a P-rank layer-parallel network.

A :class:`~mpx.mgrit.LayerParallel` spreads its steps over the P ranks of its
``comm``; R such groups, each training on its own shard of the batch, are data
parallel. :func:`split_replicas` cuts a communicator of R x P ranks into both
kinds of group::

    world rank     0   1   2 | 3   4   5        P = 3 (layer_size), R = 2
    layer group    0   0   0 | 1   1   1        LayerParallel(..., comm=groups.layer)
    replica group  0   1   2 | 0   1   2        gradient averaging over groups.replica

The layer groups are runs of consecutive ranks: MGRIT's point-to-point messages
(every cycle, to the next rank) then stay on one node where they can, while the
replica groups meet once per training step (one gradient allreduce). Rank i of
every layer group owns the same steps, so every member of a replica group holds
the same parameter list in the same order, as a data-parallel optimizer needs.
"""

from __future__ import annotations

from typing import NamedTuple

from mpx.collectives import Communicator
from mpx.mgrit._comm import CommLike, as_communicator
from mpx.mgrit.errors import MGRITConfigError

__all__ = ["ReplicaGroups", "split_replicas"]


class ReplicaGroups(NamedTuple):
    """This rank's two groups of a layer-parallel x data-parallel job.

    Attributes:
        layer: the ``layer_size`` consecutive ranks that share one network's steps
            (``LayerParallel(..., comm=groups.layer)``).
        replica: the ranks of the other layer groups that hold the same steps as this
            one (the data-parallel optimizer's ``comm=``).

    Example::

        layer, replica = split_replicas(2)        # it unpacks as a tuple
    """

    layer: Communicator
    replica: Communicator

    def free(self) -> None:
        """Frees both communicators. Collective over the communicator they were split from:
        every rank calls it once, after every network and optimizer on them is closed."""
        self.layer.free()
        self.replica.free()


def split_replicas(layer_size: int, comm: CommLike = None) -> ReplicaGroups:
    """Splits ``comm`` into layer groups of ``layer_size`` ranks and their replica groups.

    Collective over ``comm``. World rank ``w`` is rank ``w % layer_size`` of layer group
    ``w // layer_size``, and rank ``w // layer_size`` of replica group ``w % layer_size``.

    Args:
        layer_size: P, the ranks of one layer-parallel network; it must divide
            ``comm.size`` (the number of replicas is ``comm.size // layer_size``).
        comm: the ranks of the job (an mpx Communicator, an mpi4py one, or None: all).

    Returns:
        the two new communicators (freed with :meth:`ReplicaGroups.free`).

    Example::

        groups = split_replicas(layer_size=2)      # 4 ranks: 2 replicas of 2 ranks
        net = LayerParallel(open_, steps, close, num_steps=8, comm=groups.layer)
        opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), net,
                                   comm=groups.replica)
    """
    world = as_communicator(comm)
    if isinstance(layer_size, bool) or not isinstance(layer_size, int) or layer_size < 1:
        raise MGRITConfigError(
            f"split_replicas: layer_size must be an int >= 1 (the ranks of one "
            f"layer-parallel network), got {layer_size!r}"
        )
    if world.size % layer_size != 0:
        divisors = [d for d in range(1, world.size + 1) if world.size % d == 0]
        raise MGRITConfigError(
            f"split_replicas: layer_size={layer_size} does not divide the {world.size} "
            f"ranks into whole layer groups; use one of {divisors}, or start "
            f"{layer_size} x replicas ranks"
        )
    replica_index, layer_rank = divmod(world.rank, layer_size)
    layer = world.split(replica_index, key=layer_rank)
    replica = world.split(layer_rank, key=replica_index)
    assert layer is not None  # every rank has a color
    assert replica is not None
    return ReplicaGroups(layer, replica)
