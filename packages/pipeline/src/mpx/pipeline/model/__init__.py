"""The model and how it is cut into stages: what one stage holds and runs.

What lives here: ``partition`` (an ``nn.Sequential`` cut into contiguous
stages: the balance checked, :func:`balance_by_time` and
:func:`split_times`, weights tied across stages), ``stage`` (:class:`Stage`:
one rank's layers, how a micro-batch runs through them, the dropout seeds,
BatchNorm's statistics around a recomputation), ``border`` (what crosses a
stage border: any structure of tensors, flattened, cut into micro-batches and
put back together), ``skip`` (skip connections across stages: ``skippable``,
``stash``, ``pop``) and ``keyed`` (:class:`Keyed`: a model of ordinary modules
as a sequence of layers). Nothing here sends a message or knows a schedule.

What it may import: ``mpx.pipeline.errors`` and ``mpx.pipeline._torch_private``,
and torch. Not ``schedules``, ``split_backward`` or ``staleness``: the roles
beside it. ``runtime`` and the ``Pipeline`` build on it, through this
``__init__``.
"""

from mpx.pipeline.model.border import Spec, carries_grad, concat, flatten, split, unflatten
from mpx.pipeline.model.keyed import Keyed
from mpx.pipeline.model.partition import (
    balance_by_time,
    check_balance,
    layer_times,
    split_times,
    stage_bounds,
    tied_groups,
)
from mpx.pipeline.model.skip import pop, skippable, stash
from mpx.pipeline.model.stage import Stage, Weights, layer_seed

__all__ = [
    "Keyed",
    "Spec",
    "Stage",
    "Weights",
    "balance_by_time",
    "carries_grad",
    "check_balance",
    "concat",
    "flatten",
    "layer_seed",
    "layer_times",
    "pop",
    "skippable",
    "split",
    "split_times",
    "stage_bounds",
    "stash",
    "tied_groups",
    "unflatten",
]
