"""What runs a call: the one executor, a rank's passes, the traffic, failing together.

What lives here: ``runtime`` (:class:`Runtime`: a ``Pipeline``'s calls run,
undone when they fail, and timed for the zero-bubble layouts), ``executor``
(one loop over any schedule's list of actions, and the synchronous
schedules' hooks), ``passes`` (:class:`StagePasses`: one rank's forwards,
backwards, input and weight gradients over micro-batches), ``transport``
(activations and gradients between neighbouring stages over mpx-collectives'
``Channel``), ``failure`` (every stage raises the same error and settles its
links), ``stale`` (:class:`AsyncHooks`: what the asynchronous stream adds to
the executor: weight stashing, prediction, gap-aware damping, its optimizer
steps), ``inputs`` (a call's inputs and targets cut into micro-batches) and
``replicas`` (:class:`ReplicaGradients`: a stage's gradients averaged over
its replicas, exact or quantized).

What it may import: ``mpx.pipeline.schedules``, ``mpx.pipeline.model``,
``mpx.pipeline.split_backward`` and ``mpx.pipeline.staleness``, each through
its ``__init__``; ``mpx.pipeline.errors``; mpx-collectives, and mpx-quantize
only lazily (the optional extra). Not ``mpx.pipeline.pipeline``: the
``Pipeline`` builds on this role, through this ``__init__``.
"""

from mpx.pipeline.runtime.passes import LossFn, StagePasses
from mpx.pipeline.runtime.replicas import ReplicaGradients, compression_config, model_names
from mpx.pipeline.runtime.runtime import MEASURE_AT, MEASURE_CALLS, AsyncOptions, Runtime
from mpx.pipeline.runtime.stale import AsyncHooks
from mpx.pipeline.runtime.transport import wait_for

__all__ = [
    "MEASURE_AT",
    "MEASURE_CALLS",
    "AsyncHooks",
    "AsyncOptions",
    "LossFn",
    "ReplicaGradients",
    "Runtime",
    "StagePasses",
    "compression_config",
    "model_names",
    "wait_for",
]
