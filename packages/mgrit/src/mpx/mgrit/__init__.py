"""mpx-mgrit: MGRIT parallel-in-time solver and layer-parallel training of residual networks.

Example::

    from mpx.mgrit import MGRIT
    solver = MGRIT(lambda u, t, dt: u / (1 + dt), 0.0, 5.0, nt=100, levels=2)
    u_final = solver.solve(torch.ones(1, dtype=torch.float64)); print(solver.residuals)
"""

from importlib import metadata as _metadata

from mpx.mgrit.errors import MGRITConfigError, MGRITError, MGRITTypeError
from mpx.mgrit.gru import ParallelGRU
from mpx.mgrit.layer_parallel import LayerParallel, SerialResNet
from mpx.mgrit.options import MGRITOptions
from mpx.mgrit.refine import refine
from mpx.mgrit.replicas import ReplicaGroups, split_replicas
from mpx.mgrit.solver import MGRIT, Step
from mpx.mgrit.work import WORK_KINDS, work

__all__ = [
    "MGRIT",
    "WORK_KINDS",
    "LayerParallel",
    "MGRITConfigError",
    "MGRITError",
    "MGRITOptions",
    "MGRITTypeError",
    "ParallelGRU",
    "ReplicaGroups",
    "SerialResNet",
    "Step",
    "__version__",
    "refine",
    "split_replicas",
    "work",
]

# pyproject.toml's version, as installed: the one place it is written.
__version__ = _metadata.version("mpx-mgrit")
