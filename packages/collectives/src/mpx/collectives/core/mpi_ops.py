"""MPI's reduction op for each reduce op and dtype: MPI's own, or NaN-propagating max/min.

Whatever hands a reduction to MPI asks :func:`mpi_op` for its op: the ``mpi``
implementation (:mod:`mpx.collectives.impl.mpi`) and the small-call fast
path (:mod:`mpx.collectives.core.fast_path`), so both reduce alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

__all__ = ["MPI_OPS", "mpi_op"]

MPI_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}
"""MPI's own op of each reduce op (:func:`mpi_op` gives it but for floating max/min)."""

# MPI's own MAX and MIN are C's ``a > b ? a : b``: a NaN wins or loses by its
# side of the comparison, and MPICH's allreduce combines the operands in a
# different order on each rank, so a NaN on rank 0 came out NaN on some ranks
# and a number on others -- replicas that silently diverged. Floating max and
# min reduce with np.maximum / np.minimum instead, as a user-defined op: NaN
# wherever any rank has NaN at that element, on every rank, as torch.maximum
# gives on shm and ring (infinities are ordinary extremes). Integers keep
# MPI's own ops (no NaN), and so does every other reduce op (IEEE sums and
# products propagate NaN whatever the order).
_FLOATING_UFUNCS: dict[str, Callable[..., Any]] = {"max": np.maximum, "min": np.minimum}
_NUMPY_FLOATS = {torch.float32: np.float32, torch.float64: np.float64}
_user_ops: dict[tuple[str, torch.dtype], MPI.Op] = {}


def _numpy_op(ufunc: Callable[..., Any], kind: type) -> MPI.Op:
    """An MPI op reducing buffers of numpy ``kind`` with ``ufunc`` (in place into inout)."""

    def reduce(inbuf: Any, inoutbuf: Any, datatype: MPI.Datatype) -> None:
        out: np.ndarray = np.frombuffer(inoutbuf, kind)
        ufunc(np.frombuffer(inbuf, kind), out, out=out)

    # Commutative: which operand is NaN does not matter, and MPI may then use
    # its fastest algorithms (reduce-scatter + allgather for large messages).
    return MPI.Op.Create(reduce, commute=True)


def mpi_op(op: str, dtype: torch.dtype) -> MPI.Op:
    """The MPI op that reduces a buffer of ``dtype`` (as handed to MPI: the 16-bit floats
    arrive as float32 copies) with ``op``: MPI's own, or for floating max/min a
    NaN-propagating one (made on first use, once per process)."""
    if op in _FLOATING_UFUNCS and dtype in _NUMPY_FLOATS:
        found = _user_ops.get((op, dtype))
        if found is None:
            found = _user_ops[(op, dtype)] = _numpy_op(_FLOATING_UFUNCS[op], _NUMPY_FLOATS[dtype])
        return found
    return MPI_OPS[op]
