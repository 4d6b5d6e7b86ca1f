"""Live recovery's membership: the replica groups and the lighthouse that keeps them.

What lives here: ``replica_groups`` (``mpxrun --replica-groups``: one job a
group, each restarted on its own while the others go on, and the
``MPX_REPLICA_GROUP*`` and ``MPX_LIGHTHOUSE`` variables the groups get),
``lighthouse`` (:class:`Lighthouse`: the server the groups beat to and ask for
a quorum, its wire format), ``membership`` (:class:`Membership`: the rules
of quorums and commits, no sockets) and ``placement`` (which nodes each group
runs on). mpx-dataparallel's recovery is the other
end of the wire; it imports nothing of this package.

What it may import: the job's supervision (``mpx.launch.supervision``) and the
rank supervisor (``mpx.launch.rank``, for :func:`new_key`), each through its
``__init__``; ``environment``, ``settings`` and ``errors``. Not the command
line (``mpx.launch.command``) nor ``mpx.launch.cli``, which build on this one.
"""

from mpx.launch.recovery.lighthouse import Lighthouse, print_event
from mpx.launch.recovery.membership import Membership, Quorum
from mpx.launch.recovery.placement import place_groups, ranks_per_node
from mpx.launch.recovery.replica_groups import (
    GROUP_VARIABLES,
    check_usage,
    group_environment,
    run_groups,
    run_replica_groups,
)

__all__ = [
    "GROUP_VARIABLES",
    "Lighthouse",
    "Membership",
    "Quorum",
    "check_usage",
    "group_environment",
    "place_groups",
    "print_event",
    "ranks_per_node",
    "run_groups",
    "run_replica_groups",
]
