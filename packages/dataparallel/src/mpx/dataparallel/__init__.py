"""mpx-dataparallel: data-parallel training over MPI, with FluxMPI's API.

Example::

    import mpx.dataparallel as dp
    dp.init(); model = dp.synchronize(model)
    opt = dp.DistributedOptimizer(torch.optim.Adam(model.parameters()), model)
"""

from importlib import metadata as _metadata

from mpx.dataparallel.async_sgd import EASGD, DownpourSGD
from mpx.dataparallel.checkpoint import load_checkpoint, save_checkpoint
from mpx.dataparallel.data import DistributedDataContainer
from mpx.dataparallel.errors import (
    DataParallelError,
    DataParallelMismatchError,
    DataParallelRemoteError,
    DataParallelTypeError,
    DataParallelValueError,
    ParameterServerError,
)
from mpx.dataparallel.ft_optimizer import FaultTolerantOptimizer
from mpx.dataparallel.gradients import allreduce_gradients
from mpx.dataparallel.optimizer import DistributedOptimizer
from mpx.dataparallel.parameter_server import RULES, ParameterServer, PSHandle
from mpx.dataparallel.resume import ResumePoint, latest_checkpoint, resume, save_resumable
from mpx.dataparallel.runtime import init, is_root, local_rank, rank, world_size
from mpx.dataparallel.synchronize import broadcast_tensors, synchronize

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
