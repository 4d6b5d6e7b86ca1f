"""mpx-collectives' environment variables: each declared once, read through this table.

The table itself, the parsing and the caching are mpx-launch's
(:mod:`mpx.launch.settings`); ``mpxrun --settings`` prints every package's
variables. The values are read at first use and cached; after changing
``os.environ`` in a running program call :func:`mpx.launch.settings.reload`
(the collectives policy, built from these, is rebuilt with them).

Example::

    from mpx.collectives import settings
    settings.SMALL_BYTES.get()       # 262144, or MPX_AUTO_SMALL_BYTES=64K -> 65536
"""

from __future__ import annotations

import os

from mpx.launch.settings import Setting, declare

__all__ = [
    "BUILD_CYTHON",
    "CHECK",
    "CUDA_AWARE",
    "IMPL",
    "IMPL_NAMES",
    "IPC_BYTES",
    "IPC_SLOT",
    "POLICY_FILE",
    "PROGRESS_THREAD",
    "RANKS_PER_NODE",
    "RING_CHUNK",
    "SHM_SLOT",
    "SMALL_BYTES",
    "STAGED_CHUNK",
    "TIMEOUT",
    "WAIT",
    "XDG_CACHE_HOME",
    "cuda_visible_devices",
]

_PACKAGE = "collectives"

# The built-in implementations (mpx.collectives.core.registry declares them; other
# packages add theirs, so the setting is checked against the registry when used).
IMPL_NAMES = ("auto", "mpi", "ring", "shm", "hier", "staged", "ipc", "gloo", "nccl")

IMPL = declare(
    "MPX_COLLECTIVES_IMPL",
    "str",
    "auto",
    "implementation of every collective that has no impl= (auto: chosen per call by the "
    "policy): auto, mpi, ring, shm, hier, staged, ipc, gloo, nccl, or one another package "
    "registers (cgx from mpx-quantize)",
    package=_PACKAGE,
)
CHECK = declare(
    "MPX_CHECK",
    "choice",
    "auto",
    "cross-rank check of every collective call (op, dtype, element count, reduce op, root): "
    "auto compares on the node's shared-memory call board (one MPI allgather across nodes); "
    "1 compares through MPI always; 0 none",
    package=_PACKAGE,
    choices=("auto", "1", "0"),
)
TIMEOUT: Setting[float | None] = declare(
    "MPX_TIMEOUT",
    "seconds",
    None,
    "default timeout of every operation: CollectiveTimeout instead of a hang",
    package=_PACKAGE,
    unit="s",
)
SMALL_BYTES = declare(
    "MPX_AUTO_SMALL_BYTES",
    "size",
    512 << 10,
    "built-in policy: messages below this go to MPI's own collectives (512K: on this "
    "project's 2-core machine, tuning found MPI's own faster than shm at 256 KiB in every run)",
    package=_PACKAGE,
    unit="bytes",
    minimum=0,
)
POLICY_FILE = declare(
    "MPX_POLICY_FILE",
    "str",
    "",
    "tuned policy that impl='auto' reads (default: the file mpxrun --tune writes, see "
    "mpx.collectives.core.policy; none: the built-in rules)",
    package=_PACKAGE,
)
XDG_CACHE_HOME = declare(
    "XDG_CACHE_HOME",
    "str",
    "",
    "the default tuned policy lives in $XDG_CACHE_HOME/mpx (~/.cache/mpx when unset)",
    package=_PACKAGE,
)
RING_CHUNK = declare(
    "MPX_RING_CHUNK_BYTES",
    "size",
    1 << 20,
    "bytes per message of the ring algorithm",
    package=_PACKAGE,
    unit="bytes",
    minimum=4096,
)
SHM_SLOT = declare(
    "MPX_SHM_SLOT_MB",
    "size",
    16 << 20,
    "bytes per shared-memory slot of shm and hier (two per rank); unset: 2 MiB "
    "(cache-sized pieces), 16 MiB where ranks outnumber cores",
    package=_PACKAGE,
    unit="MiB",
    minimum=64,
)
STAGED_CHUNK = declare(
    "MPX_STAGED_CHUNK_MB",
    "size",
    4 << 20,
    "bytes per chunk staged through pinned host memory (CUDA tensors)",
    package=_PACKAGE,
    unit="MiB",
    minimum=4096,
)
IPC_BYTES = declare(
    "MPX_AUTO_IPC_BYTES",
    "size",
    4 << 20,
    "built-in policy: CUDA allreduce and broadcast of this many bytes or more go through "
    "CUDA IPC when every rank is on one node and sees the same GPUs (4M: on an H200, ipc "
    "costs ~0.9 ms a call and staged wins up to ~3 MiB; 0: never ipc)",
    package=_PACKAGE,
    unit="bytes",
    minimum=0,
)
IPC_SLOT = declare(
    "MPX_IPC_SLOT_MB",
    "size",
    16 << 20,
    "bytes per CUDA IPC device slot (two per rank)",
    package=_PACKAGE,
    unit="MiB",
    minimum=256,
)
CUDA_AWARE = declare(
    "MPX_CUDA_AWARE",
    "bool",
    False,
    "the MPI library takes CUDA buffers: CUDA tensors go to MPI directly, not staged",
    package=_PACKAGE,
)
PROGRESS_THREAD = declare(
    "MPX_PROGRESS_THREAD",
    "bool",
    True,
    "a background thread drives asynchronous operations (needs MPI_THREAD_MULTIPLE)",
    package=_PACKAGE,
)
WAIT = declare(
    "MPX_WAIT",
    "choice",
    "auto",
    "how a blocking operation waits: spin (MPI's own wait, lowest latency), yield (poll, "
    "sleeping between polls: frees the core), auto (yield when this node's ranks outnumber "
    "the cores a rank may use)",
    package=_PACKAGE,
    choices=("auto", "spin", "yield"),
)
RANKS_PER_NODE: Setting[int | None] = declare(
    "MPX_RANKS_PER_NODE",
    "int",
    None,
    "pretend every k consecutive world ranks form a node (tests hierarchical code on one host)",
    package=_PACKAGE,
    minimum=1,
)

BUILD_CYTHON = declare(
    "MPX_COLLECTIVES_CYTHON",
    "choice",
    "AUTO",
    "compile the small-call fast path with Cython: AUTO (if Cython and a C compiler work, "
    "else pure Python), ON (required) or OFF",
    package=_PACKAGE,
    choices=("AUTO", "ON", "OFF"),
    when="build",
)


def cuda_visible_devices() -> str | None:
    """``CUDA_VISIBLE_DEVICES`` as the process has it now, or None where unset.

    Read afresh at each call, not cached like the ``MPX_*`` settings: it is
    torch's and CUDA's variable, which a launcher or a test sets per process
    before making a communicator (``Communicator.gpus_shared`` compares it).
    """
    return os.environ.get("CUDA_VISIBLE_DEVICES")
