"""mpx-pipeline: pipeline-parallel training over MPI.

GPipe, 1F1B (PipeDream-flush) and the asynchronous 1F1B with weight stashing,
weight prediction and gap-aware penalties; one stage of an ``nn.Sequential``
per rank (stage borders of any structure of tensors, skip connections with
``skippable``/``stash``/``pop``, models of ordinary modules through ``Keyed``,
tied weights), activations and gradients sent point to point through mpx.collectives.

Every public name is here; the subpackages hold the roles (see the README's
Layout): ``schedules`` (schedules as data: the table, orders, zero bubble, the
async layout), ``model`` (the model cut into stages), ``split_backward`` (``I``
and ``W``), ``staleness`` (weight prediction, gap aware) and ``runtime`` (what
runs a call), under ``pipeline`` (the :class:`Pipeline`) and
``build_agreement``; ``errors`` and ``_torch_private`` are the base every role
stands on.

Example::

    pipe = Pipeline(nn.Sequential(*layers), balance=[3, 3], chunks=4, schedule="1f1b")
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    loss = pipe.step(x, y, nn.functional.cross_entropy, opt)
"""

from importlib import metadata as _metadata

from mpx.pipeline.errors import (
    PipelineError,
    PipelineMismatchError,
    PipelineRemoteError,
    PipelineTypeError,
    PipelineValueError,
)
from mpx.pipeline.model import (
    Keyed,
    balance_by_time,
    layer_seed,
    pop,
    skippable,
    split_times,
    stash,
)
from mpx.pipeline.pipeline import CHECKPOINTS, Pipeline
from mpx.pipeline.schedules import SCHEDULES, bubble_fraction, grid

__all__ = [
    "CHECKPOINTS",
    "SCHEDULES",
    "Keyed",
    "Pipeline",
    "PipelineError",
    "PipelineMismatchError",
    "PipelineRemoteError",
    "PipelineTypeError",
    "PipelineValueError",
    "__version__",
    "balance_by_time",
    "bubble_fraction",
    "grid",
    "layer_seed",
    "pop",
    "skippable",
    "split_times",
    "stash",
]

# pyproject.toml's version, as installed: the one place it is written.
__version__ = _metadata.version("mpx-pipeline")
