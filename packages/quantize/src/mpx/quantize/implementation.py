"""``impl="cgx"``: mpx-quantize's compressed allreduce as an implementation of mpx-collectives.

mpx-quantize registers it in mpx-collectives' registry through the
``mpx.collectives.implementations`` entry point (its pyproject.toml), so after
``pip install mpx-quantize`` any allreduce can name it::

    from mpx.collectives import allreduce
    allreduce(grad, "avg", impl="cgx")          # MPX_QUANTIZE_* / CGX_COMPRESSION_* settings
    MPX_COLLECTIVES_IMPL=cgx python train.py    # every allreduce without impl=

It quantizes with :meth:`CompressionConfig.from_env` (CGX's defaults when
only CGX's variables are set: 32 bits, no compression). ``auto`` never picks
it: it is lossy, so only the user may choose it. Ops other than allreduce
fall back to ``mpi`` (CPU tensors) or ``staged`` (CUDA ones), as for any
implementation that does not provide them.

The quantized allreduce is itself an alltoall and an allgather, so it runs
whole when the call's turn comes (:func:`mpx.collectives.building_blocks.blocking`),
on a private duplicate of the communicator: the communicator that called is
busy with this very operation.
"""

from __future__ import annotations

import torch

from mpx.collectives import Communicator
from mpx.collectives.building_blocks import Implementation, blocking
from mpx.quantize.reduction import CompressionConfig
from mpx.quantize.reduction import allreduce as quantized_allreduce

__all__ = ["CGX", "allreduce"]

CGX = Implementation(
    name="cgx",
    module="mpx.quantize.implementation",
    provides=frozenset({"allreduce"}),
    devices=frozenset({"cpu", "cuda"}),
    automatic=False,
    summary="CGX's quantized allreduce (mpx-quantize; MPX_QUANTIZE_*/CGX_* settings)",
    # The compressed allreduce sums (and averages) only: impl="cgx" with another
    # op is refused before anything moves; under MPX_COLLECTIVES_IMPL=cgx such a
    # call (a max of a metric) runs as auto's.
    reduce_ops=frozenset({"sum", "avg"}),
)
"""The registry's entry (the ``mpx.collectives.implementations`` entry point names it)."""

_PRIVATE = "mpx.quantize.cgx"  # the communicator's cache key of its private duplicate


@blocking
def allreduce(comm: Communicator, t: torch.Tensor, op: str) -> torch.Tensor:
    """The registry's op function: ``t`` reduced in place with quantized communication."""
    private = comm.cached(_PRIVATE)
    if private is None:
        # Collective: every rank of comm reaches this call at the same place in
        # its order of operations, the first time it names impl="cgx".
        private = comm.cache(_PRIVATE, Communicator.from_mpi(comm.mpi, comm.timeout))
    return quantized_allreduce(t, private, op=op, config=CompressionConfig.from_env())
