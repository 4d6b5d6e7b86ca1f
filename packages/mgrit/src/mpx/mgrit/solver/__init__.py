"""MGRIT itself: the multilevel time grid, split across ranks, and the FAS cycles on it.

What lives here: ``solver`` (:class:`MGRIT`: V- and F-cycles, relaxation, the
coarsest level's solve), ``grid`` (the levels and their split into blocks, one
per rank: :class:`Layout`), ``options`` (:class:`MGRITOptions`: the settings,
checked once), ``ghosts`` (ghost rows between neighbouring blocks: the one
exchange relaxation needs), ``boundaries`` (what crosses ranks on each level,
and in which form) and ``sequential`` (the loops MGRIT cannot batch). Nothing
here knows a network.

What it may import: ``mpx.mgrit.errors``, ``mpx.mgrit._comm`` (the ``comm=``
argument) and mpx-collectives. The networks' machinery (``adjoint``), the
networks (``resnet``, ``gru``) and the performance model (``model``) build on
it, through this ``__init__``.
"""

from mpx.mgrit.solver.grid import Layout, coarsening_factors, fine_blocks
from mpx.mgrit.solver.options import MGRITOptions, MGRITSettings, check_int, resolve
from mpx.mgrit.solver.solver import MGRIT, Step

__all__ = [
    "MGRIT",
    "Layout",
    "MGRITOptions",
    "MGRITSettings",
    "Step",
    "check_int",
    "coarsening_factors",
    "fine_blocks",
    "resolve",
]
