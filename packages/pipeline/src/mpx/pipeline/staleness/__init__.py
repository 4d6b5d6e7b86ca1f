"""What makes stale gradients usable (``schedule="async"``): optimizer arithmetic alone.

What lives here: ``prediction`` (weight prediction: the weights a stage will
have ``d`` optimizer steps from now, from the optimizer's state: ``msnag``
and its kin, :func:`predict`, :func:`future_lrs`) and ``gap_aware``
(:class:`GapAware`: gradients damped by the gap between the weights they were
computed on and the current ones). Both read an optimizer's state and a
model's tensors; neither knows a stage, a schedule or a message.

What it may import: ``mpx.pipeline.errors`` only, and torch. Not ``model``,
``schedules`` or ``split_backward``: the roles beside it. The asynchronous
stream's hooks (``runtime``'s ``stale``) use it, through this ``__init__``.
"""

from mpx.pipeline.staleness.gap_aware import GAP_AWARE, GapAware
from mpx.pipeline.staleness.prediction import PREDICTIONS, future_lrs, predict

__all__ = ["GAP_AWARE", "PREDICTIONS", "GapAware", "future_lrs", "predict"]
