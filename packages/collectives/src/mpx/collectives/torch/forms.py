"""The forms torch's tensors take on mpx's wire, for the ``mpx`` torch backend.

mpx's operations take contiguous tensors of the dtypes MPI can reduce
(:data:`mpx.collectives.base.dtypes.SUPPORTED_DTYPES`). torch's process groups
take any dtype, strided views, and ReduceOps mpx has no kernel for. So::

    moving data (broadcast, gather, all_to_all, send, ...)   the raw bytes, as uint8
    reducing int8, int16, uint16, uint32                     widened to int32/int64, then
                                                             narrowed back (sums wrap as
                                                             in the narrow type)
    reducing bool                                            uint8; SUM/MAX as MAX (or),
                                                             PRODUCT/MIN as MIN (and)
    reducing complex                                         its real view (SUM, AVG)
    BAND, BOR, BXOR                                          gathered, then folded in rank
                                                             order on every rank

Each form is a tensor mpx can take plus what copies its result back into
the caller's tensor. Those copies, and mpx's own (an AVG's division, the
16-bit floats' float32 copy), are torch operations that bump the caller's
version counter where gloo, writing through raw pointers, bumps none:
:func:`versions_as_gloo` puts the counters back as gloo leaves them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from mpx.collectives.base import (
    SUPPORTED_DTYPES,
    MPXTypeError,
    MPXValueError,
    set_versions,
    writable,
)

__all__ = [
    "BITWISE",
    "ReduceForm",
    "as_bytes",
    "bytes_of",
    "op_label",
    "reduce_form",
    "reduce_op",
    "versions_as_gloo",
]

_OPS = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.AVG: "avg",
    dist.ReduceOp.MAX: "max",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.PRODUCT: "prod",
}
BITWISE: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "band": torch.bitwise_and,
    "bor": torch.bitwise_or,
    "bxor": torch.bitwise_xor,
}
_BITWISE_OPS = {
    dist.ReduceOp.BAND: "band",
    dist.ReduceOp.BOR: "bor",
    dist.ReduceOp.BXOR: "bxor",
}
# Narrow integers are reduced in a dtype MPI knows; the result is narrowed back.
_WIDEN = {
    torch.int8: torch.int32,
    torch.int16: torch.int32,
    torch.uint16: torch.int32,
    torch.uint32: torch.int64,
}


def op_label(reduce_op: Any) -> str:
    """``ReduceOp.BXOR`` for errors, not ``<ReduceOp object at 0x...>``."""
    kind = getattr(reduce_op, "op", reduce_op)  # a ReduceOp holds its RedOpType in .op
    name = getattr(kind, "name", None)
    if name is None:
        for member, value in dist.ReduceOp.RedOpType.__members__.items():
            if reduce_op == value:
                name = member
    return f"ReduceOp.{name}" if name else repr(reduce_op)


def reduce_op(reduce_op: Any, op: str) -> str:
    """mpx's name of a torch ReduceOp: sum, avg, max, min, prod, band, bor or bxor."""
    for table in (_OPS, _BITWISE_OPS):
        for key, name in table.items():
            if reduce_op == key:
                return name
    raise MPXValueError(
        f"{op}: {op_label(reduce_op)} is not supported by the mpx backend; use SUM, AVG, MAX, "
        "MIN, PRODUCT, BAND, BOR or BXOR (PREMUL_SUM: scale the tensor, then SUM)"
    )


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory as a flat uint8 tensor (``t`` must be contiguous)."""
    return t.reshape(-1).view(torch.uint8)


def bytes_of(t: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
    """A contiguous uint8 view of ``t``'s data, and what writes it back into ``t``.

    For a contiguous ``t`` the view is its memory and writing back does
    nothing; a strided ``t`` is copied and the copy written back.
    """
    _check_device(t)
    if t.is_contiguous():
        return as_bytes(t), _nothing
    dense = t.contiguous()

    def write_back() -> None:
        t.copy_(dense)

    return as_bytes(dense), write_back


def _nothing() -> None:
    pass


def _check_device(t: torch.Tensor) -> None:
    if t.is_sparse:
        raise MPXTypeError(
            "the mpx backend takes sparse tensors only in all_reduce; convert with "
            "t.to_dense(), or use a gloo group for this call"
        )
    if t.device.type not in ("cpu", "cuda"):
        raise MPXValueError(
            f"the mpx backend supports cpu and cuda tensors, got one on {t.device}; "
            "move it with .cpu() or .cuda()"
        )


class ReduceForm:
    """A tensor mpx can reduce with ``op``, standing for the caller's ``tensor``.

    Attributes:
        tensor: contiguous, of a dtype mpx reduces.
        op: mpx's op for it (a bool SUM becomes MAX, ...).
    """

    def __init__(self, original: torch.Tensor, tensor: torch.Tensor, op: str) -> None:
        self.original, self.tensor, self.op = original, tensor, op

    def write_back(self) -> None:
        """Puts the reduced value into the caller's tensor (no-op when it is that tensor)."""
        if self.tensor.data_ptr() == self.original.data_ptr() and (
            self.tensor.dtype == self.original.dtype
        ):
            return
        if self.original.is_complex():
            self.original.copy_(torch.view_as_complex(self.tensor))
        else:
            self.original.copy_(self.tensor.to(self.original.dtype))


