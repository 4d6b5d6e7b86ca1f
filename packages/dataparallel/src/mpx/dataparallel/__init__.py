"""mpx-dataparallel: data-parallel training over MPI, with FluxMPI's API.

Example::

    import mpx.dataparallel as dp
    dp.init(); model = dp.synchronize(model)
    opt = dp.DistributedOptimizer(torch.optim.Adam(model.parameters()), model)

Every public name is here; the subpackages hold the roles (see the README's
Layout): ``synchronous`` (FluxMPI's data parallelism), ``asynchronous``
(TorchMPI's parameter server, Downpour, EASGD), ``checkpoints`` (agreed
checkpoints, resuming after a restart) and ``recovery`` (live recovery across
replica groups), over ``runtime`` (``init`` and the rank queries) and
``errors``, which every role uses. ``fluxmpi`` is FluxMPI.jl's names with
FluxMPI's meanings, for ported code.
"""

from importlib import metadata as _metadata

from mpx.dataparallel.asynchronous import EASGD, RULES, DownpourSGD, ParameterServer, PSHandle
from mpx.dataparallel.checkpoints import (
    ResumePoint,
    latest_checkpoint,
    load_checkpoint,
    resume,
    save_checkpoint,
    save_resumable,
)
from mpx.dataparallel.errors import (
    DataParallelError,
    DataParallelMismatchError,
    DataParallelRemoteError,
    DataParallelTypeError,
    DataParallelValueError,
    ParameterServerError,
)
from mpx.dataparallel.recovery import FaultTolerantOptimizer, TrainingFinished
from mpx.dataparallel.runtime import init, is_root, local_rank, rank, world_size
from mpx.dataparallel.synchronous import (
    DistributedDataContainer,
    DistributedOptimizer,
    allreduce_gradients,
    broadcast_tensors,
    synchronize,
)

__all__ = [
    "EASGD",
    "RULES",
    "DataParallelError",
    "DataParallelMismatchError",
    "DataParallelRemoteError",
    "DataParallelTypeError",
    "DataParallelValueError",
    "DistributedDataContainer",
    "DistributedOptimiser",
    "DistributedOptimizer",
    "DownpourSGD",
    "FaultTolerantOptimizer",
    "PSHandle",
    "ParameterServer",
    "ParameterServerError",
    "ResumePoint",
    "TrainingFinished",
    "__version__",
    "allreduce_gradients",
    "broadcast_tensors",
    "init",
    "is_root",
    "latest_checkpoint",
    "load_checkpoint",
    "local_rank",
    "rank",
    "resume",
    "save_checkpoint",
    "save_resumable",
    "synchronize",
    "total_workers",
    "world_size",
]

# FluxMPI's spellings.
DistributedOptimiser = DistributedOptimizer
"""FluxMPI's spelling of :class:`DistributedOptimizer`."""
total_workers = world_size
"""FluxMPI's name of :func:`world_size`."""

# pyproject.toml's version, as installed: the one place it is written.
__version__ = _metadata.version("mpx-dataparallel")
