"""What mpx's upper layers build on, beyond the collectives themselves.

``mpx.collectives`` is the API for users: communicators and operations. This
module is the second, smaller public API, for packages built on top of it
(mpx-pipeline, mpx-dataparallel, mpx-mgrit, mpx-quantize, or your own). Other
packages import only these two modules of mpx-collectives; everything else in
it is private and may change in any release (``nox -s lint`` checks this with
the import contract in the root ``pyproject.toml``).

==========================  ===============================================  =============
name                        what                                             used by
==========================  ===============================================  =============
usable_cores()              cores this process may run on (affinity mask)    pipeline,
                                                                             dataparallel
SUPPORTED_DTYPES            the dtypes every operation takes, fixed order    pipeline,
                                                                             dataparallel
small_bytes()               below this size MPI's own collectives win        dataparallel
                            (``MPX_AUTO_SMALL_BYTES``)
progress_thread_enabled()   whether the progress thread drives asynchronous  dataparallel
                            operations (otherwise poll ``Handle.done()``)
encode_header(shape, dt),   a tensor's shape and dtype as ``HEADER_LEN``     pipeline
decode_header(header),      int64, for a receiver that must allocate its
HEADER_LEN                  buffer before ``recv``
checks_enabled()            whether cross-rank consistency checks run        dataparallel
                            (``MPX_CHECK`` is not ``0``)
empty_shared(...)           a tensor in node-shared memory: ``shm`` reduces  dataparallel
                            it without staging copies (collective)
free_shared(t, comm)        gives that memory back (collective)              dataparallel
Backoff(spins)              pauses between polls of a wait: free polls,      pipeline
                            then sched_yield for 0.5 ms, then sleeps
                            growing from 20 us to 1 ms (oversubscribed
                            waits, as the collectives' own)
MPXProcessGroup, MPXWork    the ``mpx`` torch.distributed group and work:    quantize
                            subclass, override an op, register with
                            ``MPXProcessGroup.create`` as the creator
Implementation, blocking    an implementation for the registry (entry        quantize
                            point ``mpx.collectives.implementations``),
                            and an op function made of a blocking one
==========================  ===============================================  =============

Progress control: a communicator hands unfinished asynchronous operations to
the progress thread unless ``comm.background_progress`` is set False (the
pipeline does, and polls its handles between layers); when
:func:`progress_thread_enabled` is False no thread runs at all, and the caller
must poll ``handle.done()`` now and then for operations to advance.

Cross-rank agreement on errors (:meth:`Communicator.agree`,
``with comm.agreement(...)``) and :class:`~mpx.collectives.base.errors.RemoteError`
are in ``mpx.collectives`` itself.

Example::

    from mpx.collectives.building_blocks import encode_header, decode_header, usable_cores
    oversubscribed = comm.node_size > usable_cores()
    shape, dtype = decode_header(encode_header(t.shape, t.dtype))
"""

from __future__ import annotations

from mpx.collectives.base import SUPPORTED_DTYPES, Backoff, progress
from mpx.collectives.core import (
    Implementation,
    blocking,
    current_policy,
    empty_shared,
    free_shared,
    small_bytes,
)
from mpx.collectives.node import usable_cores
from mpx.collectives.p2p import HEADER_LEN, decode_header, encode_header
from mpx.collectives.torch import MPXProcessGroup, MPXWork

__all__ = [
    "HEADER_LEN",
    "SUPPORTED_DTYPES",
    "Backoff",
    "Implementation",
    "MPXProcessGroup",
    "MPXWork",
    "blocking",
    "checks_enabled",
    "decode_header",
    "empty_shared",
    "encode_header",
    "free_shared",
    "progress_thread_enabled",
    "small_bytes",
    "usable_cores",
]


def progress_thread_enabled() -> bool:
    """Whether asynchronous operations advance by themselves, driven by the progress thread.

    True unless ``MPX_PROGRESS_THREAD=0`` or MPI lacks ``MPI_THREAD_MULTIPLE``.
    When False, an asynchronous operation advances only inside calls on its
    handle: poll ``handle.done()`` between pieces of work to overlap.
    """
    return progress.enabled()


def checks_enabled() -> bool:
    """Whether cross-rank consistency checks run (``MPX_CHECK`` is ``auto`` or ``1``).

    Upper packages compare what must agree across ranks (a model's layout,
    its initial values) once, unless the user turned checks off.
    """
    return current_policy().check != "0"