def reduce_form(t: torch.Tensor, op: str, where: str) -> ReduceForm:
    """The form in which mpx reduces ``t`` with ``op`` (see the module docstring).

    Raises:
        MPXTypeError: naming ``where`` and the dtype, for a dtype or op mpx cannot reduce.
    """
    _check_device(t)
    t = writable(t)  # every form below, and its write_back, may then write in place
    dtype = t.dtype
    if op in BITWISE:
        if dtype.is_floating_point or dtype.is_complex:
            raise MPXTypeError(
                f"{where}: {op.upper()} needs an integer or bool tensor, got {dtype}; "
                "view the bits as an integer dtype (t.view(torch.int32))"
            )
        return ReduceForm(t, t.contiguous(), op)
    if dtype.is_complex:
        if op not in ("sum", "avg"):
            raise MPXTypeError(
                f"{where}: ReduceOp {op.upper()} has no meaning for complex {dtype}; use SUM or "
                "AVG, or reduce t.real and t.imag separately"
            )
        return ReduceForm(t, torch.view_as_real(t.contiguous()).contiguous(), op)
    if dtype == torch.bool:
        if op == "avg":
            raise MPXTypeError(f"{where}: AVG needs a floating dtype, got bool; use SUM (or)")
        logical = "max" if op in ("sum", "max") else "min"
        return ReduceForm(t, t.to(torch.uint8), logical)
    if dtype in _WIDEN:
        return ReduceForm(t, t.to(_WIDEN[dtype]), op)
    if dtype not in SUPPORTED_DTYPES:
        raise MPXTypeError(
            f"{where}: the mpx backend cannot reduce {dtype}; convert with t.to(torch.float32)"
        )
    return ReduceForm(t, t.contiguous(), op)


def versions_as_gloo(written: Sequence[torch.Tensor], bumps: int = 0) -> Callable[[], None]:
    """What sets ``written``'s version counters to their values now plus ``bumps``.

    Called as an operation starts, run when it has written its outputs. gloo
    writes a collective's results through raw pointers, so autograd sees no
    in-place change (``t._version`` stays as it was after an all_reduce, a
    broadcast, a scatter, a recv), except where it copies out of a buffer of
    its own with torch: one bump per copy (each output of all_gather and
    reduce_scatter, every tensor of allreduce_coalesced, all_gather_into_tensor's
    output once per rank). ``bumps`` is that count for the operation.
    Inference tensors have no version counter, and are left out.
    """
    tensors = tuple(t for t in written if not t.is_inference())
    versions = tuple(t._version + bumps for t in tensors)

    def settle() -> None:
        set_versions(tensors, versions)

    return settle
