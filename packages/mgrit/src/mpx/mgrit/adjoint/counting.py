"""The work of a layer-parallel training step, counted in layer evaluations.

A layer evaluation is one step of one state through one layer: a forward step
``x + h f_k(x)``, or a vector-Jacobian product of one. A batched call over the
C-intervals of a rank counts one evaluation per state row it steps. The count
is what the algorithm does (relaxation, restriction, coarse levels, residual,
the final gradient sweep), independent of how fast each evaluation runs, so a
step's time is this count times the cost of one evaluation plus the messages
(see :mod:`mpx.mgrit.model`).

Example::

    loss = net(x).square().sum(); loss.backward()
    work(net)   # {"forward": 880, "adjoint": 880, "linearize": ..., "gradient": 256}
"""

from __future__ import annotations

from typing import Any

from mpx.mgrit.adjoint.stepper import WORK_KINDS
from mpx.mgrit.errors import MGRITTypeError

__all__ = ["WORK_KINDS", "work"]


def work(net: Any) -> dict[str, int]:
    """This rank's layer evaluations in ``net``'s last forward and last backward.

    Args:
        net: a :class:`~mpx.mgrit.LayerParallel` or :class:`~mpx.mgrit.ParallelGRU`.

    Returns:
        counts keyed by :data:`WORK_KINDS`: ``"forward"`` (steps of the forward solve),
        ``"adjoint"`` (vector-Jacobian products of the adjoint solve), ``"linearize"``
        (forward evaluations the backward makes in order to differentiate) and
        ``"gradient"`` (parameter vector-Jacobian products of the final sweep; 0 for a
        ParallelGRU, whose parameter sweep is its own and not counted); summed over the
        layers and directions of a ParallelGRU.
    """
    steppers = getattr(net, "_work_steppers", None)
    if steppers is None:
        raise MGRITTypeError(
            f"work() counts a LayerParallel or a ParallelGRU, got {type(net).__name__}; "
            "pass the network itself"
        )
    total = dict.fromkeys(WORK_KINDS, 0)
    for stepper in steppers():
        for kind in WORK_KINDS:
            total[kind] += stepper.work[kind]
    return total
