"""Where each replica group runs: its own node(s) of the job's, or this host.

``mpxrun --replica-groups R`` on several nodes (``--hostfile``, ``--virtual-nodes``,
a Slurm allocation) gives each group nodes of its own, so that losing a node
loses the groups on it and no other: with at least as many nodes as groups the
nodes are split among the groups in order, as evenly as can be (5 nodes, 2
groups: 3 and 2); with fewer, the groups take the nodes in turn (3 groups, 2
nodes: 0 and 2 on the first, 1 on the second), and groups that share a node
share its memory (live recovery's gradients go through it). Each group's ranks
are spread evenly over its nodes, every node at least one.

Nothing here starts anything: :func:`place_groups` is pure.
"""

from __future__ import annotations

from mpx.launch.errors import UsageError

__all__ = ["place_groups", "ranks_per_node"]


def place_groups(groups: int, nodes: int) -> list[list[int]]:
    """The node indices (``0..nodes-1``) of each of ``groups`` groups (see the module).

    Example::

        place_groups(2, 5) == [[0, 1, 2], [3, 4]]
        place_groups(3, 2) == [[0], [1], [0]]
    """
    if groups < 1 or nodes < 1:
        raise UsageError(f"cannot place {groups} group(s) on {nodes} node(s)")
    if nodes >= groups:
        size, extra = divmod(nodes, groups)
        bounds = [g * size + min(g, extra) for g in range(groups + 1)]
        return [list(range(bounds[g], bounds[g + 1])) for g in range(groups)]
    return [[g % nodes] for g in range(groups)]


def ranks_per_node(nprocs: int, nodes: int) -> list[int]:
    """``nprocs`` ranks over ``nodes`` nodes, as evenly as can be (4 on 3: 2, 1, 1).

    Raises:
        UsageError: fewer ranks than nodes (a node without a rank).
    """
    if nprocs < nodes:
        raise UsageError(
            f"-n {nprocs} gives each replica group fewer ranks than its {nodes} nodes: every "
            f"node needs a rank; pass -n {nodes} or more, or fewer nodes"
        )
    size, extra = divmod(nprocs, nodes)
    return [size + (node < extra) for node in range(nodes)]
