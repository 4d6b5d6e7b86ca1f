"""The one place a gradient bucket is reduced: plain allreduce, or mpx-quantize's.

``compression=None`` runs mpx-collectives' non-blocking allreduce and returns
its handle, so backward keeps running while the bucket travels. With a
``mpx.quantize.CompressionConfig`` the bucket is cut back into its parameters
(views of the flat buffer, with their names and shapes) and goes through
``mpx.quantize.allreduce_tensors`` (imported here, lazily: mpx-quantize is an
optional extra), so that layer filtering applies as in CGX -- 1-D parameters,
excluded names (``exclude=``, ``exclude_layer``) and tensors under the minimum
size travel in full precision. It completes before it returns.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from mpx.collectives import Communicator, allreduce

__all__ = ["Waitable", "quantized_allreduce", "reduce_bucket", "steps_aside"]


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


def quantized_allreduce(name: str = "allreduce_tensors") -> Callable[..., Any]:
    """``mpx.quantize.<name>``, or an ImportError that says what to install."""
    try:
        module = importlib.import_module("mpx.quantize")
    except ImportError as error:
        raise ImportError(
            "compression= needs mpx-quantize: pip install 'mpx-dataparallel[quantize]'"
        ) from error
    function = getattr(module, name, None)
    if function is None:
        raise ImportError(
            f"compression= needs mpx.quantize.{name}, which mpx-quantize "
            f"{getattr(module, '__version__', '?')} does not provide yet; upgrade mpx-quantize "
            "or pass compression=None"
        )
    return function  # type: ignore[no-any-return]


def reduce_bucket(
    flat: torch.Tensor,
    comm: Communicator,
    compression: Any | None,
    op: str,
    layout: Sequence[tuple[str, torch.Size, int]] = (),
    state: Any | None = None,
    impl: str | None = None,
) -> Waitable:
    """Starts the reduction of one flat bucket (in place) across ``comm``.

    Args:
        flat: a contiguous CPU tensor holding the bucket's gradients.
        compression: None, or an ``mpx.quantize.CompressionConfig``.
        op: ``"avg"`` or ``"sum"``.
        layout: the bucket's parameters as (name, shape, offset in ``flat``):
            with compression, each is filtered as its own layer (CGX's
            ``exclude``); without a layout the bucket is one flat tensor.
        state: with compression, the ``mpx.quantize.QuantizeState`` to round
            with (None: mpx-quantize's default state of ``comm``).
        impl: without compression, the registered implementation that reduces
            the bucket (None: the policy's choice).
    """
    if compression is None:
        return allreduce(flat, op, comm=comm, impl=impl, async_op=True)
    if not layout:
        result = quantized_allreduce("allreduce")(
            flat, comm=comm, config=compression, op=op, state=state
        )
        if isinstance(result, torch.Tensor) and result is not flat:
            flat.copy_(result)
        return _Completed(flat)
    views = [flat[offset : offset + shape.numel()].view(shape) for _, shape, offset in layout]
    names = [name for name, _, _ in layout]
    quantized_allreduce()(views, comm, compression, op, names=names, state=state)
    return _Completed(flat)


def steps_aside(compression: Any | None, state: Any | None) -> bool:
    """Whether ``compression=CompressionConfig(when="auto")`` measured, in the step just
    reduced, the plain allreduce faster for every bucket: the optimizer then reduces
    with ``compression=None`` from the next step on, non-blocking as without
    compression, instead of through mpx.quantize's blocking path for the same bits."""
    choices: Any = getattr(state, "choices", None)
    return (
        getattr(compression, "when", "always") == "auto"
        and bool(choices)
        and not any(choice.compressed for choice in choices.values())
    )
