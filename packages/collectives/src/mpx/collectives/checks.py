"""Argument checks shared by every operation: clear errors before any communication."""

from __future__ import annotations

import torch

from mpx.collectives.dtypes import SUPPORTED_DTYPES

__all__ = ["check_rank", "check_tensor"]


def check_tensor(t: object, op: str, name: str = "tensor") -> torch.Tensor:
    """Raises TypeError/ValueError for input no implementation can take."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        supported = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        raise TypeError(
            f"{op}: dtype {t.dtype} is not supported (supported: {supported}); "
            f"convert with {name}.to(torch.float32) or view its bytes as torch.uint8"
        )
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{op}: {name} is on device {t.device}; mpx supports cpu and cuda tensors")
    if not t.is_contiguous():
        raise ValueError(
            f"{op}: {name} of shape {tuple(t.shape)} is not contiguous (strides {t.stride()}); "
            f"operate on c = {name}.contiguous() and copy the result back with {name}.copy_(c)"
        )
    return t


def check_rank(value: int, size: int, what: str, op: str) -> int:
    if not isinstance(value, int) or not 0 <= value < size:
        raise ValueError(f"{op}: {what} must be a rank in [0, {size}), got {value!r}")
    return value
