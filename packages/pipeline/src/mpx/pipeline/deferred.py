"""The weight gradients of a chunk's Linear layers, deferred from ``I`` to ``W``.

A zero-bubble schedule splits a backward into ``I`` (the gradient of the
chunk's input, on the critical path) and ``W`` (the weights' gradients, run
later to fill what would be idle time). If ``W`` differentiated the autograd
graph again, ``I`` would have to keep the whole graph of the micro-batch
alive until ``W`` runs (every attention score, every activation saved for
backward): far more memory than 1F1B holds. As in the Zero Bubble paper, a
Linear's weight gradient needs only two tensors::

    grad_weight = grad_output^T @ input        grad_bias = grad_output.sum(0)

So, while a chunk whose backward will be split runs its forward,
:func:`capturing` routes each of its ``nn.Linear`` layers (not subclasses
with a forward of their own) through :class:`_DeferredLinear`: a linear map
whose backward computes only the input's gradient and appends
``(input, grad_output, weight, bias)`` to the micro-batch's record list.
``I`` is then an ordinary ``torch.autograd.backward`` without
``retain_graph``: the graph is freed as it runs, and every other weight
(LayerNorm, embeddings, a Linear's weight tied to another layer, anything
not a Linear) gets its gradient there, exactly as autograd computes it.
``W`` is :func:`weight_grads`: two matrix products per record, accumulated
into the weights' ``.grad`` (a weight used twice gets both records). A chunk
with weights of other kinds (:func:`deferrable` says which) keeps its graph
for ``W`` instead (:mod:`mpx.pipeline.retained`).

Only leaf weights requiring a gradient are deferred (what autograd would
accumulate into ``.grad``); a computed weight (a parametrization, a view)
runs the plain layer, its gradient in ``I``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

__all__ = [
    "Held",
    "Record",
    "Records",
    "capturing",
    "deferrable",
    "held_bytes",
    "linear_layers",
    "weight_grads",
]

Record = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]
"""``(input, grad_output, weight, bias)`` of one Linear call, kept by ``I`` for ``W``."""


class Held:
    """Bytes kept for ``W`` by every :class:`Records` of one rank's passes (inputs and
    output gradients; a tensor in two records counts twice)."""

    def __init__(self) -> None:
        self.bytes = 0


class Records(list[Record]):
    """One micro-batch's records, counted in a :class:`Held`."""

    def __init__(self, held: Held | None = None) -> None:
        super().__init__()
        self.held = held if held is not None else Held()
        self.bytes = 0  # what these records add to ``held``

    def add(self, record: Record) -> None:
        self.append(record)
        n = record[0].nbytes + record[1].nbytes
        self.bytes += n
        self.held.bytes += n

    def clear(self) -> None:
        """Forgets the records (after ``W``, or a failed call) and their bytes."""
        self.held.bytes -= self.bytes
        self.bytes = 0
        super().clear()


class _DeferredLinear(torch.autograd.Function):
    """``F.linear`` whose backward gives the input's gradient only and records the rest."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        records: Records,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.bias, ctx.records = bias, records
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        x, weight = ctx.saved_tensors
        ctx.records.add((x, grad, weight, ctx.bias))
        gx = grad @ weight if ctx.needs_input_grad[0] else None
        return gx, None, None, None


def _deferrable(t: torch.Tensor | None) -> bool:
    return t is None or (t.requires_grad and t.grad_fn is None)


def _forward(layer: nn.Linear, records: Records, x: torch.Tensor) -> torch.Tensor:
    w, b = layer.weight, layer.bias  # the tensors functional_call swapped in, if any
    if w.requires_grad and _deferrable(w) and _deferrable(b) and torch.is_grad_enabled():
        out: torch.Tensor = _DeferredLinear.apply(x, w, b, records)  # type: ignore[no-untyped-call]
        return out
    return F.linear(x, w, b)


def linear_layers(module: nn.Module) -> list[nn.Linear]:
    """The layers :func:`capturing` defers: ``nn.Linear`` and subclasses keeping its forward."""
    return [
        m
        for m in module.modules()
        if isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward
    ]


# Modules whose weight gradients are about as cheap as an elementwise pass over
# their output (a scale and shift, a scatter of rows): ``I`` computes them.
_CHEAP: tuple[type[nn.Module], ...] = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.modules.batchnorm._NormBase,
    nn.Embedding,
    nn.EmbeddingBag,
    nn.PReLU,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)


def deferrable(layers: Sequence[nn.Module]) -> bool:
    """Whether the split backward of these layers can run as records (this module):
    every module holding a parameter that needs a gradient is a deferred Linear
    (:func:`linear_layers`) or cheap to differentiate in ``I`` (norms, embeddings).
    Any other (a convolution, a module's own ``nn.Parameter``) keeps the graph
    to ``W`` instead: its weight work would otherwise all land in ``I``."""
    for layer in layers:
        linears = set(map(id, linear_layers(layer)))
        for m in layer.modules():
            own = [q for q in m._parameters.values() if q is not None and q.requires_grad]
            if own and id(m) not in linears and not isinstance(m, _CHEAP):
                return False
    return True


@contextlib.contextmanager
def capturing(layers: Sequence[nn.Linear], records: Records) -> Iterator[None]:
    """Within the block, ``layers`` run as :class:`_DeferredLinear` recording into ``records``.

    The layers' own ``forward`` is shadowed by an instance attribute for the
    block only (module hooks still run: ``__call__`` is untouched).
    """
    for layer in layers:
        layer.__dict__["forward"] = _bound(layer, records)
    try:
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)


def _bound(layer: nn.Linear, records: Records) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return _forward(layer, records, x)

    return forward


def _accumulate(t: torch.Tensor, g: torch.Tensor) -> None:
    if t.grad is None:
        t.grad = g
    else:
        t.grad.add_(g)


def weight_grads(records: Records) -> None:
    """``W``: each record's weight (and bias) gradient, accumulated into ``.grad``; empties it."""
    with torch.no_grad():
        for x, grad, weight, bias in records:
            g2 = grad.reshape(-1, grad.shape[-1])
            x2 = x.reshape(-1, x.shape[-1])
            if weight.grad is None:
                weight.grad = g2.t() @ x2
            else:
                weight.grad.addmm_(g2.t(), x2)  # no temporary, one pass over .grad
            if bias is not None and bias.requires_grad:
                _accumulate(bias, g2.sum(0))
    records.clear()


def held_bytes(records: list[Record]) -> int:
    """Bytes of the inputs and output gradients ``records`` keep (a tensor in two records
    once; a view counts its own elements, not its whole storage)."""
    seen = {(t.data_ptr(), t.nbytes) for x, grad, _, _ in records for t in (x, grad)}
    return sum(n for _, n in seen)
