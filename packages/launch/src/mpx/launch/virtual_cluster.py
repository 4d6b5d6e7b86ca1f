"""``mpx.launch.virtual_cluster``, ``--virtual-nodes`` on one machine: the module
:mod:`mpx.launch.command.virtual_cluster`.

The module lives in ``command/`` (issue 57: one subpackage a role). This path
stays because users import :class:`VirtualCluster` by it (the README's API
table; the multi-node tests). ``sys.modules`` maps this name to that module
itself: ``mpx.launch.virtual_cluster`` *is*
``mpx.launch.command.virtual_cluster``. The names bound below only tell type
checkers what the module holds.
"""

import sys

from mpx.launch.command import virtual_cluster

__all__ = ["MAX_NODES", "VirtualCluster"]

MAX_NODES = virtual_cluster.MAX_NODES
VirtualCluster = virtual_cluster.VirtualCluster

sys.modules[__name__] = virtual_cluster
