"""A call's inputs and targets cut into micro-batches, alike on every rank.

Training cuts a batch into ``chunks`` equal micro-batches (the loss is their
mean); evaluation takes any batch size, and only rank 0 (stage 0) reads the
inputs, so it tells every rank how many micro-batches the call has.
"""

from __future__ import annotations

from typing import Any

import torch

from mpx.collectives import Communicator, broadcast
from mpx.pipeline.errors import PipelineValueError
from mpx.pipeline.model import flatten, unflatten
from mpx.pipeline.model import split as split_border

__all__ = ["eval_parts", "split"]


def split(t: Any, what: str, needed: bool, chunks: int, rank: int, parts: int = 0) -> list[Any]:
    """``t`` in ``chunks`` equal micro-batches (training), or in ``parts`` (evaluation).

    Evaluation takes any batch size: ``tensor_split`` makes ``parts``
    micro-batches whose sizes differ by at most one (the last ones shorter).

    Args:
        needed: this rank (``rank``) reads ``what``; elsewhere it is ignored.

    Raises:
        PipelineValueError: ``t`` is None where it is needed, or does not split.
    """
    if t is None or not needed:
        if needed:
            raise PipelineValueError(
                f"{what} is None on stage {rank}, which reads it; pass {what} on this rank"
            )
        return []
    if not parts:
        # Training keeps equal micro-batches: the loss is their mean.
        return split_border(t, chunks, what)
    tensors, spec = flatten(t, what)
    cut = [x.tensor_split(parts) for x in tensors]
    return [unflatten(spec, [c[k] for c in cut]) for k in range(parts)]


def eval_parts(inputs: Any, first: bool, chunks: int, comm: Communicator) -> int:
    """The micro-batches of an evaluation call, from rank 0 (stage 0) to every rank.

    ``chunks``, or the batch size where it is smaller; 0 where rank 0's inputs
    are bad (rank 0 raises, the others run nothing). Only rank 0 reads the
    inputs, so the others learn the count from it.

    Args:
        first: this rank holds the first stage (rank 0).
    """
    count = torch.zeros(1, dtype=torch.int64)
    error: Exception | None = None
    if first:
        try:
            if inputs is None:
                split(inputs, "inputs", True, chunks, comm.rank)  # its error
            tensors, _ = flatten(inputs, "inputs")
            sizes = [x.shape[0] if x.dim() else 0 for x in tensors]
            if sizes and min(sizes) < 1:
                raise PipelineValueError(
                    f"inputs has a tensor of batch size {min(sizes)} (shapes "
                    f"{[tuple(x.shape) for x in tensors]}); evaluation cuts every tensor "
                    "along dim 0 into micro-batches: pass tensors of at least one sample"
                )
            count[0] = min([chunks, *sizes])
        except Exception as bad:  # raised after the count, so no rank waits for it
            error = bad
    broadcast(count, 0, comm=comm)
    if error is not None:
        raise error
    return int(count[0])
