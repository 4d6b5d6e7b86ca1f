"""mpx-mgrit: MGRIT parallel-in-time solver and layer-parallel training of residual networks.

Example::

    from mpx.mgrit import MGRIT
    solver = MGRIT(lambda u, t, dt: u / (1 + dt), 0.0, 5.0, nt=100, levels=2)
    u_final = solver.solve(torch.ones(1, dtype=torch.float64)); print(solver.residuals)

Every public name is here; the subpackages hold the roles (see the README's
Layout): ``solver`` (MGRIT: the grid, the cycles, the options), ``adjoint``
(differentiating through it: the time stepper both networks run on, their
batched steps, the halos, the work count) and the networks on it, ``resnet``
(``LayerParallel``, torchbraid's setters, ``refine``, replicas) and ``gru``
(``ParallelGRU``), over ``_comm`` (the ``comm=`` argument) and ``errors``.
``model`` is the performance model (``mpx.mgrit.model``); ``_torch_private``
the one module that reads private torch APIs; ``halo`` the public path of
``adjoint/halo.py``.
"""

from importlib import metadata as _metadata

from mpx.mgrit.adjoint import WORK_KINDS, work
from mpx.mgrit.errors import MGRITConfigError, MGRITError, MGRITTypeError
from mpx.mgrit.gru import ParallelGRU
from mpx.mgrit.resnet import LayerParallel, ReplicaGroups, SerialResNet, refine, split_replicas
from mpx.mgrit.solver import MGRIT, MGRITOptions, Step

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
