"""The one place a gradient bucket is reduced: plain allreduce, or mpx-quantize's.

``compression=None`` runs mpx-collectives' non-blocking allreduce and returns
its handle, so backward keeps running while the bucket travels. With a
``mpx.quantize.CompressionConfig`` the bucket goes through
``mpx.quantize.allreduce(flat, comm=comm, config=config, op=op)`` (imported
here, lazily: mpx-quantize is an optional extra), which completes before it
returns.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol

import torch

from mpx.collectives import Communicator, allreduce

__all__ = ["Waitable", "quantized_allreduce", "reduce_bucket"]


class Waitable(Protocol):
    """What a launched reduction gives back: ``done()`` polls, ``wait()`` finishes."""

    def done(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> Any: ...


class _Completed:
    """A reduction that finished when it was launched."""

    def __init__(self, result: torch.Tensor) -> None:
        self.result = result

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        return self.result


def quantized_allreduce() -> Callable[..., Any]:
    """``mpx.quantize.allreduce``, or an ImportError that says what to install."""
    try:
        module = importlib.import_module("mpx.quantize")
    except ImportError as error:
        raise ImportError(
            "compression= needs mpx-quantize: pip install 'mpx-dataparallel[quantize]'"
        ) from error
    function = getattr(module, "allreduce", None)
    if function is None:
        raise ImportError(
            f"compression= needs mpx.quantize.allreduce, which mpx-quantize "
            f"{getattr(module, '__version__', '?')} does not provide yet; upgrade mpx-quantize "
            "or pass compression=None"
        )
    return function  # type: ignore[no-any-return]


def reduce_bucket(
    flat: torch.Tensor, comm: Communicator, compression: Any | None, op: str
) -> Waitable:
    """Starts the reduction of one flat bucket (in place) across ``comm``.

    Args:
        flat: a contiguous CPU tensor holding the bucket's gradients.
        compression: None, or an ``mpx.quantize.CompressionConfig``.
        op: ``"avg"`` or ``"sum"``.
    """
    if compression is None:
        return allreduce(flat, op, comm=comm, async_op=True)
    result = quantized_allreduce()(flat, comm=comm, config=compression, op=op)
    if isinstance(result, torch.Tensor) and result is not flat:
        flat.copy_(result)
    return _Completed(flat)
