"""Element-wise reductions in torch, shared by the ring and shared-memory implementations."""

from __future__ import annotations

import torch
from torch.utils.dlpack import from_dlpack

from mpx.collectives.base.dtypes import accumulation_dtype

__all__ = ["combine", "finish", "reduce_into", "working_copy", "writable"]


def writable(t: torch.Tensor) -> torch.Tensor:
    """``t``, or where ``t`` is an inference tensor outside inference mode an alias of its
    memory that torch lets us write in place.

    gloo writes results through raw pointers, so ``all_reduce`` of a tensor made
    under ``torch.inference_mode()`` works after the mode ends; mpx's own writes
    in torch (a 16-bit float's float32 result, a widened integer's, an AVG's
    division) would raise "Inplace update to inference tensor outside
    InferenceMode". The alias (DLPack: the same memory, strides and device) is a
    normal tensor; inference tensors have no version counter to keep.
    """
    if t.layout == torch.strided and t.is_inference() and not torch.is_inference_mode_enabled():
        return from_dlpack(t)
    return t


def reduce_into(acc: torch.Tensor, x: torch.Tensor, op: str) -> None:
    """``acc = acc (op) x`` in place; ``avg`` accumulates as a sum."""
    if op in ("sum", "avg"):
        acc.add_(x)
    elif op == "prod":
        acc.mul_(x)
    elif op == "max":
        torch.maximum(acc, x, out=acc)
    else:
        torch.minimum(acc, x, out=acc)


def combine(a: torch.Tensor, b: torch.Tensor, op: str, out: torch.Tensor) -> None:
    """``out = a (op) b`` in one pass over memory."""
    if op in ("sum", "avg"):
        torch.add(a, b, out=out)
    elif op == "prod":
        torch.mul(a, b, out=out)
    elif op == "max":
        torch.maximum(a, b, out=out)
    else:
        torch.minimum(a, b, out=out)


def working_copy(t: torch.Tensor, op: str, copy: bool = False) -> torch.Tensor:
    """The flat tensor to reduce in: ``t`` itself, or a float32 copy for 16-bit floats.

    16-bit floats accumulate in float32 so that P-1 roundings do not pile up.
    """
    acc = accumulation_dtype(t.dtype)
    flat = t.reshape(-1)
    if acc != t.dtype:
        return flat.to(acc)
    return flat.clone() if copy else flat


def finish(t: torch.Tensor, work: torch.Tensor, op: str, size: int) -> torch.Tensor:
    """Divides for ``avg`` and copies the result back into ``t`` if ``work`` is a copy."""
    t = writable(t)
    if work.data_ptr() == t.data_ptr():
        work = writable(work)  # a flat view of an inference t (working_copy)
    if op == "avg":
        work.div_(size)
    if work.data_ptr() != t.data_ptr() or work.dtype != t.dtype:
        t.copy_(work.view(t.shape))
    return t
