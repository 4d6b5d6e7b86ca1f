"""The weight gradients of a chunk, deferred from ``I`` to ``W`` as small records.

A zero-bubble schedule splits a backward into ``I`` (the gradient of the
chunk's input, on the critical path) and ``W`` (the weights' gradients, run
later to fill what would be idle time). If ``W`` differentiated the autograd
graph again, ``I`` would have to keep the whole graph of the micro-batch
alive until ``W`` runs (every attention score, every activation saved for
backward): far more memory than 1F1B holds. As in the Zero Bubble paper, a
weight's gradient needs only the inputs of the operations that use it and
the gradients of their outputs. For a matrix product::

    grad_weight = grad_output^T @ input        grad_bias = grad_output.sum(0)

:mod:`mpx.pipeline.split_backward.graph_split` finds in a chunk's autograd graph the matrix
products that take one of its weights (or, for a chunk whose graph shows
another use of a weight, :mod:`mpx.pipeline.split_backward.capture` finds every operation
that takes one while the forward runs), and leaves in this module's
:class:`Records`, per operation, what ``W`` needs:

- a matrix product with a weight (``F.linear``, ``torch.addmm`` as in GPT-2's
  ``Conv1D``, ``x @ W``): a :data:`Record` ``(input, grad_output, weight,
  bias, transposed)``, and ``W`` is one matrix product per record
  (the graph path leaves the bias to ``I``; under the capture mode
  :class:`Product` is the operation whose backward leaves it);
- any other operation with a weight of two or more dimensions (a
  convolution, ``nn.MultiheadAttention``'s forward, an LSTM): a :class:`Local`,
  the operation's own small graph (run on detached copies of its inputs, so it
  keeps only what that operation saved) with the gradients of its outputs,
  and ``W`` differentiates it.

``I`` is then an ordinary ``torch.autograd.backward`` without
``retain_graph``: the chunk's graph is freed as it runs, and every weight
left out (norms' scales, biases used on their own, embeddings, computed
weights) gets its gradient there, exactly as autograd computes it. ``W`` is
:func:`weight_grads`: the records' gradients, accumulated into the weights'
``.grad`` (a weight used twice gets both).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn import functional as F

__all__ = [
    "Held",
    "Local",
    "Product",
    "Record",
    "Records",
    "accumulate",
    "held_bytes",
    "weight_grads",
]

Record = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, bool]
"""``(input, grad_output, weight, bias, transposed)`` of one matrix product, kept by ``I``
for ``W``: ``output = input @ weight^T + bias`` (``F.linear``), or with ``transposed``
``output = input @ weight + bias`` (``torch.addmm``, ``x @ W``)."""


@dataclass
class Local:
    """One operation's own graph, kept by ``I`` for ``W``: its outputs' gradient edges and
    gradients, the detached copies of the weights it ran on and the weights themselves.

    ``saved`` holds the tensors the operation saved for its backward (the weights
    left out): what it keeps alive, counted in :class:`Held`."""

    edges: list[Any]
    grads: list[torch.Tensor]
    copies: list[torch.Tensor]
    weights: list[torch.Tensor]
    saved: list[torch.Tensor] = field(default_factory=list)


class Held:
    """Bytes kept for ``W`` by every :class:`Records` of one rank's passes (inputs and
    output gradients; a tensor in two records counts twice)."""

    def __init__(self) -> None:
        self.bytes = 0


class Records(list[Record]):
    """One micro-batch's records (and, in :attr:`ops`, its :class:`Local` ones), counted
    in a :class:`Held`."""

    def __init__(self, held: Held | None = None) -> None:
        super().__init__()
        self.held = held if held is not None else Held()
        self.ops: list[Local] = []
        self.bytes = 0  # what these records add to ``held``
        # The forward ran under the capture mode: its calls record in I themselves
        # (else I reads the products from the graph: mpx.pipeline.split_backward.graph_split).
        self.captured = False
        self.weights: list[torch.Tensor] = []  # what the forward's products may defer

    def __bool__(self) -> bool:
        return len(self) > 0 or len(self.ops) > 0

    def add(self, record: Record) -> None:
        self.append(record)
        self._count(record[0].nbytes + record[1].nbytes)

    def add_op(self, op: Local) -> None:
        self.ops.append(op)
        self._count(_nbytes([*op.saved, *op.grads]))

    def _count(self, n: int) -> None:
        self.bytes += n
        self.held.bytes += n

    def clear(self) -> None:
        """Forgets the records (after ``W``, or a failed call) and their bytes."""
        self.held.bytes -= self.bytes
        self.bytes = 0
        self.ops.clear()
        self.captured = False
        self.weights = []
        super().clear()


def _nbytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of ``tensors``, a tensor (or an equal view of it) once."""
    return sum(n for _, n in {(t.data_ptr(), t.nbytes) for t in tensors})


