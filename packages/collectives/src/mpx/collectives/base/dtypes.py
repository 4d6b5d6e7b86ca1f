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
    float16    float16           float32 (a copy), rounded back once at the end
    bfloat16   int16 (the bits)  float32 (a copy), rounded back once at the end

MPI is never asked to sum float16, though MPICH can: it converts element by
element in scalar code (a 74k-element sum at 2 ranks took 2.2-3.2 ms, against
0.2-0.5 ms for torch's vectorized conversion to float32, the float32 sum and
the conversion back), and it rounds to float16 after every pairwise step, so
at 3 ranks ``1 + 2**-11 + 2**-11`` came out 1.0 or 1.0009765625 depending on
which rank held the 1. mpx's own implementations (mpi, ring, shm, staged,
ipc, hier) accumulate float16 and bfloat16 in float32 and round once: the
result is the exact sum rounded to the dtype, whatever the order (gloo, and
so ``impl="gloo"``, rounds after every step of its ring; at 2 ranks both
round once and agree bitwise).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mpx.collectives.base.errors import MPXTypeError, MPXValueError

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


class _Memory:
    """``t``'s memory as numpy's array interface; the array it makes keeps ``t`` alive.

    ``t.numpy()`` (and ``np.asarray(t)``) marks ``t``'s storage as not
    resizable for good -- numpy might hold its pointer -- so a user's tensor
    that went through a collective could no longer be ``resize_``d (DDP's
    bucket buffers, torch's batched PowerSGD hook); gloo leaves it resizable.
    Handing numpy the address changes nothing on the tensor.
    """

    __slots__ = ("__array_interface__", "tensor")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t  # numpy keeps this object as the array's base: t outlives the array
        size = t.element_size()
        self.__array_interface__ = {
            "version": 3,
            "shape": tuple(t.shape),
            "typestr": _numpy_dtype(t.dtype).str,
            "data": (t.data_ptr(), False),
            "strides": tuple(stride * size for stride in t.stride()),
        }


_NUMPY_DTYPES: dict[torch.dtype, np.dtype[Any]] = {}


def _numpy_dtype(dtype: torch.dtype) -> np.dtype[Any]:
    found = _NUMPY_DTYPES.get(dtype)
    if found is None:
        # torch's own mapping, read off a fresh tensor (marking it is harmless).
        found = _NUMPY_DTYPES[dtype] = torch.empty(0, dtype=dtype).numpy().dtype
    return found


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """A numpy array sharing ``t``'s memory (CPU tensors; bfloat16 as int16).

    Unlike ``t.numpy()`` it leaves ``t`` as it was: its storage stays
    resizable (see :class:`_Memory`), as gloo leaves the tensors it moves.
    """
    if t.device.type != "cpu":
        raise MPXTypeError(f"numpy_view needs a CPU tensor, got one on {t.device}")
    return np.asarray(_Memory(wire_view(t.detach())))


def mpi_reduces(dtype: torch.dtype) -> bool:
    """Whether mpx hands this dtype to MPI's reductions as it is (not the 16-bit floats).

    float16 and bfloat16 go to MPI as float32 copies (see the module
    docstring: faster than MPICH's float16 sum, and rounded once).
    """
    return dtype not in (torch.float16, torch.bfloat16)


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
