"""torch dtypes on the wire: what MPI can reduce and how everything else travels.

MPI knows float32/float64/int32/int64/uint8, and (MPICH) float16; it has no
bfloat16 (mpi4py sends it as MPI_BYTE, which cannot be reduced). So::

    dtype      moves as          MPI reduces it as
    ---------  ----------------  ----------------------------------------------
    float32    float32           float32
    float64    float64           float64
    int32      int32             int32
    int64      int64             int64
    uint8      uint8             uint8
    float16    float16           float16 if the MPI library can, else float32
    bfloat16   int16 (the bits)  float32, rounded back once at the end

mpx's own reductions (ring, shm) accumulate float16 and bfloat16 in float32.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from mpx.collectives.errors import MPXTypeError, MPXValueError

__all__ = [
    "REDUCE_OPS",
    "SUPPORTED_DTYPES",
    "accumulation_dtype",
    "check_op_for_dtype",
    "is_floating",
    "mpi_reduces",
    "numpy_view",
    "wire_view",
]

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.uint8,
)
REDUCE_OPS = ("sum", "avg", "max", "min", "prod")

# bfloat16 has no numpy type: its bits travel as int16.
_WIRE = {torch.bfloat16: torch.int16}


def is_floating(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point


def wire_view(t: torch.Tensor) -> torch.Tensor:
    """The same memory as a dtype numpy and MPI know (bfloat16 → int16)."""
    wire = _WIRE.get(t.dtype)
    return t.view(wire) if wire is not None else t


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """A numpy array sharing ``t``'s memory (CPU tensors; bfloat16 as int16)."""
    return wire_view(t.detach()).numpy()


@functools.cache
def mpi_reduces(dtype: torch.dtype) -> bool:
    """Whether the MPI library reduces this dtype itself (probed once)."""
    if dtype == torch.bfloat16:
        return False
    if dtype != torch.float16:
        return True
    from mpi4py import MPI

    probe = np.ones(2, dtype=np.float16)
    try:
        MPI.COMM_SELF.Allreduce(MPI.IN_PLACE, probe, op=MPI.SUM)
    except MPI.Exception:
        return False
    return True


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums are accumulated in: float32 for the 16-bit floats."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def check_op_for_dtype(op: str, dtype: torch.dtype) -> None:
    """Raises for a reduction that has no meaning for the dtype."""
    if op not in REDUCE_OPS:
        raise MPXValueError(f"op must be one of {', '.join(REDUCE_OPS)}, got {op!r}")
    if op == "avg" and not dtype.is_floating_point:
        raise MPXTypeError(
            f"op='avg' needs a floating dtype, got {dtype}; use op='sum' and divide, "
            "or convert with t.to(torch.float32)"
        )
