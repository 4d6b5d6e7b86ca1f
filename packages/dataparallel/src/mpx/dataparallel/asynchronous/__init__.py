"""Asynchronous training, TorchMPI's modes: no rank waits for the others.

What lives here: :class:`ParameterServer` (tensors sharded across the ranks,
served by a progress thread; clients push and pull) and the optimizers that
train through it, :class:`DownpourSGD` and :class:`EASGD`.

What it may import: ``mpx.dataparallel.errors``, ``mpx.dataparallel.runtime``
and ``mpx.dataparallel.synchronous`` (root's initial values, broadcast), and
mpx-collectives. Not ``checkpoints`` or ``recovery``: the roles beside it.
"""

from mpx.dataparallel.asynchronous.async_sgd import EASGD, DownpourSGD
from mpx.dataparallel.asynchronous.parameter_server import RULES, ParameterServer, PSHandle

__all__ = ["EASGD", "RULES", "DownpourSGD", "PSHandle", "ParameterServer"]
