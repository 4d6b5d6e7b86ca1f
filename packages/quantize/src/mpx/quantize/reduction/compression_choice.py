"""Compression that pays or steps aside: ``CompressionConfig(when="auto")``.

Quantizing costs compute (quantize, dequantize-add, re-quantize, dequantize)
to save bytes on the link. Across nodes on a slow network that wins; over
shared memory on one node the copy is cheaper than the quantizer (a 4-bit
step of bench_dataparallel took 80 ms where fp32 took 50). With
``when="auto"`` the first compressible buffer of each size is reduced both
ways, on scratch copies, before its real reduction::

    rounds x  [ barrier | plain allreduce | barrier | compressed allreduce ]
    each rank's best time of each, then the slowest rank's (one allreduce MAX)
    compressed  iff  compressed time < (1 - MARGIN) x plain time

Every rank decides from the same two numbers, so every rank takes the same
path. The decision is kept in the :class:`~mpx.quantize.QuantizeState`
(``state.choices``, by size, dtype, device and op) for the rest of the run:
the link and the kernels do not change during a job. The scratch runs use a
state of their own, so the real state's rounding generator, residuals and
byte counters are as if nothing had been measured: a buffer ``auto``
compresses gets the same bits ``when="always"`` gives it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING

import torch

from mpx.quantize.reduction.state import Choice, QuantizeState

if TYPE_CHECKING:
    from mpx.collectives import Communicator
    from mpx.quantize.reduction.config import CompressionConfig

__all__ = ["MARGIN", "ROUNDS", "Reduce", "choose"]

ROUNDS = 3
"""Timed rounds of each path; the best of them counts (the others saw the noise)."""

MARGIN = 0.1
"""How much faster compression must be to be taken: it changes the numbers, so it
must win clearly, not by the noise of one measurement."""


Reduce = Callable[[torch.Tensor, QuantizeState], None]
"""One path's allreduce of a flat buffer in place, with the state it may update."""


def choose(
    flat: torch.Tensor,
    comm: Communicator,
    config: CompressionConfig,
    op: str,
    state: QuantizeState,
    agreed: Mapping[str, Hashable],
    plain: Reduce,
    compressed: Reduce,
) -> Choice:
    """The path for ``flat`` (measured once per size, dtype, device and op; see the module).

    ``agreed``: the fields the compressed allreduce compares across ranks, compared
    here first: a rank with ``when="always"`` would otherwise run the compressed
    allreduce against this rank's measurement.
    """
    key: Hashable = (flat.numel(), flat.dtype, flat.device.type, op)
    found = state.choices.get(key)
    if found is None:
        comm.check_same("quantized allreduce", agreed)
        found = state.choices[key] = _measure(flat, comm, config, plain, compressed)
    return found


def _measure(
    flat: torch.Tensor,
    comm: Communicator,
    config: CompressionConfig,
    plain: Reduce,
    compressed: Reduce,
) -> Choice:
    from mpx.collectives import allreduce, barrier

    # A state of its own: no residuals, its own generator and counters.
    scratch_state = QuantizeState(config.with_(error_feedback=False), comm)
    best = [float("inf"), float("inf")]
    for _ in range(ROUNDS):
        for path, reduce in enumerate((plain, compressed)):
            scratch = flat.clone()
            barrier(comm=comm)  # every rank starts together: the time is the link's
            began = time.perf_counter()
            reduce(scratch, scratch_state)
            if scratch.is_cuda:
                torch.cuda.synchronize(scratch.device)
            best[path] = min(best[path], time.perf_counter() - began)
    slowest = allreduce(torch.tensor(best, dtype=torch.float64), "max", comm=comm)
    plain_s, compressed_s = (float(x) for x in slowest.tolist())
    return Choice(compressed_s < (1 - MARGIN) * plain_s, plain_s, compressed_s)
