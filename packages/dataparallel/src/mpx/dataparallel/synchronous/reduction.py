"""The one place a gradient bucket's reduction is chosen and started.

:data:`REDUCTIONS` lists every way ``DistributedOptimizer`` reduces a bucket,
in the order they are asked, each with when it is taken -- as mpx-collectives'
registry lists its implementations and when ``auto`` may take each::

    compression=None            "allreduce": mpx-collectives' non-blocking allreduce;
                                impl= names the implementation (its registry checks
                                the name and the buckets), None: the policy's choice
    compression=CompressionConfig, the bucket's parameters known
                                "quantized layers": mpx.quantize.allreduce_tensors,
                                each parameter filtered as its own layer
    compression=CompressionConfig, one flat bucket
                                "quantized bucket": mpx.quantize.allreduce

``compression=None`` returns the allreduce's handle, so backward keeps running
while the bucket travels. With a ``mpx.quantize.CompressionConfig`` the bucket
is cut back into its parameters (views of the flat buffer, with their names
and shapes) and goes through ``mpx.quantize.allreduce_tensors`` (imported
here, lazily: mpx-quantize is an optional extra), so that layer filtering
applies as in CGX -- 1-D parameters, excluded names (``exclude=``,
``exclude_layer``) and tensors under the minimum size travel in full
precision. It completes before it returns. (``impl='cgx'``, mpx-quantize's
implementation in mpx-collectives' registry, is the first row: whole buckets
quantized with the ``MPX_QUANTIZE_*`` settings.)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from mpx.collectives import Communicator, all_implementations, allreduce
from mpx.dataparallel.errors import DataParallelTypeError, DataParallelValueError

__all__ = [
    "REDUCTIONS",
    "BucketLike",
    "Reduction",
    "Waitable",
    "check_buckets",
    "check_choice",
    "choose",
    "quantize_module",
    "quantized_allreduce",
    "reduce_bucket",
    "shared_buckets",
    "steps_aside",
]

Layout = Sequence[tuple[str, torch.Size, int]]

# What the optimizer passes with each bucket: its parameters (never empty).
_BUCKET_LAYOUT: Layout = (("", torch.Size(), 0),)


class Waitable(Protocol):
    """What a launched reduction gives back: ``done()`` polls, ``wait()`` finishes."""

    def done(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> Any: ...


class BucketLike(Protocol):
    """What :func:`check_buckets` reads of a bucket (``buckets.Bucket``)."""

    dtype: torch.dtype
    numel: int

    @property
    def nbytes(self) -> int: ...


class _Completed:
    """A reduction that finished when it was launched."""

    def __init__(self, result: torch.Tensor) -> None:
        self.result = result

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        return self.result


def quantize_module(needed_by: str = "compression=") -> Any:
    """``mpx.quantize`` (an optional dependency), or an ImportError that says what
    ``needed_by`` needs and what to install."""
    try:
        return importlib.import_module("mpx.quantize")
    except ImportError as error:
        raise ImportError(
            f"{needed_by} needs mpx-quantize: pip install 'mpx-dataparallel[quantize]'"
        ) from error


def quantized_allreduce(name: str = "allreduce_tensors") -> Callable[..., Any]:
    """``mpx.quantize.<name>``, or an ImportError that says what to install."""
    module = quantize_module()
    function = getattr(module, name, None)
    if function is None:
        raise ImportError(
            f"compression= needs mpx.quantize.{name}, which mpx-quantize "
            f"{getattr(module, '__version__', '?')} does not provide yet; upgrade mpx-quantize "
            "or pass compression=None"
        )
    return function  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Reduction:
    """One way a bucket is reduced, and when it is taken.

    Attributes:
        name: what errors and docs call it.
        takes: ``takes(compression, layout)``: whether this row reduces a bucket
            with that ``compression=`` and ``layout`` (the bucket's parameters as
            (name, shape, offset); empty: one flat tensor). The first row of
            :data:`REDUCTIONS` that takes a bucket reduces it.
        start: ``start(flat, comm, compression, op, layout, state, impl)``: starts
            the reduction of ``flat`` in place; returns what ``wait()`` finishes.
        needs: the function of mpx-quantize it calls (imported only when this row
            is taken), or "" for mpx-collectives alone.
        takes_impl: ``impl=`` chooses its implementation (else ``impl=`` is refused).
        reads_shared: its implementation may read buckets in node-shared memory
            in place (``shm``): the optimizer then allocates them there.
        summary: one line for docs.
    """

    name: str
    takes: Callable[[Any | None, Layout], bool]
    start: Callable[..., Waitable]
    needs: str = ""
    takes_impl: bool = False
    reads_shared: bool = False
    summary: str = ""


def _plain(
    flat: torch.Tensor,
    comm: Communicator,
    compression: Any | None,
    op: str,
    layout: Layout,
    state: Any | None,
    impl: str | None,
) -> Waitable:
    return allreduce(flat, op, comm=comm, impl=impl, async_op=True)


def _quantized_layers(
    flat: torch.Tensor,
    comm: Communicator,
    compression: Any | None,
    op: str,
    layout: Layout,
    state: Any | None,
    impl: str | None,
) -> Waitable:
    views = [flat[offset : offset + shape.numel()].view(shape) for _, shape, offset in layout]
    names = [name for name, _, _ in layout]
    quantized_allreduce("allreduce_tensors")(views, comm, compression, op, names=names, state=state)
    return _Completed(flat)


def _quantized_bucket(
    flat: torch.Tensor,
    comm: Communicator,
    compression: Any | None,
    op: str,
    layout: Layout,
    state: Any | None,
    impl: str | None,
) -> Waitable:
    result = quantized_allreduce("allreduce")(
        flat, comm=comm, config=compression, op=op, state=state
    )
    if isinstance(result, torch.Tensor) and result is not flat:
        flat.copy_(result)
    return _Completed(flat)


REDUCTIONS: tuple[Reduction, ...] = (
    Reduction(
        "allreduce",
        lambda compression, layout: compression is None,
        _plain,
        takes_impl=True,
        reads_shared=True,
        summary="compression=None: mpx-collectives' non-blocking allreduce, by impl=",
    ),
    Reduction(
        "quantized layers",
        lambda compression, layout: bool(layout),
        _quantized_layers,
        needs="allreduce_tensors",
        summary="a CompressionConfig: mpx.quantize.allreduce_tensors, layer by layer",
    ),
    Reduction(
        "quantized bucket",
        lambda compression, layout: True,
        _quantized_bucket,
        needs="allreduce",
        summary="a CompressionConfig, no layout: mpx.quantize.allreduce on the flat bucket",
    ),
)
"""Every way a bucket is reduced, in the order they are asked: the one table."""


def choose(compression: Any | None, layout: Layout = ()) -> Reduction:
    """The first row of :data:`REDUCTIONS` that takes a bucket with ``compression`` and
    ``layout`` (the last row takes every bucket)."""
    return next(row for row in REDUCTIONS if row.takes(compression, layout))


def reduce_bucket(
    flat: torch.Tensor,
    comm: Communicator,
    compression: Any | None,
    op: str,
    layout: Layout = (),
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
    return choose(compression, layout).start(flat, comm, compression, op, layout, state, impl)


def check_choice(impl: object, compression: Any | None) -> None:
    """Fails now, not in the middle of backward, where the reduction ``compression`` and
    ``impl`` choose cannot run: mpx-quantize missing (ImportError naming the ``pip
    install``), ``impl=`` beside ``compression=``, or ``impl=`` naming no registered
    implementation of allreduce."""
    row = choose(compression, _BUCKET_LAYOUT)
    if row.needs:
        quantized_allreduce(row.needs)
    if impl is None:
        return
    if not row.takes_impl:
        raise DataParallelValueError(
            f"DistributedOptimizer: pass compression= or impl=, not both (got impl={impl!r} "
            "and a compression config); impl='cgx' quantizes whole buckets with the "
            "MPX_QUANTIZE_* settings, compression= filters layer by layer"
        )
    if not isinstance(impl, str):
        raise DataParallelTypeError(
            f"DistributedOptimizer: impl must be an implementation's name, got {impl!r}"
        )
    known = all_implementations()
    if impl != "auto" and (impl not in known or "allreduce" not in known[impl].provides):
        runs = [name for name, found in known.items() if "allreduce" in found.provides]
        hint = " ('cgx' comes with mpx-quantize: pip install 'mpx-dataparallel[quantize]')"
        raise DataParallelValueError(
            f"DistributedOptimizer: impl={impl!r} is not an implementation of allreduce; "
            f"use one of auto, {', '.join(runs)}{hint if impl == 'cgx' else ''}"
        )


def check_buckets(impl: str | None, buckets: Sequence[BucketLike], op: str) -> None:
    """Every bucket is a call ``impl`` accepts (its registry declarations: dtypes, reduce
    ops, sizes), so that a bucket it declines fails here, not in the middle of backward.
    ``auto`` and None (the policy's choice) pass every bucket to one that takes it."""
    if impl is None or impl == "auto":
        return
    declared = all_implementations()[impl]
    for bucket in buckets:
        declined = declared.declines(bucket.dtype, op, bucket.nbytes)
        if declined is not None:
            raise DataParallelValueError(
                f"DistributedOptimizer: a bucket of {bucket.numel} {bucket.dtype} gradient "
                f"values (op={op!r}) cannot be reduced: {declined}"
            )


def shared_buckets(impl: str | None, compression: Any | None) -> bool:
    """Whether the buckets may live in node-shared memory: the chosen row reads them in
    place, through an implementation that may be ``shm`` (the policy's or named)."""
    return choose(compression, _BUCKET_LAYOUT).reads_shared and impl in (None, "auto", "shm")


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