class Product(torch.autograd.Function):
    """A matrix product with a weight whose backward gives the input's gradient only and
    records the rest (:data:`Record`)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        transposed: bool,
        records: Records,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.bias, ctx.transposed, ctx.records = bias, transposed, records
        if not transposed:
            return F.linear(x, weight, bias)
        if bias is not None and x.dim() == 2:
            return torch.addmm(bias, x, weight)
        out = x @ weight
        return out if bias is None else out.add_(bias)

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, None, None, None, None]:
        x, weight = ctx.saved_tensors
        ctx.records.add((x, grad, weight, ctx.bias, ctx.transposed))
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        gx = grad @ weight.t() if ctx.transposed else grad @ weight
        return gx, None, None, None, None


def accumulate(t: torch.Tensor, g: torch.Tensor) -> None:
    """Adds a weight gradient ``W`` computed to ``t.grad`` (both W paths: records here,
    a kept graph in :mod:`mpx.pipeline.split_backward.retained`)."""
    with torch.no_grad():
        if t.grad is None:
            # A tensor of its own, as AccumulateGrad stores, never ``g`` itself: where
            # the weight's gradient is its operation's output gradient passed through
            # (``x + W`` with W of the output's shape), ``g`` is the gradient the
            # next stage sent, a pooled receive buffer that the next message refills
            # after W (a second step's gradients came out wrong so).
            t.grad = g.clone(memory_format=torch.contiguous_format)
        else:
            t.grad.add_(g)


def _products(records: list[Record]) -> None:
    for x, grad, weight, bias, transposed in records:
        g2 = grad.reshape(-1, grad.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        a, b = (x2.t(), g2) if transposed else (g2.t(), x2)
        if weight.grad is None:
            weight.grad = a @ b
        else:
            weight.grad.addmm_(a, b)  # no temporary, one pass over .grad
        if bias is not None and bias.requires_grad:
            accumulate(bias, g2.sum(0))


def _locals(ops: list[Local]) -> None:
    """One autograd call for every operation's graph (they are disjoint): each weight
    copy's gradient, accumulated into the weight it was copied from."""
    edges = [e for op in ops for e in op.edges]
    copies = [c for op in ops for c in op.copies]
    if not edges or not copies:
        return
    with torch.enable_grad():  # W may run inside a caller's no_grad
        got = torch.autograd.grad(
            edges, copies, [g for op in ops for g in op.grads], allow_unused=True
        )
    weights = [w for op in ops for w in op.weights]
    for w, g in zip(weights, got, strict=True):
        if g is not None:
            accumulate(w, g)


def weight_grads(records: Records) -> None:
    """``W``: each record's weight (and bias) gradient, accumulated into ``.grad``; empties it."""
    if records.ops:
        _locals(records.ops)
    with torch.no_grad():
        _products(records)
    records.clear()


def held_bytes(records: Records) -> int:
    """Bytes of the inputs and output gradients ``records`` keep (a tensor in two records
    once; a view counts its own elements, not its whole storage)."""
    tensors = [t for x, grad, *_ in records for t in (x, grad)]
    return _nbytes(tensors + [t for op in records.ops for t in (*op.saved, *op.grads)])
