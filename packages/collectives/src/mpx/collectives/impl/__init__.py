"""The implementations, one module each, named as ``impl=`` names them:
``mpi``, ``ring``, ``shm``, ``hier``, ``staged``, ``ipc`` and ``c10d``
(torch's ``gloo`` and ``nccl``). :mod:`mpx.collectives.core.registry` declares
each one and imports its module on first use.

May import: ``core``, ``node``, ``base``; an implementation built from
others (``hier``, ``staged``) imports them from here.
"""

from mpx.collectives.impl.mpi import truncated

__all__ = ["truncated"]
