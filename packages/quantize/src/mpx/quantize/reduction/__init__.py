"""The compressed allreduce: CGX's scatter-reduce-allgather over mpx-collectives.

What lives here: ``config`` (:class:`CompressionConfig`, the ``MPX_QUANTIZE_*``
/ ``CGX_*`` settings read into it, and the layer registry behind
:func:`register_model` / :func:`exclude_layer`), ``state``
(:class:`QuantizeState`: communicator, generator, error-feedback residuals,
the ``when="auto"`` choices), ``compression_choice`` (how ``when="auto"``
decides, measured), ``compressed_allreduce`` (:func:`allreduce` and
:func:`allreduce_tensors`: the algorithm in one module; not named
``allreduce``, so that ``allreduce`` here is the function) and ``ddp``
(:func:`ddp_comm_hook`, the same allreduce as a DDP communication hook).

What it may import: ``mpx.quantize.codec`` (through its ``__init__``),
``mpx.quantize.errors`` and ``mpx.quantize.settings``; mpx-collectives only
inside functions (``import mpx.quantize`` starts no MPI) and mpx-launch's
settings. Not ``cgx``: the CGX compatibility builds on this one, through this
``__init__``.
"""

from mpx.quantize.reduction import compression_choice
from mpx.quantize.reduction.compressed_allreduce import allreduce, allreduce_tensors
from mpx.quantize.reduction.config import (
    MIN_COMPRESSED,
    CompressionConfig,
    LayerRegistry,
    exclude_layer,
    register_model,
    registry,
)
from mpx.quantize.reduction.ddp import ddp_comm_hook
from mpx.quantize.reduction.state import Choice, QuantizeState

__all__ = [
    "MIN_COMPRESSED",
    "Choice",
    "CompressionConfig",
    "LayerRegistry",
    "QuantizeState",
    "allreduce",
    "allreduce_tensors",
    "compression_choice",
    "ddp_comm_hook",
    "exclude_layer",
    "register_model",
    "registry",
]
