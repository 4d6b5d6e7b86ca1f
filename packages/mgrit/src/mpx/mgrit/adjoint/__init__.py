"""Differentiating through MGRIT: the machinery both networks run on.

What lives here: ``stepper`` (:class:`TimeStepper`: a network's forward solve
and its adjoint, a second MGRIT solve backwards, as one autograd function; the
work it counts), the batched steps it runs, ``stacked`` (:class:`StackedSteps`:
a residual network's step layers as stacked weights) and ``gru_steps``
(:class:`GRUSteps`: ParallelGRU's cells over the stacked rows, and their
adjoint), ``halo`` (:class:`LayerHalo`, :class:`StateHalo`: what a rank's
boundary steps need from its neighbours) and ``counting`` (:func:`work`: a
network's layer evaluations, from its steppers; not named ``work``, so that
``work`` here is the function). ``gru_steps`` is here, not in
``gru``, because the stepper knows it (its forcing, its batched adjoint).

What it may import: ``mpx.mgrit.solver`` (through its ``__init__``),
``mpx.mgrit._comm``, ``mpx.mgrit.errors``, ``mpx.mgrit._torch_private``
(``stacked`` reads a private torch API through it) and mpx-collectives. Not
``resnet`` or ``gru``: the networks build on this one, through this
``__init__``. ``mpx.mgrit.adjoint`` was one module before issue 57 (now
``stepper``): ``TimeStepper`` and ``WORK_KINDS`` still import from it.
"""

from mpx.mgrit.adjoint.counting import work
from mpx.mgrit.adjoint.gru_steps import GRUSteps
from mpx.mgrit.adjoint.halo import LayerHalo, StateHalo
from mpx.mgrit.adjoint.stacked import StackedSteps
from mpx.mgrit.adjoint.stepper import WORK_KINDS, TimeStepper

__all__ = [
    "WORK_KINDS",
    "GRUSteps",
    "LayerHalo",
    "StackedSteps",
    "StateHalo",
    "TimeStepper",
    "work",
]
