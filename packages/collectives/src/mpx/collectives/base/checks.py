"""Argument checks shared by every operation: clear errors before any communication."""

from __future__ import annotations

import math
from numbers import Real

import torch

from mpx.collectives.base.dtypes import SUPPORTED_DTYPES
from mpx.collectives.base.errors import MPXTypeError, MPXValueError

__all__ = ["as_limit", "check_rank", "check_tensor", "check_timeout"]


def check_tensor(t: object, op: str, name: str = "tensor") -> torch.Tensor:
    """Raises TypeError/ValueError for input no implementation can take."""
    if not isinstance(t, torch.Tensor):
        raise MPXTypeError(
            f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}; "
            "convert it with torch.as_tensor(...)"
        )
    if t.dtype not in SUPPORTED_DTYPES:
        supported = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        raise MPXTypeError(
            f"{op}: dtype {t.dtype} is not supported (supported: {supported}); "
            f"convert with {name}.to(torch.float32) or view its bytes as torch.uint8"
        )
    if t.device.type not in ("cpu", "cuda"):
        raise MPXValueError(
            f"{op}: {name} is on device {t.device}; mpx supports cpu and cuda tensors: "
            f"move it with {name}.cpu() or {name}.cuda()"
        )
    if not t.is_contiguous():
        raise MPXValueError(
            f"{op}: {name} of shape {tuple(t.shape)} is not contiguous (strides {t.stride()}); "
            f"operate on c = {name}.contiguous() and copy the result back with {name}.copy_(c)"
        )
    return t


def check_rank(value: int, size: int, what: str, op: str) -> int:
    if isinstance(value, bool):
        # True is an int to Python (rank 1), but a root of True is a mix-up
        # (a flag passed where the rank goes), not a choice of rank 1.
        raise MPXTypeError(
            f"{op}: {what} must be a rank (an int in [0, {size})), got the bool {value!r}; "
            f"pass the rank itself, e.g. {what}=0"
        )
    if not isinstance(value, int) or not 0 <= value < size:
        raise MPXValueError(f"{op}: {what} must be a rank in [0, {size}), got {value!r}")
    return value


def check_timeout(value: object, where: str) -> float | None:
    """``value`` as a timeout in seconds: None, a number > 0, or ``math.inf``.

    None defers to the default (the communicator's, ``MPX_TIMEOUT``); inf is
    "no limit" (as ``MPX_TIMEOUT=inf`` already was), also where a default is
    set. Checked before anything moves: a timeout of 0 or less used to start
    the call and expire at once, leaving the communicator broken for every
    later call, and a NaN one never expired.

    Raises:
        MPXTypeError: not a number (a bool, a string, a ``timedelta``).
        MPXValueError: zero, negative or NaN.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, Real):
        hint = "timeout=delta.total_seconds()" if hasattr(value, "total_seconds") else "timeout=60"
        raise MPXTypeError(
            f"{where}: timeout must be a number of seconds > 0 (or None), got {value!r} of "
            f"type {type(value).__name__}; pass e.g. {hint}"
        )
    seconds = float(value)
    if not seconds > 0:  # also NaN
        raise MPXValueError(
            f"{where}: timeout must be a number of seconds > 0, got {value!r}; pass e.g. "
            "timeout=60, or None for the communicator's (MPX_TIMEOUT), math.inf for no limit"
        )
    return seconds


def as_limit(seconds: float | None) -> float | None:
    """A checked timeout as a deadline's length: None (no deadline) for None or inf."""
    return None if seconds is None or seconds == math.inf else seconds
