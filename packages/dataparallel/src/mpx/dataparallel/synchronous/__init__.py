"""Synchronous data parallelism, FluxMPI's API: every rank steps together.

What lives here: :func:`synchronize` (``broadcast``: root's state on every
rank, broadcast in buckets), :class:`DistributedDataContainer` (``data``: each
rank's shard of a data set), :class:`DistributedOptimizer` (``optimizer``:
gradients averaged in buckets while backward runs; ``buckets`` packs them,
``reduction`` is the one table of how a bucket is reduced) and
:func:`allreduce_gradients` (``gradients``: one average after backward).

What it may import: ``mpx.dataparallel.errors`` and ``mpx.dataparallel.runtime``
of this package (the foundation every role shares), mpx-collectives, and
mpx-quantize only lazily (the optional extra). The other roles
(``asynchronous``, ``checkpoints``, ``recovery``) and ``fluxmpi`` build on this
one, through this ``__init__``.
"""

from mpx.dataparallel.synchronous.broadcast import broadcast_tensors, synchronize
from mpx.dataparallel.synchronous.data import DistributedDataContainer
from mpx.dataparallel.synchronous.gradients import allreduce_gradients
from mpx.dataparallel.synchronous.optimizer import DistributedOptimizer
from mpx.dataparallel.synchronous.reduction import quantize_module

__all__ = [
    "DistributedDataContainer",
    "DistributedOptimizer",
    "allreduce_gradients",
    "broadcast_tensors",
    "quantize_module",
    "synchronize",
]
